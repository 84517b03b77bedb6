"""Packed documents: many documents in one row, attention only within each.

``cu_seqlens = [0, l1, l1+l2, ..., S]`` (flash-attn's and TransformerEngine's convention) gives the
document boundaries over the global sequence in natural order, the same for every batch row. Each
layout then applies per document (``layouts/``): zigzag cuts each document into 2W chunks (rank r
holds chunks r and 2W-1-r of every document, documents in order), stripe takes tokens r, r+W, ...
of every document, contiguous cuts the packed row into W equal parts (documents may cross ranks).

``Documents`` carries one call's boundaries to the layouts and kernels: the boundaries as an int32
tensor on the compute device, and a host bound on the longest document, which sizes the varlen
kernels' grids (PyTorch's flash varlen op launches ceil(max_len / tile) programs per segment, so a
loose bound costs idle programs, and time: docs/design.md, "Measurements behind design choices").

Host synchronisation: the boundaries' values are read on the host only when ``cu_seqlens`` is a CPU
tensor (free), or when it is on the device and no ``max_seqlen`` is given (one copy to the host, to
validate and to find the longest document). With a device tensor and ``max_seqlen`` nothing is read
back: the values are trusted (their dtype, shape and device are still checked).

``pad_documents`` is for the data pipeline: with ``world_size`` it orders and pads the documents
so that the short ones stay whole, each on one rank (``layouts/placement.py``); with ``multiple`` it
pads each document to the layout's multiple where it is.
"""
from typing import NamedTuple

import torch

from .layouts import LAYOUTS
from .layouts.boundaries import Documents, capturing, is_traced
from .layouts.placement import cut_documents_host, cut_length, plan_row
from .validation import check_int, check_tensor, normalize_dim

IGNORE_INDEX = -100  # the label of padding tokens (PyTorch's cross_entropy ignore_index)


