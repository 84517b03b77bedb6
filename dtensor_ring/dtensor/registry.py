"""Which schedule (and so which layout) each sequence-sharded mesh dimension uses.

A ``Shard(2)`` placement says *that* a DTensor's sequence is split over a mesh dimension, not *how*.
Plain ``Shard(2)`` means the contiguous layout (rank r holds chunk r), so a DTensor's global view is
the true sequence and SDPA on it runs the ``ring`` schedule. To hold zigzag or stripe shards
instead, record the schedule for the mesh dimension here; the SDPA rule reads it, forward and
backward. SDPA has no argument for a sliding window, so a window is recorded here too (``window``:
every SDPA on sequence-sharded DTensors of that dimension runs with it until the entry changes).

Who sets an entry:

* ``ContextParallel`` (``style.py``) when it is applied by ``parallelize_module``, and again before
  each forward of the module it was applied to;
* an explicit ``set_sequence_schedule(mesh, schedule, mesh_dim=...)``, e.g. before building DTensors
  with ``distribute_sequence`` or from ``shard_sequence`` + ``DTensor.from_local``.

Entries are keyed by the mesh dimension's *name* (``"cp"``) when it has one, so ``mesh["cp"]`` and
the ``"cp"`` dimension of the 2-D mesh it came from share an entry; an unnamed dimension is keyed by
its process group. An entry remembers the dimension's size: a DTensor on a same-named dimension of
another size is an error, not a silent wrong layout. One schedule per mesh dimension at a time: a
module's backward uses the entry in force when it runs.

A compiled graph holds the schedule the rule found when it was traced. The rule reads this table
inside DTensor's dispatch, below the code Dynamo traces, so Dynamo would not guard on it by itself:
a graph compiled before an entry changed would run the old schedule on shards in the new layout,
silently wrong. So whenever the rule runs while Dynamo traces a frame (``guard_entries``), it adds
a guard on ``STATE``, the text of every entry in force, to that frame's compiled code: after a
change, that frame compiles again (and a frame compiled under an earlier state is reused when the
state comes back); compiled functions that do not run SDPA on DTensors have no such guard and are
not recompiled. ``STATE`` is also part of the key under which inductor caches compiled graphs (in
the ring pass's uuid), so no cache, in memory or on disk, hands out a graph traced under other
entries.
"""
from dataclasses import dataclass

from torch._dynamo.guards import GuardBuilder, install_guard
from torch._dynamo.source import AttrSource, ImportSource
from torch._guards import TracingContext
from torch.distributed.device_mesh import DeviceMesh

from ..layouts.windows import check_window
from ..schedules import get_schedule
from ..validation import check_precision

DEFAULT_SCHEDULE = "ring"  # plain Shard(2): the contiguous layout


@dataclass(frozen=True)
class SequenceSharding:
    """How sequence-sharded tensors on one mesh dimension are laid out and attended."""

    schedule: str = DEFAULT_SCHEDULE
    precision: str = "fp32"
    backend: str = "auto"
    size: int | None = None  # the mesh dimension's size when registered; None: the default entry
    window: tuple | None = None  # a sliding window (left, right), as ``ring_attention`` takes it

    @property
    def layout(self) -> str:
        return get_schedule(self.schedule).layout.name


_ENTRIES: dict[tuple, SequenceSharding] = {}
STATE = "[]"  # repr of the entries in force (sorted); compiled code that used them guards on it


