"""Whole sequences to and from sequence-sharded DTensors in the registered layout.

``distribute_sequence`` is ``shard_sequence`` + ``DTensor.from_local`` with ``Shard(dim)`` on the
sequence mesh dimension (``Replicate`` on any other), in the layout registered for that dimension
(``registry.py``); the DTensor remembers the layout, so SDPA can tell inputs sharded under different
registrations apart. ``sequence_full_tensor`` is the inverse: DTensor's own ``full_tensor()`` of a
zigzag or stripe DTensor is the rank-major concatenation of the shards, not the natural order.

``mesh_dim`` may name two dimensions, (ring, all-to-all): the sequence is then sharded on both in
the hybrid layout (``dtensor_ring/hybrid/layout.py``), with the first dimension's registered
layout, as the SDPA rule's 2-D plan takes it.
"""
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..hybrid.layout import placed_layout
from ..sharding import from_rank_major, shard_sequence
from ..layouts import get_layout
from ..validation import check_tensor, normalize_dim
from .placements import LAYOUT_TAG
from .registry import dim_label, get_sequence_schedule, mesh_dim_index


def _seq_submesh(mesh, indices):
    if mesh.ndim == len(indices):
        return mesh
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError("an N-D mesh needs dimension names here (init_device_mesh(..., "
                         "mesh_dim_names=...)); or pass the sequence submesh")
    return mesh[tuple(names[i] for i in indices)] if len(indices) > 1 else mesh[names[indices[0]]]


def _seq_dims(mesh, mesh_dim) -> tuple:
    """``mesh_dim`` (one dimension, or a (ring, all-to-all) pair) as indices into ``mesh``."""
    if isinstance(mesh_dim, (tuple, list)):
        if len(mesh_dim) != 2:
            raise ValueError(f"mesh_dim={mesh_dim!r} must be one dimension or two (ring, "
                             "all-to-all)")
        indices = tuple(mesh_dim_index(mesh, d) for d in mesh_dim)
        if not indices[0] < indices[1]:
            raise ValueError(f"mesh_dim={mesh_dim!r}: the ring's dimension must come before the "
                             "all-to-all's in the mesh (DTensor shards along them in mesh order)")
        return indices
    return (mesh_dim_index(mesh, mesh_dim),)


def distribute_sequence(x: torch.Tensor, mesh, *, mesh_dim=None, dim: int = 2) -> DTensor:
    """The whole tensor ``x`` (the same on every rank) as a DTensor sequence-sharded along ``dim``
    on ``mesh_dim`` in that dimension's registered layout (contiguous if none is registered)."""
    check_tensor(x, "x")
    dim = normalize_dim(x, dim)
    indices = _seq_dims(mesh, mesh_dim)
    entry = get_sequence_schedule(mesh, indices[0])
    local = shard_sequence(x, _seq_submesh(mesh, indices), dim=dim, layout=entry.layout)
    placements = [Replicate()] * mesh.ndim
    for index in indices:
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
    indices = _seq_dims(mesh, mesh_dim)
    for index in indices:
        placement = x.placements[index]
        if not isinstance(placement, Shard):
            raise ValueError(f"x is {placement} on mesh dimension {dim_label(mesh, index)}; "
                             "expected a Shard of its sequence dim")
    sizes = [mesh.size(index) for index in indices] + [1]
    layout = placed_layout(get_layout(get_sequence_schedule(mesh, indices[0]).layout), *sizes[:2])
    dim = x.placements[indices[0]].dim % x.ndim
    return from_rank_major(x.full_tensor(), layout, sizes[0] * sizes[1], dim)
