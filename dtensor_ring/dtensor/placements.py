"""Reading q/k/v placements: is this SDPA ours, on which mesh dimension, ring or local, or an error.

The rule takes SDPA whose query is ``Shard(2)`` (sequence) on exactly one mesh dimension, the
*sequence dimension*:

* key/value ``Shard(2)`` there too  -> the ring schedule registered for that dimension, output
  ``Shard(2)``;
* key/value ``Replicate`` there     -> purely local attention of the query shard against all keys
  (no communication), output ``Shard(2)``, key/value gradients ``Partial``.

On a 2-D context-parallel mesh q, k and v are ``Shard(2)`` on two mesh dimensions: the first the
ring's (its registered schedule runs there), the second the all-to-all's (``dtensor_ring/hybrid/``),
output ``Shard(2)`` on both (the hybrid layout: the first dimension's layout, each shard cut
contiguously over the second -- DTensor's own nesting of two ``Shard(2)``).

Every other mesh dimension must place q, k and v alike as ``Replicate``, ``Shard(0)`` (batch) or
``Shard(1)`` (heads); it passes through, since attention is independent per batch row and head.
Anything else with a sequence-sharded input is an error; inputs with no sequence sharding (and no
``Shard`` on a registered sequence dimension) are not ours and keep DTensor's own behaviour.
"""
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..hybrid.layout import placed_layout
from ..layouts import get_layout
from .registry import (_ENTRIES, SequenceSharding, dim_key, dim_label, get_sequence_schedule,
                       guard_entries)

SEQ, HEADS, BATCH, HEAD_DIM = 2, 1, 0, 3
LAYOUT_TAG = "_dtensor_ring_layout"  # set on DTensors made by distribute_sequence


@dataclass(frozen=True)
class SdpaPlan:
    mesh: DeviceMesh
    seq_mesh_dim: int
    ring: bool                # False: key/value replicated on the sequence dimension
    entry: SequenceSharding
    inner_mesh_dim: int | None = None  # the all-to-all's, on a 2-D sequence sharding

    @property
    def world_size(self) -> int:
        return self.mesh.size(self.seq_mesh_dim) * self.inner_size

    @property
    def inner_size(self) -> int:
        return 1 if self.inner_mesh_dim is None else self.mesh.size(self.inner_mesh_dim)


def _shard_dim(placement, ndim):
    return placement.dim % ndim if isinstance(placement, Shard) else None


def _describe(x: DTensor) -> str:
    return f"{tuple(x.placements)} on a mesh with dimensions {x.device_mesh.mesh_dim_names}"


def _seq_mesh_dims(x: DTensor) -> list[int]:
    return [i for i, p in enumerate(x.placements) if _shard_dim(p, x.ndim) == SEQ]


def _registered(mesh: DeviceMesh, index: int) -> bool:
    return dim_key(mesh, index) in _ENTRIES


def _check_registered_dims(named: dict) -> None:
    """On a mesh dimension registered for sequences, a Shard of another tensor dim is a mistake."""
    for name, x in named.items():
        for i, placement in enumerate(x.placements):
            dim = _shard_dim(placement, x.ndim)
            if dim is not None and dim != SEQ and _registered(x.device_mesh, i):
                raise ValueError(
                    f"{name} is Shard({dim}) on mesh dimension {dim_label(x.device_mesh, i)}, "
                    f"which is registered for sequence sharding; expected Shard({SEQ}) (the "
                    f"sequence dim of [batch, heads, seq, head_dim]) or Replicate there; "
                    f"{name}'s placements: {_describe(x)}")


def plan_sdpa(q, k, v) -> SdpaPlan | None:
    """The plan for SDPA on these inputs; None if they are not ours; ValueError if they are bad."""
    named = {"query": q, "key": k, "value": v}
    if not all(isinstance(x, DTensor) for x in named.values()):
        return None
    for name, x in named.items():
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq, head_dim]; got shape "
                             f"{tuple(x.shape)}")
    guard_entries()  # what follows reads the registry; under torch.compile, guard on it
    seq_dims = {name: _seq_mesh_dims(x) for name, x in named.items()}
    if not any(seq_dims.values()):
        _check_registered_dims(named)
        return None
    mesh = q.device_mesh
    for name in ("key", "value"):
        if named[name].device_mesh != mesh:
            raise ValueError(f"{name} is on mesh {named[name].device_mesh} but query is on mesh "
                             f"{mesh}; sequence-sharded SDPA needs one mesh")
    if not seq_dims["query"]:
        raise ValueError(
            f"key/value are sequence-sharded (Shard({SEQ})) but query is not: query placements "
            f"{_describe(q)}; shard the query on the same mesh dimension as key and value")
    if len(seq_dims["query"]) == 2:
        return _two_dimensional_plan(named, mesh, seq_dims)
    if len(seq_dims["query"]) > 2:
        raise ValueError(
            f"query's sequence is sharded on {len(seq_dims['query'])} mesh dimensions "
            f"{seq_dims['query']}: {_describe(q)}; shard it on one (the ring) or two (ring x "
            "all-to-all)")
    cp = seq_dims["query"][0]
    label = dim_label(mesh, cp)
    kv_placements = []
    for name in ("key", "value"):
        x = named[name]
        other = [i for i in seq_dims[name] if i != cp]
        if other:
            raise ValueError(
                f"{name} is sequence-sharded on mesh dimension {dim_label(mesh, other[0])} but "
                f"query on {label}: q/k/v must be sharded on the same mesh dimension; "
                f"query {_describe(q)}, {name} {_describe(x)}")
        placement = x.placements[cp]
        if not (placement == Shard(SEQ) or isinstance(placement, Replicate)
                or _shard_dim(placement, x.ndim) == SEQ):
            raise ValueError(
                f"{name} is {placement} on mesh dimension {label}, where query is Shard({SEQ}) "
                f"(the sequence); valid for {name}: Shard({SEQ}) (ring attention) or Replicate "
                f"(local attention); {name}'s placements: {_describe(x)}")
        kv_placements.append(isinstance(placement, Replicate))
    if kv_placements[0] != kv_placements[1]:
        raise ValueError(f"key is {k.placements[cp]} but value is {v.placements[cp]} on mesh "
                         f"dimension {label}; they must be placed alike")
    _check_other_dims(named, (cp,))
    entry = get_sequence_schedule(mesh, cp)
    _check_layout_tags(named, entry, mesh, cp)
    plan = SdpaPlan(mesh, cp, not kv_placements[0], entry)
    _check_lengths(q, k, plan)
    return plan


