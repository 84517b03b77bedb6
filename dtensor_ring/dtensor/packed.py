"""Packed documents for ``ContextParallel``: finding them in a batch and sharding the batch by them.

A packed batch says where its documents start in one of two ways:

* ``cu_seqlens=[0, l1, l1+l2, ..., S]`` passed to the module (flash-attn's / TransformerEngine's
  convention), or
* ``position_ids`` (Hugging Face's ``DataCollatorWithFlattening``: ``[0, 1, ..., l1-1, 0, 1, ...]``),
  the same for every batch row. A document starts wherever the position does not count up by one
  from the previous token's -- a restart at 0 or at any other value, or a jump -- which is the rule
  transformers applies (``masking_utils.find_packed_sequence_indices``), so a row that starts
  mid-document (100, 101, ...) is one document at those positions. Position ids that count up by
  one throughout are one document: no documents (plain causal attention, positions as given).

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


def _row_boundaries(row: torch.Tensor) -> list[int]:
    """Document boundaries [0, ..., S] of one row of position ids: a document starts wherever the
    position is not the previous one plus one."""
    starts = (row[1:] != row[:-1] + 1).nonzero().flatten().add(1).tolist()
    return [0, *starts, row.shape[0]]


def _boundaries_from_positions(position_ids: torch.Tensor, seq_dim: int,
                               arg: str = "position_ids") -> list[int] | None:
    """Document boundaries from position ids (the same in every batch row), or None if every
    row is one run counting up by one."""
    rows = position_ids.movedim(seq_dim, -1).reshape(-1, position_ids.shape[seq_dim]).cpu()
    packed = [_row_boundaries(row) for row in rows]
    if any(cu != packed[0] for cu in packed):
        differing = next(i for i, cu in enumerate(packed) if cu != packed[0])
        raise ValueError(
            f"{arg} of batch row {differing} pack documents differently from row 0 "
            f"(boundaries {packed[differing]} vs {packed[0]}); packed documents need the same "
            "boundaries in every row: pack each row alike, or pass one row per batch")
    return packed[0] if len(packed[0]) > 2 else None


def find_documents(cu_seqlens, position_ids, seq_dim: int, seq_len: int, layout: Layout,
                   rank: int, world: int, device, *, cu_arg: str = "cu_seqlens",
                   positions_arg: str = "position_ids") -> PackedBatch | None:
    """The documents of one batch (``cu_seqlens`` if given, else the runs of ``position_ids``;
    None if neither says there are several), checked against ``layout``'s needs; errors name
    the argument they came from (``cu_arg`` or ``positions_arg``)."""
    if cu_seqlens is not None:
        values = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor)
                                   else cu_seqlens)]
        arg = cu_arg
    elif position_ids is not None:
        values = _boundaries_from_positions(position_ids, seq_dim, positions_arg)
        if values is None:
            return None
        arg = positions_arg
    else:
        return None
    # documents() checks the boundaries (once) against the layout's multiple
    docs = documents(values, None, seq_len, layout.document_multiple(world), layout.name,
                     torch.device(device), arg=arg, world_size=layout.placement_world(world))
    index = layout.positions(seq_len // world, rank, world, docs)
    longest = docs.max_len
    bucket = min(seq_len, 1 << (longest - 1).bit_length())
    cu = docs.cu
    torch._dynamo.maybe_mark_dynamic(cu, 0)  # another count of documents: no recompile
    return PackedBatch(index, within_document(index, cu), cu, bucket, longest)
