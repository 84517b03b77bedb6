"""Schedules = layout + exchange. Registry used by ``ring_attention``, ``simulate_ring``, the DTensor
rule and the compile pass; ``get_schedule("auto")`` picks one of them from the head counts."""
from ..layouts import CONTIGUOUS, STRIPE, ZIGZAG
from .llama3 import Llama3
from .ring import RingSchedule

SCHEDULES = {
    "ring": RingSchedule("ring", CONTIGUOUS),
    "zigzag": RingSchedule("zigzag", ZIGZAG),
    "stripe": RingSchedule("stripe", STRIPE),
    "llama3": Llama3(),
}


class Auto:
    """``schedule="auto"``: the zigzag layout, and the exchange chosen per call from the head counts.

    llama3 (all-gather) when query heads >= ``llama3_min_ratio`` x key/value heads (strong GQA):
    K/V are then a small fraction of the traffic a ring step's compute hides, gathering them is
    cheap and the forward needs no merge; zigzag (P2P ring) otherwise. Both hold the same zigzag
    shards, so the choice never changes how inputs are sharded. To override: name the schedule,
    or set ``Auto.llama3_min_ratio``.
    """

    name, layout = "auto", ZIGZAG
    llama3_min_ratio = 4

    def pick(self, q, k):
        gqa_ratio = q.shape[1] // k.shape[1]
        return SCHEDULES["llama3" if gqa_ratio >= self.llama3_min_ratio else "zigzag"]

    def forward(self, comm, q, k, v, **options):
        return self.pick(q, k).forward(comm, q, k, v, **options)

    def backward(self, comm, dout, q, k, v, out, lse, **options):
        return self.pick(q, k).backward(comm, dout, q, k, v, out, lse, **options)


AUTO = Auto()


def get_schedule(name):
    if name == "auto":
        return AUTO
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is not a known schedule; valid schedules: "
                         f"{['auto', *sorted(SCHEDULES)]}")
    return SCHEDULES[name]


__all__ = ["AUTO", "SCHEDULES", "get_schedule"]