def _two_dimensional_plan(named: dict, mesh: DeviceMesh, seq_dims: dict) -> SdpaPlan:
    """q/k/v sequence-sharded on two mesh dimensions: the hybrid (ring x all-to-all) plan."""
    outer, inner = seq_dims["query"]
    labels = f"{dim_label(mesh, outer)} and {dim_label(mesh, inner)}"
    for name in ("key", "value"):
        if seq_dims[name] != [outer, inner]:
            raise ValueError(
                f"query's sequence is sharded on mesh dimensions {labels} (ring x all-to-all) "
                f"but {name}'s is not sharded on exactly those: {name} {_describe(named[name])}; "
                "shard q, k and v alike (key/value replicated on a 2-D sequence sharding is not "
                "supported)")
    _check_other_dims(named, (outer, inner))
    entry = get_sequence_schedule(mesh, outer)
    _check_layout_tags(named, entry, mesh, outer)
    plan = SdpaPlan(mesh, outer, True, entry, inner)
    _check_lengths(named["query"], named["key"], plan)
    return plan


def _check_other_dims(named: dict, seq: tuple) -> None:
    q = named["query"]
    sequence = " and ".join(dim_label(q.device_mesh, i) for i in seq)
    for i in range(q.device_mesh.ndim):
        if i in seq:
            continue
        label = dim_label(q.device_mesh, i)
        for name, x in named.items():
            placement = x.placements[i]
            dim = _shard_dim(placement, x.ndim)
            if not (isinstance(placement, Replicate) or dim in (BATCH, HEADS)):
                raise ValueError(
                    f"{name} is {placement} on mesh dimension {label}; with the sequence sharded "
                    f"on {sequence}, other mesh dimensions must be Replicate, "
                    f"Shard({BATCH}) (batch) or Shard({HEADS}) (heads); {name}'s placements: "
                    f"{_describe(x)}")
            if name != "query" and _shard_dim(placement, x.ndim) != _shard_dim(
                    q.placements[i], q.ndim):
                raise ValueError(
                    f"{name} is {placement} but query is {q.placements[i]} on mesh dimension "
                    f"{label}; q, k and v must be placed alike on dimensions other than the "
                    "sequence's")


def _check_layout_tags(named: dict, entry: SequenceSharding, mesh: DeviceMesh, cp: int) -> None:
    """DTensors made by distribute_sequence remember their layout; it must be the registered one."""
    for name, x in named.items():
        tag = getattr(x, LAYOUT_TAG, None)
        if tag is not None and tag != entry.layout:
            raise ValueError(
                f"{name} was sharded in layout {tag!r} but mesh dimension {dim_label(mesh, cp)} "
                f"is now registered with layout {entry.layout!r} (schedule {entry.schedule!r}): "
                "q/k/v are in different layouts; shard them all after one set_sequence_schedule")


def _check_lengths(q, k, plan: SdpaPlan) -> None:
    world = plan.world_size
    layout = placed_layout(get_layout(plan.entry.layout), world // plan.inner_size,
                           plan.inner_size)
    layout.check_global_len(q.shape[SEQ], world, "query.shape[2] (global sequence length)")
    if plan.ring and k.shape[SEQ] != q.shape[SEQ]:
        raise ValueError(f"key has sequence length {k.shape[SEQ]} but query has {q.shape[SEQ]}; "
                         "ring attention needs them equal")
    if q.shape[HEADS] % k.shape[HEADS]:
        raise ValueError(f"key/value heads ({k.shape[HEADS]}) must divide query heads "
                         f"({q.shape[HEADS]})")
    local_q, local_k = q.to_local().shape[HEADS], k.to_local().shape[HEADS]
    if local_k == 0 or local_q % local_k or local_q // local_k != q.shape[HEADS] // k.shape[HEADS]:
        raise ValueError(
            f"the heads are sharded so that this rank holds {local_q} query heads and {local_k} "
            f"key/value heads, which breaks the GQA grouping {q.shape[HEADS]}:{k.shape[HEADS]}; "
            "shard heads evenly (key/value heads divisible by the mesh dimension size)")
