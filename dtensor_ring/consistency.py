"""Cross-rank consistency: before the first exchange of a new kind of call, the ranks of the ring
agree on what they are about to exchange.

A ring attention call whose ranks disagree -- one rank with another local length, batch or head
count, another schedule, causality or precision -- would otherwise post messages of different sizes
(gloo aborts the process: "Received data size doesn't match expected size"; NCCL may hang or read
garbage) or, with equal sizes, compute a silent wrong result (zigzag shards attended as stripe).
``check`` turns each of these into a ``ValueError`` on every rank that names the differing fields,
the ranks and their values.

How: a call's *signature* is the tuple of ``FIELDS`` (below). The first time a rank sees a signature
on a process group, the ranks all-gather it: one int64 tensor of ``len(FIELDS)`` values per rank
(strings hashed), one small collective on the ring's own group. If every rank holds the same values
the signature is remembered for that group and later calls with it pay a lookup, no collective; if
not, every rank raises the same ``ValueError`` (all of them see the same gathered table), before any
of them posts an exchange: nobody is left waiting. A signature that failed is not remembered, so a
repeated mistake raises again.

On a 2-D mesh (ring x all-to-all, ``hybrid/``) the group is one of all the mesh's ranks
(``comm/mesh.whole_group``) and the signature holds the mesh's shape, so ranks calling with meshes
of different shapes over the same ranks (2 x 2 on some, 1 x 4 on others) are caught too.

Where it runs: eagerly, in ``ring_attention`` before its autograd function, and in the custom op
``dtensor_ring::ring_attention_fwd`` (the DTensor rule's path, and ``ring_attention`` while a
dispatch mode is active). Under ``torch.compile`` the op's fake implementation runs it while Dynamo
traces: once per compiled graph, no graph break and no guard of its own (the fake implementation
makes q/k/v's sizes constants first, ``ops.static_sizes``; the documents' count, symbolic, is read
from the traced example's value, which adds no guard). Dynamo reports an exception raised
while it traces as its own ``TorchRuntimeError``, whose message carries this ``ValueError``'s.

Limit: the cache is what makes steady-state calls free, and it cannot catch a rank whose signature
changes to one it has not checked while the others repeat one they have already checked: that rank
all-gathers and the others go on to exchange. No check can see that without a collective on every
call. ``set_mode("every")`` (or the environment variable ``DTENSOR_RING_CONSISTENCY=every``) does
exactly that, one small all-gather per call, for debugging; under ``torch.compile`` it applies to
the eager calls and to each trace, not to every run of a compiled graph (each length and head
count has its own graph, checked when it is traced). ``set_mode("off")`` skips the check.

Cost: the first call of a signature adds one small all-gather; a checked signature costs building
the key and a set lookup per call, below the noise of the ring call itself (timed with the check on
and off: docs/design.md, "Measurements behind design choices").
"""
import hashlib
import os
import struct
import weakref

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

from .layouts import LAYOUTS
from .schedules import AUTO, SCHEDULES, get_schedule
from .validation import PRECISIONS

MODES = ("new", "every", "off")
ENV = "DTENSOR_RING_CONSISTENCY"

# (field, what it is in the caller's terms). The order is the all-gathered tensor's layout; a new
# field goes at the end. ``documents`` / ``document_boundaries`` describe packed documents
# (``cu_seqlens``): their number, and a hash of their boundaries when they are on the CPU
# (reading a GPU tensor here would synchronise the device; -1 = not compared).
FIELDS = (
    ("batch", "query.shape[0]"),
    ("local_len", "query.shape[2], the local sequence length"),
    ("q_heads", "query.shape[1]"),
    ("kv_heads", "key.shape[1]"),
    ("head_dim", "query.shape[3]"),
    ("dtype", "query.dtype"),
    ("schedule", "the schedule that runs"),
    ("layout", "the schedule's layout"),
    ("is_causal", "is_causal"),
    ("precision", "precision"),
    ("scale", "scale"),
    ("documents", "number of packed documents (0: none)"),
    ("document_boundaries", "cu_seqlens (hashed)"),
    ("window_left", "window[0], the sliding window's left side (-1: unbounded or none)"),
    ("window_right", "window[1], the sliding window's right side (-1: unbounded or none)"),
    ("mesh", "the context-parallel mesh: ring ranks x all-to-all ranks"),
)
_STRINGS = ("dtype", "schedule", "layout", "precision")
_MAX_SIGNATURES = 4096  # per group; cleared when full (the same on every rank that agrees)

