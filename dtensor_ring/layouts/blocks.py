"""The block description shared by the layouts and the schedules: a ``Block`` (one kernel call)
and its ``Segments`` (packed documents inside it)."""
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch


class Segments(NamedTuple):
    """Packed documents inside one block: segment i pairs the block's q rows
    ``[cu_q[i], cu_q[i+1])`` with its k rows ``[cu_k[i], cu_k[i+1])`` (offsets into the block's
    slices; int32 tensors on the compute device, the same for every batch row), and no q row
    sees a key of another segment. The block's ``mask`` applies within each segment, aligned to
    its bottom-right corner (flash-attn's varlen convention; square segments: top-left). A
    segment may hold no q rows or no k rows: the layouts add such empty segments so that every
    block covers whole row ranges, with no gathering of rows. ``max_q`` / ``max_k`` bound the
    segments' lengths (host ints: they size the varlen kernels' grids)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


@dataclass(frozen=True, eq=False)
class Block:
    """One kernel call: local q rows ``q`` attend k rows ``k`` of the K/V held this step, under
    ``mask``: "none", "causal" (square, q row i sees k rows 0..i of the slice) or
    "causal_bottom_right" (see kernels/base.py). With packed documents, ``segments`` says which
    rows of the block attend which (the mask then applies within each segment). With a sliding
    window, ``window`` (``windows.Band`` or ``windows.Positions``) bounds what each row sees."""

    q: slice
    k: slice
    mask: str
    segments: Optional[Segments] = None
    window: Optional[object] = None