def _host_values(cu_seqlens) -> list[int] | None:
    """The boundaries as Python ints when that costs no device sync, else None."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.device.type == "cpu" and not is_traced(cu_seqlens):
            return [int(x) for x in cu_seqlens.tolist()]
        return None
    return [int(x) for x in cu_seqlens]


def check_boundaries(values: list[int], seq_len: int, multiple: int, layout: str,
                     arg: str = "cu_seqlens", world_size: int | None = None) -> None:
    """ValueError unless ``values`` are [0, ..., seq_len], strictly increasing, every document's
    length a multiple of ``multiple`` (the layout's need; with ``world_size``, for a layout that
    places documents, every document it cuts: ``layouts/placement.py``); the error names the
    document."""
    if len(values) < 2:
        raise ValueError(f"{arg} must hold at least two boundaries [0, ..., S]; got {values}")
    if values[0] != 0:
        raise ValueError(f"{arg} must start at 0; got {arg}[0]={values[0]}")
    if values[-1] != seq_len:
        raise ValueError(f"{arg} must end at the sequence length {seq_len}; got "
                         f"{arg}[-1]={values[-1]}")
    lengths = [b - a for a, b in zip(values, values[1:])]
    for d, length in enumerate(lengths):
        if length <= 0:
            raise ValueError(f"{arg} must increase: document {d} ({arg}[{d}]={values[d]} to "
                             f"{arg}[{d + 1}]={values[d + 1]}) has length {length}")
    cut = None
    if any(n % multiple for n in lengths):
        cut = _cut(values, layout, world_size)
    for d, length in enumerate(lengths):
        if length % multiple and (cut is None or cut[d]):
            raise ValueError(
                f"document {d} of {arg} has length {length}, which layout {layout!r} cannot "
                f"split: every document it cuts across the ranks must have a length that is a "
                f"multiple of {multiple}{_cut_rule(seq_len, world_size) if cut else ''}; pad "
                f"the documents with dr.pad_documents"
                + (f"(..., world_size={world_size})" if cut else ""))


def _cut(values: list[int], layout: str, world_size: int | None) -> list[bool] | None:
    """Which documents ``layout`` cuts on ``world_size`` ranks (None: every one)."""
    if world_size is None or not getattr(LAYOUTS.get(layout), "places_documents", False):
        return None
    return cut_documents_host(values, world_size, values[-1] // world_size)


def _cut_rule(seq_len: int, world_size: int) -> str:
    """Why documents are cut (``layouts/placement.py``), for the error above."""
    return (f" (here every document up to the last one of at least "
            f"{cut_length(world_size, seq_len // world_size)} tokens is cut, and all of them "
            f"unless the ones after it fill the {world_size} ranks in row order, each the same "
            "number of tokens, with balanced work)")


def documents(cu_seqlens, max_seqlen, seq_len: int, multiple: int, layout: str,
              device: torch.device, arg: str = "cu_seqlens",
              world_size: int | None = None) -> Documents | None:
    """``cu_seqlens`` / ``max_seqlen`` of a public call, checked, as ``Documents`` on ``device``
    (None without documents). ``seq_len``: the global length the boundaries must end at;
    ``multiple``: what every document's length must be a multiple of (the layout's need); with
    ``world_size``, for a layout that places documents (``layouts/placement.py``), only every
    document it cuts. ``arg``: what the caller passed the boundaries as, for the errors about
    their values."""
    if cu_seqlens is None:
        if max_seqlen is not None:
            raise ValueError(f"max_seqlen={max_seqlen!r} is given without cu_seqlens; pass both "
                             "or neither")
        return None
    if not isinstance(cu_seqlens, (torch.Tensor, list, tuple)):
        raise TypeError("cu_seqlens must be a 1-D integer tensor [0, l1, l1+l2, ..., S]; got "
                        f"{type(cu_seqlens).__name__}")
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D (the same boundaries for every batch row); "
                             f"got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or (
                cu_seqlens.dtype == torch.bool):
            raise TypeError(f"cu_seqlens must be an integer tensor; got dtype {cu_seqlens.dtype}")
        if cu_seqlens.device.type != "cpu" and cu_seqlens.device != device:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but the inputs are on "
                             f"{device}; put it on the CPU or on the inputs' device")
        if cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must hold at least two boundaries [0, ..., S]; got "
                             f"{cu_seqlens.shape[0]}")
    elif not all(isinstance(x, int) and not isinstance(x, bool) for x in cu_seqlens):
        raise TypeError(f"cu_seqlens as a list must hold ints; got {cu_seqlens!r}")
    if max_seqlen is not None and not isinstance(max_seqlen, torch.SymInt):
        check_int(max_seqlen, "max_seqlen", 1, "a positive int (the longest document's length)")
    values, max_len = _checked(cu_seqlens, max_seqlen, seq_len, multiple, layout, device, arg,
                               world_size)
    if isinstance(cu_seqlens, torch.Tensor):
        cu = _on_device(cu_seqlens, device)
    else:
        cu = torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)
    return Documents.of(cu, max_len, values)


def _checked(cu_seqlens, max_seqlen, seq_len, multiple, layout, device, arg, world_size):
    """(the boundaries' host values or None, the bound on the longest document), their values
    checked where they are read. A boundaries tensor keeps the result while it is unchanged
    (``_version``) and called with the same arguments: a model's layers pass the same tensor, and
    the checks (and, for a device tensor without ``max_seqlen``, the sync) took 0.3 ms of host
    time per call on a 2-core CPU, where an eager call without documents took 0.01."""
    keep = isinstance(cu_seqlens, torch.Tensor) and not is_traced(cu_seqlens) and not (
        isinstance(max_seqlen, torch.SymInt))
    if keep:
        key = (cu_seqlens._version, max_seqlen, seq_len, multiple, layout, str(device), arg,
               world_size)
        held = getattr(cu_seqlens, "_dtensor_ring_checked", None)
        if held is not None and held[0] == key:
            return held[1]
    values = _host_values(cu_seqlens)
    if values is None and max_seqlen is None and not is_traced(cu_seqlens):
        values = [int(x) for x in cu_seqlens.tolist()]  # one device sync: see the module docstring
    if values is not None:
        check_boundaries(values, seq_len, multiple, layout, arg, world_size=world_size)
        longest = max(b - a for a, b in zip(values, values[1:]))
        if max_seqlen is not None and max_seqlen < longest:
            raise ValueError(f"max_seqlen={max_seqlen} is below the longest document of "
                             f"cu_seqlens ({longest} tokens)")
        max_len = longest if max_seqlen is None else max_seqlen
    else:
        max_len = seq_len if max_seqlen is None else max_seqlen
    if keep:
        cu_seqlens._dtensor_ring_checked = (key, (values, max_len))
    return values, max_len


def _on_device(cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``cu_seqlens`` as int32 on ``device``: the same tensor for the same boundaries tensor
    while it is unchanged, so that ``Documents.of`` finds the documents it derived for the last
    call (a model's layers pass one tensor; an int64 or CPU one was converted anew at each
    call, and its segments derived again: docs/design.md, "Host time of an eager call"). Not
    kept while traced or while a CUDA graph is captured (``Documents.of`` says why)."""
    if is_traced(cu_seqlens) or capturing(device):
        return cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True)
    key = (device, cu_seqlens._version)
    held = getattr(cu_seqlens, "_dtensor_ring_on_device", None)
    if held is None or held[0] != key:
        held = (key, cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True))
        if held[1] is not cu_seqlens:
            cu_seqlens._dtensor_ring_on_device = held
    return held[1]


