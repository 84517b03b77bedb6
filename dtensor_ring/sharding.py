"""Moving whole sequences to and from a layout: ``shard_sequence``, ``unshard_sequence``,
``sequence_positions``; with ``cu_seqlens``, in the layout's per-document form (``documents.py``).
On a 2-D mesh (ring ranks, all-to-all ranks) the layout is the hybrid one (``hybrid/layout.py``):
the named layout over the ring ranks, each shard cut contiguously over the all-to-all ranks."""
import math

import torch
import torch.distributed._functional_collectives as funcol

from .documents import documents, within_document
from .hybrid.layout import placed_layout
from .layouts import Layout, get_layout
from .mesh import check_device, resolve_mesh
from .schedules import get_schedule
from .validation import check_int, check_tensor, normalize_dim


def rank_major_positions(layout: Layout, seq_len: int, world_size: int,
                         docs=None) -> torch.Tensor:
    """Global positions of all ranks' tokens, rank 0's first: the order of a concatenation of shards."""
    local = seq_len // world_size
    return torch.cat([layout.positions(local, r, world_size, docs) for r in range(world_size)])


def _placed(mesh, layout: str):
    """(the layout on ``mesh``, this rank's place in it, the mesh's size, the mesh)."""
    seq_mesh = resolve_mesh(mesh)
    lay = placed_layout(get_layout(layout), *seq_mesh.shape)
    return lay, seq_mesh.rank, seq_mesh.world_size, seq_mesh


def _documents(cu_seqlens, layout, seq_len, world, device):
    return documents(cu_seqlens, None, seq_len, layout.document_multiple(world), layout.name,
                     device, world_size=layout.placement_world(world))


def shard_sequence(x: torch.Tensor, mesh, dim: int = 2, layout: str = "zigzag", *,
                   cu_seqlens=None) -> torch.Tensor:
    """This rank's shard of the whole sequence ``x`` (same on every rank) in ``layout``; with
    ``cu_seqlens`` (packed documents), in the layout's per-document form."""
    check_tensor(x, "x")
    check_device(mesh, x, "x")
    dim = normalize_dim(x, dim)
    lay, rank, world, _ = _placed(mesh, layout)
    lay.check_global_len(x.shape[dim], world, f"x.shape[{dim}]")
    docs = _documents(cu_seqlens, lay, x.shape[dim], world, x.device)
    index = lay.positions(x.shape[dim] // world, rank, world, docs).to(x.device)
    return x.index_select(dim, index)


def unshard_sequence(x_local: torch.Tensor, mesh, dim: int = 2, layout: str = "zigzag", *,
                     cu_seqlens=None) -> torch.Tensor:
    """The whole sequence in natural order, on every rank (differentiable)."""
    check_tensor(x_local, "x_local")
    check_device(mesh, x_local, "x_local")
    dim = normalize_dim(x_local, dim)
    lay, _, world, seq_mesh = _placed(mesh, layout)
    lay.check_local_len(x_local.shape[dim], f"x_local.shape[{dim}]")
    docs = _documents(cu_seqlens, lay, x_local.shape[dim] * world, world, x_local.device)
    # The differentiable all-gather (torch.distributed.nn's is deprecated): rank-major along dim;
    # on a 2-D mesh the inner ranks' shards first, then the outer ranks': flat-rank order.
    gathered = x_local.contiguous()
    for group in (seq_mesh.inner, seq_mesh.outer):
        if group is not None:
            gathered = funcol.all_gather_tensor_autograd(gathered, dim, group)
    return from_rank_major(gathered, lay, world, dim, docs)


def from_rank_major(x: torch.Tensor, layout: Layout, world_size: int, dim: int,
                    docs=None) -> torch.Tensor:
    """A concatenation of all ranks' shards along ``dim`` -> natural order."""
    order = rank_major_positions(layout, x.shape[dim], world_size, docs).argsort()
    return x.index_select(dim, order.to(x.device))


def sequence_positions(seq_len: int, mesh, layout: str = "zigzag", device=None, *,
                       cu_seqlens=None) -> torch.Tensor:
    """Positions (int64) of this rank's tokens, e.g. for RoPE: global positions, or with
    ``cu_seqlens`` each token's position within its document."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int):
        raise TypeError(f"seq_len must be an int; got {seq_len!r}")
    lay, rank, world, _ = _placed(mesh, layout)
    lay.check_global_len(seq_len, world)
    docs = _documents(cu_seqlens, lay, seq_len, world, torch.device(device or "cpu"))
    positions = lay.positions(seq_len // world, rank, world, docs)
    if docs is not None:
        positions = within_document(positions, docs.cu)
    return positions.to(device)


def document_multiple(schedule: str, world_size: int) -> int:
    """A multiple for every packed document's length (``pad_documents``' ``multiple``) that makes
    a row ``schedule`` takes on ``world_size`` ranks: 2W (zigzag, llama3, auto), W (stripe, ring).
    The layout's own rule is the first factor; the row must also split into W equal parts, which
    ``ring`` (any document lengths) needs of the row alone: documents padded to W give that."""
    check_int(world_size, "world_size", 1, "a positive int")
    return math.lcm(get_schedule(schedule).layout.document_multiple(world_size), world_size)