_mode = os.environ.get(ENV, "new")
if _mode not in MODES:
    raise ValueError(f"{ENV}={_mode!r} is not a valid consistency mode; valid: {list(MODES)}")
_checked: "weakref.WeakKeyDictionary[dist.ProcessGroup, set]" = weakref.WeakKeyDictionary()


def set_mode(mode: str) -> None:
    """``"new"`` (default): check each new signature once per group; ``"every"``: every call (one
    all-gather per call, for debugging); ``"off"``: never."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not a consistency-check mode; valid: {list(MODES)}")
    _mode = mode


def get_mode() -> str:
    return _mode


def clear() -> None:
    """Forget every checked signature (the next call of each checks again, on every rank: call it
    on all ranks or none)."""
    _checked.clear()


def _size(x) -> int:
    """An int from a size that may be symbolic under tracing: the example's value, read without
    adding a guard (-1 where there is none)."""
    if isinstance(x, torch.SymInt):
        hint = x.node.hint
        return -1 if hint is None or isinstance(hint, torch.SymInt) else int(hint)
    return int(x)


_NO_DOCUMENTS = (0, -1)
_MESH_BASE = 1 << 24  # the mesh field: ring ranks * _MESH_BASE + all-to-all ranks (0: 1-D)


def _documents(cu_seqlens) -> tuple[int, object]:
    if cu_seqlens is None:
        return _NO_DOCUMENTS
    count = _size(cu_seqlens.shape[0]) - 1
    if cu_seqlens.device.type != "cpu" or _is_fake(cu_seqlens):
        return count, -1
    return count, tuple(int(x) for x in cu_seqlens.tolist())


def _is_fake(x) -> bool:
    return isinstance(x, FakeTensor)


def signature(q, k, *, schedule: str, is_causal: bool, precision: str, scale: float,
              cu_seqlens=None, window=None, world: int = 1, mesh=None) -> tuple:
    """The values of ``FIELDS`` for one call (``schedule="auto"`` resolved to the one it runs).
    ``mesh``: (ring ranks, all-to-all ranks) of a 2-D mesh; None: a 1-D one."""
    batch, q_heads, local_len, head_dim = map(_size, q.shape)
    kv_heads = _size(k.shape[1])
    sched = get_schedule(schedule)
    if sched is AUTO:  # Auto.pick, on plain ints (symbolic head counts would add a guard)
        sched = SCHEDULES[AUTO.choose(q_heads, kv_heads, local_len, world, is_causal, window,
                                      cu_seqlens is not None)]
    return (batch, local_len, q_heads, kv_heads, head_dim, str(q.dtype), sched.name,
            sched.layout.name, bool(is_causal), precision, float(scale), *_documents(cu_seqlens),
            *((-1, -1) if window is None else tuple(window)),
            _MESH_BASE * mesh[0] + mesh[1] if mesh else 0)


def check(group: dist.ProcessGroup, q, k, *, schedule: str, is_causal: bool, precision: str,
          scale: float, cu_seqlens=None, window=None, mesh=None) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless all ranks call with this signature
    (see the module docstring); a no-op for a signature this group has checked already.
    ``mesh``: (ring ranks, all-to-all ranks) of a call on a 2-D mesh, whose ``group`` holds all of
    its ranks (``comm/mesh.SequenceMesh.check_group``)."""
    if _mode == "off":
        return
    seen = _checked.get(group)
    if seen is None:
        if dist.get_world_size(group) == 1 or dist.get_backend(group) == "fake":
            return  # nothing to compare with (a fake group's collectives return no data)
        seen = _checked[group] = set()
    sig, world = None, dist.get_world_size(group)
    if _is_fake(q) and any(isinstance(n, torch.SymInt) for n in (*q.shape, *k.shape)):
        key = sig = signature(q, k, schedule=schedule, is_causal=is_causal, precision=precision,
                              scale=scale, cu_seqlens=cu_seqlens, window=window,
                              world=world, mesh=mesh)  # symbolic sizes: unhashable
    else:  # the raw arguments, cheaper than the signature; the same traced and eagerly
        key = (q.shape, k.shape, q.dtype, schedule, is_causal, precision, scale,
               _NO_DOCUMENTS if cu_seqlens is None else _documents(cu_seqlens), window, mesh)
    if _mode == "new" and key in seen:
        return
    if sig is None:
        sig = signature(q, k, schedule=schedule, is_causal=is_causal, precision=precision,
                        scale=scale, cu_seqlens=cu_seqlens, window=window, world=world,
                        mesh=mesh)
    with _outside_tracing():
        rows = _all_gather(group, [_encode(v) for v in sig], q.device)
    if any(row != rows[0] for row in rows):
        raise ValueError(_message(group, rows))
    if len(seen) >= _MAX_SIGNATURES:
        seen.clear()
    seen.add(key)