def within_document(positions: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """Global positions -> positions within their documents (what RoPE needs for packed input)."""
    cu = cu.to(positions.device, torch.int64)
    doc = torch.searchsorted(cu, positions, right=True) - 1
    return positions - cu[doc]


class PaddedDocuments(NamedTuple):
    input_ids: torch.Tensor
    labels: torch.Tensor | None
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    source: torch.Tensor  # where each token comes from in the input row (-1: padding)


def pad_documents(input_ids: torch.Tensor, cu_seqlens, *, world_size: int | None = None,
                  length: int | None = None, multiple: int | None = None, labels=None,
                  pad_id: int = 0, dim: int = -1) -> PaddedDocuments:
    """Pad (and order) packed documents for context parallelism on ``world_size`` ranks.

    ``world_size=W``: the row every schedule takes with its short documents whole, each on one
    rank, and the long ones cut across the ranks (``layouts/placement.py``): the documents are
    reordered (the ones to cut first, then each rank's group of short ones), each cut document is
    padded to a multiple of 2W and each rank's group to the same length by padding documents.
    ``length``: the padded row's length, a multiple of 2W (e.g. a fixed length for
    ``torch.compile``); by default the shortest that works. ``multiple=m`` instead: each
    document padded to a multiple of m where it is, nothing reordered (every document is then cut
    across the ranks; ``dr.document_multiple(schedule, W)``).

    Each document keeps its tokens in order and gets ``pad_id`` tokens at its end, labels
    ``-100`` there (ignored by the loss), and positions that continue its own; a padding document
    is ``pad_id`` tokens with labels -100 and positions from 0. ``input_ids`` (and ``labels``)
    hold the packed row along ``dim`` (any leading batch dims, the same boundaries for every
    row). Returns the padded ids, labels (None if not given), the within-document positions, the
    new boundaries (an int32 CPU tensor) and ``source``: where each token comes from in the
    input row (-1: padding), to order other per-token tensors alike (``x.index_select(dim,
    source.clamp(min=0))``).

    Args:
        input_ids (torch.Tensor): the packed row(s) of token ids along ``dim``, any integer (or
            other) dtype, any leading batch dims, on any device.
        cu_seqlens (torch.Tensor | list[int]): the documents' boundaries over
            ``input_ids.shape[dim]``, [0, l1, l1+l2, ..., S], strictly increasing: a 1-D
            integer tensor (read on the host) or a list of ints.
        world_size (int | None): keyword-only: the ranks that will hold the row (>= 1): order
            and pad for placement. Exactly one of ``world_size`` and ``multiple``.
        length (int | None): with ``world_size``, the padded row's length, a multiple of
            2 * world_size; None (default): the shortest that works.
        multiple (int | None): pad each document where it is to a multiple of this positive
            int instead (``dr.document_multiple(schedule, W)``).
        labels (torch.Tensor | None): labels of input_ids' shape, padded with -100; None
            (default): none.
        pad_id (int): the padding token's id. Default 0.
        dim (int): the sequence dim of ``input_ids``, negative counting from the end. Default
            -1.

    Returns:
        PaddedDocuments: a named tuple of
            ``input_ids``: input_ids' shape with the padded length L along ``dim``, its dtype
            and device;
            ``labels``: the same shape, labels' dtype (-100 at padding), or None;
            ``position_ids``: int64, input_ids' padded shape (an expanded view), on its device:
            each token's position within its document;
            ``cu_seqlens``: int32, 1-D, on the CPU: the new boundaries over L (padding
            documents included);
            ``source``: int64, [L], on the CPU: each token's index in the input row, -1 for
            padding.

    Raises:
        TypeError: ``input_ids`` or ``labels`` not a tensor.
        ValueError: both or neither of ``world_size`` and ``multiple``; ``length`` with
            ``multiple``, or not a multiple of 2 * world_size, or too short for the documents;
            ``world_size`` or ``multiple`` not a positive int; ``dim`` out of range;
            ``cu_seqlens`` not boundaries of ``input_ids.shape[dim]``; ``labels`` of another
            shape.
    """
    check_tensor(input_ids, "input_ids")
    if (world_size is None) == (multiple is None):
        raise ValueError(f"pass one of world_size (the ranks that will hold the row) and "
                         f"multiple; got world_size={world_size!r}, multiple={multiple!r}")
    if multiple is not None:
        check_int(multiple, "multiple", 1, "a positive int (dr.document_multiple(schedule, "
                  "world))")
        if length is not None:
            raise ValueError(f"length={length!r} goes with world_size, not multiple")
    else:
        check_int(world_size, "world_size", 1, "a positive int (the ranks of the ring)")
        if length is not None:
            check_int(length, "length", 2 * world_size,
                      f"a multiple of 2 * world_size = {2 * world_size}")
            if length % (2 * world_size):
                raise ValueError(f"length={length} must be a multiple of 2 * world_size = "
                                 f"{2 * world_size}")
    dim = normalize_dim(input_ids, dim)
    seq_len = input_ids.shape[dim]
    values = _host_values(cu_seqlens)
    if values is None:
        values = [int(x) for x in cu_seqlens.tolist()]
    check_boundaries(values, seq_len, 1, "any")
    if labels is not None:
        check_tensor(labels, "labels")
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels has shape {tuple(labels.shape)} but input_ids has "
                             f"{tuple(input_ids.shape)}; they must match")
    lengths = [b - a for a, b in zip(values, values[1:])]
    row = (plan_row(lengths, world_size, length) if world_size is not None
           else [(d, -(-n // multiple) * multiple) for d, n in enumerate(lengths)])
    device = input_ids.device
    # Where each padded token comes from (-1: padding), built on the host: the pipeline's side.
    source = torch.cat([torch.cat([torch.arange(values[d], values[d] + lengths[d]),
                                   torch.full((p - lengths[d],), -1, dtype=torch.long)])
                        if d >= 0 else torch.full((p,), -1, dtype=torch.long)
                        for d, p in row])
    on_device = source.to(device)
    is_pad = on_device < 0
    shape = [1] * input_ids.dim()
    shape[dim] = source.shape[0]

    def take(x, fill):
        out = x.index_select(dim, on_device.clamp_min(0))
        return out.masked_fill(is_pad.view(shape), fill)

    positions = torch.cat([torch.arange(p) for _, p in row]).to(device)
    new_cu = torch.tensor([0, *torch.tensor([p for _, p in row]).cumsum(0).tolist()],
                          dtype=torch.int32)
    lead = list(input_ids.shape)
    lead[dim] = positions.shape[0]
    return PaddedDocuments(take(input_ids, pad_id),
                           None if labels is None else take(labels, IGNORE_INDEX),
                           positions.view(shape).expand(lead), new_cu, source)
