"""Moving whole sequences to and from a layout: ``shard_sequence``, ``unshard_sequence``,
``sequence_positions``; with ``cu_seqlens``, in the layout's per-document form (``documents.py``).
On a 2-D mesh (ring ranks, all-to-all ranks) the layout is the hybrid one (``hybrid/layout.py``):
the named layout over the ring ranks, each shard cut contiguously over the all-to-all ranks."""
import math

import torch
import torch.distributed._functional_collectives as funcol

from .comm.mesh import check_device, resolve_mesh
from .documents import documents, within_document
from .hybrid.layout import placed_layout
from .layouts import Layout, get_layout
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
    ``cu_seqlens`` (packed documents), in the layout's per-document form.

    No communication: each rank selects its own tokens (``Layout.positions``). This is the form
    ``ring_attention`` takes for ``layout=dr.SCHEDULE_LAYOUT[schedule]``. On a 2-D mesh (ring
    ranks, all-to-all ranks) the hybrid layout: the named layout over the ring ranks, each shard
    cut contiguously over the all-to-all ranks (``hybrid/layout.py``).

    Args:
        x (torch.Tensor): the whole sequence, the same on every rank; any shape, dtype and
            device, with the sequence along ``dim``.
        mesh (DeviceMesh | ProcessGroup): the sequence ranks: a 1-D ``DeviceMesh`` or a
            ``ProcessGroup``, or a 2-D ``DeviceMesh`` (ring ranks, all-to-all ranks). A
            ``DeviceMesh``'s device type must be x's.
        dim (int): the sequence dim of ``x``, negative counting from the end. Default 2 (the
            ``[B, H, S, D]`` of attention).
        layout (str): ``"zigzag"`` (default), ``"contiguous"`` or ``"stripe"`` (keys of
            ``dr.LAYOUTS``; a schedule's is ``dr.SCHEDULE_LAYOUT[schedule]``).
        cu_seqlens (torch.Tensor | list[int] | None): keyword-only: packed documents'
            boundaries over ``x.shape[dim]``, as in ``ring_attention``. None (default): one
            sequence.

    Returns:
        torch.Tensor: this rank's shard, x's shape with ``x.shape[dim] // W`` along ``dim``
        (W: the mesh's size), x's dtype and device; a new tensor (``index_select``), not a
        view; differentiable.

    Raises:
        TypeError: ``x`` not a tensor; ``mesh`` not a ``DeviceMesh`` or ``ProcessGroup``;
            ``cu_seqlens`` of a wrong type.
        ValueError: ``dim`` out of range; an unknown ``layout``; ``x.shape[dim]`` not divisible
            as the layout needs (zigzag: by 2W); x on another device type than the mesh's;
            ``cu_seqlens`` not valid boundaries of ``x.shape[dim]`` for the layout.
    """
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
    """The whole sequence in natural order, on every rank (differentiable): the inverse of
    ``shard_sequence``.

    A collective: every rank of ``mesh`` calls it (one all-gather per mesh dimension). Its
    backward is the all-gather's: a reduce-scatter, so each rank's shard gets the sum over the
    ranks of the gradient at its tokens.

    Args:
        x_local (torch.Tensor): this rank's shard in ``layout``, any shape, dtype and device,
            with the local sequence along ``dim``; the same shape on every rank.
        mesh (DeviceMesh | ProcessGroup): the sequence ranks, as in ``shard_sequence``.
        dim (int): the sequence dim of ``x_local``, negative counting from the end. Default 2.
        layout (str): the layout the shards are in: ``"zigzag"`` (default), ``"contiguous"``
            or ``"stripe"``.
        cu_seqlens (torch.Tensor | list[int] | None): keyword-only: the packed documents'
            boundaries the shards were made with (over the whole sequence), or None (default).

    Returns:
        torch.Tensor: the whole sequence in natural order, x_local's shape with
        ``x_local.shape[dim] * W`` along ``dim``, x_local's dtype and device; the same on every
        rank.

    Raises:
        TypeError: ``x_local`` not a tensor; ``mesh`` not a ``DeviceMesh`` or ``ProcessGroup``;
            ``cu_seqlens`` of a wrong type.
        ValueError: ``dim`` out of range; an unknown ``layout``; a local length the layout
            cannot hold (zigzag: even); x_local on another device type than the mesh's;
            ``cu_seqlens`` not valid boundaries of the whole sequence for the layout.
    """
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
    ``cu_seqlens`` each token's position within its document.

    No communication. Without documents, the same as ``shard_sequence(torch.arange(seq_len),
    mesh, dim=0, layout=layout)``.

    Args:
        seq_len (int): the whole sequence's length, divisible as the layout needs on the mesh.
        mesh (DeviceMesh | ProcessGroup): the sequence ranks, as in ``shard_sequence``.
        layout (str): ``"zigzag"`` (default), ``"contiguous"`` or ``"stripe"``.
        device (torch.device | str | None): where to put the result; None (default): the CPU.
        cu_seqlens (torch.Tensor | list[int] | None): keyword-only: packed documents'
            boundaries over ``seq_len``, as in ``ring_attention``; None (default): one sequence.

    Returns:
        torch.Tensor: int64, [seq_len // W], on ``device``: the position of each of this
        rank's tokens, in the order ``shard_sequence`` puts them.

    Raises:
        TypeError: ``seq_len`` not an int; ``mesh`` not a ``DeviceMesh`` or ``ProcessGroup``;
            ``cu_seqlens`` of a wrong type.
        ValueError: an unknown ``layout``; ``seq_len`` not divisible as the layout needs;
            ``cu_seqlens`` not valid boundaries of ``seq_len`` for the layout.
    """
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
    ``ring`` (any document lengths) needs of the row alone: documents padded to W give that.

    Args:
        schedule (str): ``"auto"`` or a key of ``dr.SCHEDULES`` (``"ring"``, ``"zigzag"``,
            ``"stripe"``, ``"llama3"``).
        world_size (int): the ranks of the ring, >= 1.

    Returns:
        int: the multiple (2 * world_size or world_size).

    Raises:
        ValueError: an unknown ``schedule``; ``world_size`` not a positive int.
    """
    check_int(world_size, "world_size", 1, "a positive int")
    return math.lcm(get_schedule(schedule).layout.document_multiple(world_size), world_size)