def _encode(value) -> int:
    """One int64 per field: ints as they are, strings and tuples by a stable 63-bit hash (Python's
    own ``hash`` of a str differs between processes), floats by their bits."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


_KNOWN = {_encode(s): s for s in (*SCHEDULES, *LAYOUTS, *PRECISIONS,
                                  *(str(d) for d in vars(torch).values()
                                    if isinstance(d, torch.dtype)))}


def _decode(field: str, value: int) -> str:
    if field in _STRINGS:
        return repr(_KNOWN.get(value, f"<unknown {value:#x}>"))
    if field == "is_causal":
        return repr(bool(value))
    if field == "scale":
        return repr(struct.unpack("<d", struct.pack("<q", value))[0])
    if field == "document_boundaries":
        return "none" if value == -1 else f"hash {value:#x}"
    if field == "mesh":
        return "1-D" if value == 0 else "{} x {}".format(*divmod(value, _MESH_BASE))
    return repr(value)


class _outside_tracing:
    """Run real collectives on real tensors even while a tracer (Dynamo's fake tensors, make_fx,
    AOTAutograd) is active: the check runs inside the op's fake implementation at trace time."""

    def __enter__(self):
        from torch.utils._python_dispatch import _disable_current_modes  # noqa: PLC0415

        self._modes = _disable_current_modes()
        self._modes.__enter__()
        self._no_python_dispatcher = torch._C._DisablePythonDispatcher()
        self._no_python_dispatcher.__enter__()

    def __exit__(self, *exc):
        self._no_python_dispatcher.__exit__(*exc)
        self._modes.__exit__(*exc)


def _all_gather(group, values: list[int], device) -> list[list[int]]:
    from .comm.process_group import _all_gather_tensor  # noqa: PLC0415 - the torch-version alias

    world = dist.get_world_size(group)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    gathered = mine.new_empty(world * len(values))
    _all_gather_tensor(gathered, mine, group=group)
    return gathered.view(world, len(values)).tolist()


def _message(group, rows) -> str:
    world = len(rows)
    global_ranks = [dist.get_global_rank(group, r) for r in range(world)]
    lines = []
    for index, (field, what) in enumerate(FIELDS):
        by_value: dict[int, list[int]] = {}
        for rank, row in enumerate(rows):
            by_value.setdefault(row[index], []).append(rank)
        if len(by_value) > 1:
            parts = "; ".join(f"{_decode(field, value)} on {_ranks(ranks, global_ranks)}"
                              for value, ranks in by_value.items())
            lines.append(f"  {field} ({what}): {parts}")
    return (f"ring attention is called differently on the {world} ranks of process group "
            f"{group.group_name!r} (found before any exchange):\n" + "\n".join(lines) +
            "\nevery rank must call it with the same shapes and options (its own tokens, the "
            "same count on every rank)")


def _ranks(ranks: list[int], global_ranks: list[int]) -> str:
    text = "rank " + ", ".join(map(str, ranks)) if len(ranks) == 1 else (
        "ranks " + ", ".join(map(str, ranks)))
    if [global_ranks[r] for r in ranks] != ranks:
        text += " (global " + ", ".join(str(global_ranks[r]) for r in ranks) + ")"
    return text
