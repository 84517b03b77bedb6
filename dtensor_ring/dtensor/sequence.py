"""Whole sequences to and from sequence-sharded DTensors in the registered layout.

``distribute_sequence`` is ``shard_sequence`` + ``DTensor.from_local`` with ``Shard(dim)`` on the
sequence mesh dimension (``Replicate`` on any other), in the layout registered for that dimension
(``registry.py``); the DTensor remembers the layout, so SDPA can tell inputs sharded under different
registrations apart. ``sequence_full_tensor`` is the inverse: DTensor's own ``full_tensor()`` of a
zigzag or stripe DTensor is the rank-major concatenation of the shards, not the natural order.
"""
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..sharding import from_rank_major, shard_sequence
from ..layouts import get_layout
from ..validation import check_tensor, normalize_dim
from .placements import LAYOUT_TAG
from .registry import dim_label, get_sequence_schedule, mesh_dim_index


def _seq_submesh(mesh, index):
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError("an N-D mesh needs dimension names here (init_device_mesh(..., "
                         "mesh_dim_names=...)); or pass the 1-D sequence submesh")
    return mesh[names[index]]


def distribute_sequence(x: torch.Tensor, mesh, *, mesh_dim=None, dim: int = 2) -> DTensor:
    """The whole tensor ``x`` (the same on every rank) as a DTensor sequence-sharded along ``dim``
    on ``mesh_dim`` in that dimension's registered layout (contiguous if none is registered)."""
    check_tensor(x, "x")
    dim = normalize_dim(x, dim)
    index = mesh_dim_index(mesh, mesh_dim)
    entry = get_sequence_schedule(mesh, index)
    local = shard_sequence(x, _seq_submesh(mesh, index), dim=dim, layout=entry.layout)
    placements = [Replicate()] * mesh.ndim
    placements[index] = Shard(dim)
    shape = list(x.shape)
    out = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                             stride=x.contiguous().stride())
    setattr(out, LAYOUT_TAG, entry.layout)
    return out


def sequence_full_tensor(x: DTensor, *, mesh_dim=None) -> torch.Tensor:
    """The whole tensor in natural order from a DTensor sequence-sharded on ``mesh_dim`` in that
    dimension's registered layout (differentiable, like ``full_tensor``)."""
    if not isinstance(x, DTensor):
        raise TypeError(f"x must be a DTensor; got {type(x).__name__}")
    mesh = x.device_mesh
    index = mesh_dim_index(mesh, mesh_dim)
    placement = x.placements[index]
    if not isinstance(placement, Shard):
        raise ValueError(f"x is {placement} on mesh dimension {dim_label(mesh, index)}; "
                         "expected a Shard of its sequence dim")
    layout = get_layout(get_sequence_schedule(mesh, index).layout)
    dim = placement.dim % x.ndim
    return from_rank_major(x.full_tensor(), layout, mesh.size(index), dim)
