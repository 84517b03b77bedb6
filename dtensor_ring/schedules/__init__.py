"""Schedules = layout + exchange. Registry used by ``ring_attention``, ``simulate_ring``, the DTensor
rule and the compile pass; ``get_schedule("auto")`` picks one of them from the head counts."""
from ..layouts import CONTIGUOUS, STRIPE, ZIGZAG
from .llama3 import Llama3
from .ring import RingSchedule
from .windowed import exchange_rows

SCHEDULES = {
    "ring": RingSchedule("ring", CONTIGUOUS),
    "zigzag": RingSchedule("zigzag", ZIGZAG),
    "stripe": RingSchedule("stripe", STRIPE),
    "llama3": Llama3(),
}


class Auto:
    """``schedule="auto"``: the zigzag layout, and the exchange chosen per call (docs/design.md,
    "The cost model of auto").

    With a sliding window, zigzag when its windowed exchange (``windowed.py``: K/V only from the
    ranks within reach) moves at most ``window_rows_ratio`` of what llama3's all-gather moves
    (the rank receiving most, in K/V rows): the window cuts the compute of both alike, but only
    the windowed exchange's bytes. Otherwise, llama3 (all-gather) when query heads >=
    ``llama3_min_ratio`` x key/value heads (strong GQA): K/V are then a small fraction of the
    traffic a ring step's compute hides, gathering them is cheap and the forward needs no merge;
    zigzag (P2P ring) otherwise. Both hold the same zigzag shards, so the choice never changes how
    inputs are sharded. To override: name the schedule, or set the two ratios.

    With packed documents, zigzag whatever the head counts: its ring sends only the long
    documents' rows and computes each step in one varlen call, where llama3's head groups
    multiply the calls (each with host time comparable to its compute, and each as long as its
    longest document's programs whatever its heads) and add a reordering copy per group. One
    rank at W = 4, 8K tokens per GPU, 32/8 heads, on an H100: zigzag 0.55 / 0.59 of the varlen
    ideal (fwd / fwd+bwd), llama3 0.22 / 0.30 (docs/results.md; fewer groups: docs/design.md,
    "Measurements behind design choices").
    """

    name, layout = "auto", ZIGZAG
    llama3_min_ratio = 4
    window_rows_ratio = 0.5

    def choose(self, q_heads: int, kv_heads: int, local_len: int, world: int,
               is_causal: bool = False, window=None, documents: bool = False) -> str:
        """The schedule's name, from ints (``consistency.py`` resolves it the same way)."""
        if documents:
            return "zigzag"
        if window is not None and world > 1:
            rows, _ = exchange_rows(ZIGZAG, local_len, world, is_causal, window)
            if rows <= self.window_rows_ratio * (world - 1) * local_len:
                return "zigzag"
        return "llama3" if q_heads // max(kv_heads, 1) >= self.llama3_min_ratio else "zigzag"

    def pick(self, q, k, world: int, is_causal: bool = False, window=None, docs=None):
        return SCHEDULES[self.choose(q.shape[1], k.shape[1], q.shape[2], world, is_causal,
                                     window, docs is not None)]

    def forward(self, comm, q, k, v, **options):
        picked = self.pick(q, k, comm.world_size, options["is_causal"], options.get("window"),
                           options.get("docs"))
        return picked.forward(comm, q, k, v, **options)

    def backward(self, comm, dout, q, k, v, out, lse, **options):
        picked = self.pick(q, k, comm.world_size, options["is_causal"], options.get("window"),
                           options.get("docs"))
        return picked.backward(comm, dout, q, k, v, out, lse, **options)


AUTO = Auto()


def get_schedule(name):
    if name == "auto":
        return AUTO
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is not a known schedule; valid schedules: "
                         f"{['auto', *sorted(SCHEDULES)]}")
    return SCHEDULES[name]


__all__ = ["AUTO", "SCHEDULES", "get_schedule"]
