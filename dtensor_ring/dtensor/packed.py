"""Packed documents for ``ContextParallel``: finding them in a batch and sharding the batch by them.

A packed batch says where its documents start in one of two ways:

* ``cu_seqlens=[0, l1, l1+l2, ..., S]`` passed to the module (flash-attn's / TransformerEngine's
  convention), or
* ``position_ids`` that restart at 0 at each document (Hugging Face's ``DataCollatorWithFlattening``):
  ``[0, 1, ..., l1-1, 0, 1, ...]``, the same for every batch row. Position ids of any other form
  (no restart, or not counting up by one from each 0) are taken as they are: no documents.

``find_documents`` reads them on the host (``position_ids`` on a GPU: one copy to the host per
forward, not per attention call; ``ContextParallel(documents=False)`` skips the look, e.g. for
CUDA-graph capture) and returns, as tensors on the inputs' device, what the rest of the forward
needs: the index of this rank's tokens in the per-document layout, their positions within their
documents, and the boundaries for ``ring_attention``. ``ContextParallel`` runs it outside
``torch.compile``'s graph: those tensors are graph inputs, so a batch with other boundaries (and
another count of documents) does not recompile. The longest document's length, which sizes the
varlen kernels' grids, goes in rounded up to a power of two, so graphs change only when it crosses
one.
"""
from typing import NamedTuple

import torch

from ..documents import documents, within_document
from ..layouts import Layout


class PackedBatch(NamedTuple):
    index: torch.Tensor  # this rank's tokens (global positions, in the layout's order)
    positions: torch.Tensor  # their positions within their documents
    cu_seqlens: torch.Tensor  # int32 boundaries on the inputs' device
    max_seqlen: int  # the longest document, rounded up to a power of two (at most S)
    longest: int  # the longest document


def _packed_row(row: torch.Tensor) -> list[int] | None:
    """Document boundaries of one row of position ids if they are packed ones (0, 1, ..., then
    0, 1, ... again at each document), else None (positions taken as they are)."""
    starts = (row == 0).nonzero().flatten().tolist()
    if len(starts) < 2 or starts[0] != 0:
        return None
    cu = starts + [row.shape[0]]
    expected = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])
    return cu if torch.equal(row, expected.to(row.dtype)) else None


def _boundaries_from_positions(position_ids: torch.Tensor, seq_dim: int) -> list[int] | None:
    """Document boundaries from packed position ids (the same in every batch row), or None."""
    rows = position_ids.movedim(seq_dim, -1).reshape(-1, position_ids.shape[seq_dim]).cpu()
    packed = [_packed_row(row) for row in rows]
    if any(cu != packed[0] for cu in packed):
        differing = next(i for i, cu in enumerate(packed) if cu != packed[0])
        raise ValueError(
            f"position_ids of batch row {differing} pack documents differently from row 0 "
            f"(boundaries {packed[differing]} vs {packed[0]}); packed documents need the same "
            "boundaries in every row: pack each row alike, or pass one row per batch")
    return packed[0]


def find_documents(cu_seqlens, position_ids, seq_dim: int, seq_len: int, layout: Layout,
                   rank: int, world: int, device) -> PackedBatch | None:
    """The documents of one batch (``cu_seqlens`` if given, else restarts of ``position_ids``;
    None if neither says there are any), checked against ``layout``'s needs."""
    if cu_seqlens is not None:
        values = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor)
                                   else cu_seqlens)]
    elif position_ids is not None:
        values = _boundaries_from_positions(position_ids, seq_dim)
        if values is None:
            return None
    else:
        return None
    # documents() checks the boundaries (once) against the layout's multiple
    docs = documents(values, None, seq_len, layout.document_multiple(world), layout.name,
                     torch.device(device), world)
    index = layout.positions(seq_len // world, rank, world, docs)
    longest = docs.max_len
    bucket = min(seq_len, 1 << (longest - 1).bit_length())
    cu = docs.cu
    torch._dynamo.maybe_mark_dynamic(cu, 0)  # another count of documents: no recompile
    return PackedBatch(index, within_document(index, cu), cu, bucket, longest)