def mesh_dim_index(mesh: DeviceMesh, mesh_dim, arg: str = "mesh_dim") -> int:
    """``mesh_dim`` (a name, an index, or None for a 1-D mesh) as an index into ``mesh``."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh; got {type(mesh).__name__}")
    names = mesh.mesh_dim_names or ()
    if mesh_dim is None:
        if mesh.ndim != 1:
            raise ValueError(f"{arg}=None is only valid for a 1-D mesh; this mesh has "
                             f"{mesh.ndim} dimensions named {names}: name one")
        return 0
    if isinstance(mesh_dim, str):
        if mesh_dim not in names:
            raise ValueError(f"{arg}={mesh_dim!r} is not a dimension of the mesh; valid: {names}")
        return names.index(mesh_dim)
    if isinstance(mesh_dim, bool) or not isinstance(mesh_dim, int) or not (
            -mesh.ndim <= mesh_dim < mesh.ndim):
        raise ValueError(f"{arg}={mesh_dim!r} must be a dimension name or an index in "
                         f"[0, {mesh.ndim}) of the {mesh.ndim}-D mesh")
    return mesh_dim % mesh.ndim


def dim_key(mesh: DeviceMesh, index: int) -> tuple:
    names = mesh.mesh_dim_names
    if names:
        return ("name", names[index])
    return ("group", mesh.get_group(index).group_name)


def dim_label(mesh: DeviceMesh, index: int) -> str:
    names = mesh.mesh_dim_names
    return repr(names[index]) if names else str(index)


def set_sequence_schedule(mesh: DeviceMesh, schedule: str = "zigzag", *, mesh_dim=None,
                          precision: str = "fp32", backend: str = "auto",
                          window=None) -> SequenceSharding:
    """Record that sequence shards on ``mesh``'s dimension ``mesh_dim`` are in ``schedule``'s
    layout, and that SDPA on them runs ``schedule`` with ``precision``, ``backend`` and the
    sliding ``window`` (as in ``ring_attention``; None: none)."""
    get_schedule(schedule)
    check_precision(precision)
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str; got {backend!r}")
    window = check_window(window)
    index = mesh_dim_index(mesh, mesh_dim)
    entry = SequenceSharding(schedule, precision, backend, mesh.size(index),
                             None if window is None else tuple(window))
    _replace(dim_key(mesh, index), entry)
    return entry


def clear_sequence_schedule(mesh: DeviceMesh, *, mesh_dim=None) -> None:
    """Forget the entry of ``mesh``'s dimension ``mesh_dim``: back to contiguous / ``ring``."""
    _replace(dim_key(mesh, mesh_dim_index(mesh, mesh_dim)), None)


def sequence_schedules_key() -> str:
    """Every entry in force, as text: part of the compile caches' keys (``passes/``)."""
    return STATE


def _replace(key: tuple, entry: "SequenceSharding | None") -> None:
    """Put ``entry`` (None: the default) in force for ``key``."""
    global STATE
    if _ENTRIES.get(key) == entry:  # e.g. ContextParallel before each forward, maybe traced
        return
    if entry is None:
        _ENTRIES.pop(key, None)
    else:
        _ENTRIES[key] = entry
    STATE = repr(sorted(_ENTRIES.items()))


def guard_entries() -> None:
    """If Dynamo is tracing a frame, make that frame's compiled code valid only while ``STATE`` is
    what it is now (see the module docstring); eagerly, nothing. The rule calls this where it
    reads the table, inside DTensor's dispatch, which Dynamo runs but does not trace."""
    if TracingContext.try_get() is None:
        return
    # ``__import__('dtensor_ring')`` is what the guard evaluates, so the path starts at the top.
    source = AttrSource(AttrSource(AttrSource(ImportSource("dtensor_ring"), "dtensor"),
                                   "registry"), "STATE")
    install_guard(source.make_guard(GuardBuilder.EQUALS_MATCH))


def get_sequence_schedule(mesh: DeviceMesh, mesh_dim=None) -> SequenceSharding:
    """The entry for ``mesh``'s dimension ``mesh_dim`` (the contiguous ``ring`` default if none);
    ValueError if it was registered for a dimension of another size."""
    index = mesh_dim_index(mesh, mesh_dim)
    entry = _ENTRIES.get(dim_key(mesh, index))
    if entry is None:
        return SequenceSharding(size=mesh.size(index))
    if entry.size != mesh.size(index):
        raise ValueError(
            f"mesh dimension {dim_label(mesh, index)} has size {mesh.size(index)} but the "
            f"sequence layout {entry.layout!r} (schedule {entry.schedule!r}) was registered for "
            f"a dimension of that name of size {entry.size}; call "
            "dr.dtensor.set_sequence_schedule (or clear_sequence_schedule) for this mesh")
    return entry


