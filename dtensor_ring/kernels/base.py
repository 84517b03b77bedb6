"""The block-kernel interface every backend implements.

A block kernel computes attention of one block of queries against one block of keys:

    forward(q, k, v, mask, scale)                       -> out (q's dtype), lse (fp32, [B, H, Sq])
    backward(dout, q, k, v, out, lse, mask, scale)      -> dq, dk, dv (q's dtype)

``mask`` is one of ``MASKS``: ``"none"``; ``"causal"``, square blocks only (Sq == Sk), q row i sees
k rows 0..i; ``"causal_bottom_right"``, Sq <= Sk, q row i sees k rows 0..i + Sk - Sq (the last q row
sees every key), offered only by kernels that list it in ``masks``. In backward,
``out`` and ``lse`` are the *merged* results over all keys, so each block's gradients are exactly its
share of the full attention's gradients. q is [B, Hq, S, D]; k and v may have Hkv heads, Hq % Hkv == 0.

Exact kernels (``exact = True``, ``precision="exact"``) differ only in dtypes: ``forward`` returns
``out`` in fp32 (unrounded), ``backward`` takes that fp32 merged ``out`` and returns fp32 dq, dk, dv,
so the schedules' fp32 merge and sums see no 16-bit rounding until the final cast.

``forward_into`` and ``backward_into`` put the results straight into the schedules' fp32
accumulators: the forward's (out, lse) written or merged into the running ones, the gradients
written or added (``Into``: a view and whether to add). By default they run ``forward`` /
``backward`` and then one merge or accumulation pass; ``triton_exact`` does it in its own kernels,
which saves those passes.

Packed documents: every method also takes ``segments`` (``layouts.Segments``: which q rows attend
which keys; the mask applies within each segment, bottom-right aligned), offered by kernels with
``documents = True``, which then also offer "causal_bottom_right". A q row that sees no key (an
empty segment) gets out 0 and LSE -inf, which the merges leave out; the backward gives it dq 0,
and keys no row sees get dk = dv = 0.

Sliding windows: every method also takes ``window`` (``layouts/windows.py``: a ``Band`` on a plain
block, ``Positions`` with segments), offered in the forms listed in ``windows``
(``kernels/windows.py``); it bounds what each row sees on top of the mask and segments.
"""
from typing import NamedTuple, Optional

import torch

from ..merge import accumulate_, init_, merge_

NONE, CAUSAL, CAUSAL_BOTTOM_RIGHT = "none", "causal", "causal_bottom_right"
MASKS = (NONE, CAUSAL, CAUSAL_BOTTOM_RIGHT)


class BlockKernel:
    name: str = ""
    exact = False
    supports_gqa = True
    masks = (NONE, CAUSAL)
    documents = False  # takes ``segments`` (packed documents)
    windows: tuple = ()  # the window forms it takes: "band", "positions" (kernels/windows.py)

    def available(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
        raise NotImplementedError

    def forward(self, q, k, v, mask: str, scale: float, segments=None, window=None):
        raise NotImplementedError

    def forward_into(self, out, lse, fresh: bool, q, k, v, mask: str, scale: float,
                     segments=None, window=None) -> None:
        """``forward`` into the fp32 accumulator ``out``/``lse`` (views of its rows): written
        where ``fresh`` (the rows hold nothing yet), else merged into what they hold."""
        block_out, block_lse = self.forward(q, k, v, mask, scale, segments, window)
        (init_ if fresh else merge_)(out, lse, block_out, block_lse)

    def backward(self, dout, q, k, v, out, lse, mask: str, scale: float, segments=None,
                 window=None):
        raise NotImplementedError

    def backward_layout(self, x: torch.Tensor, q: torch.Tensor, documents: bool) -> torch.Tensor:
        """``x`` (dout or the merged out, [B, H, S, D] like the rank's ``q``) in the memory layout
        this kernel's backward needs or reads without a copy; a schedule calls it once per
        backward, on the whole tensors, so that no block copies it. ``documents``: the blocks
        have segments. Default: ``x`` as it is."""
        return x

    def backward_into(self, into: "tuple[Optional[Into], Optional[Into], Optional[Into]]",
                      dout, q, k, v, out, lse, mask: str, scale: float, segments=None,
                      window=None):
        """(dq, dk, dv) as ``backward``, except that each with an ``Into`` goes into it and is
        None in the result; dk and dv both have one (with the same ``add``) or neither."""
        grads = self.backward(dout, q, k, v, out, lse, mask, scale, segments, window)
        for target, grad in zip(into, grads):
            if target is not None:
                accumulate_(target.view, grad, target.add)
        return unclaimed(into, grads)


class Into(NamedTuple):
    """Where a block's gradient goes: a view of an fp32 accumulator, and whether to add the
    gradient to what the view holds (``add=True``) or overwrite it."""
    view: torch.Tensor
    add: bool


def unclaimed(into, grads) -> tuple:
    """``backward_into``'s result: each gradient that had no ``Into``, None for the others."""
    return tuple(None if target is not None else grad for target, grad in zip(into, grads))


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hkv * groups, S, D], kv head h serving q heads h*groups .. h*groups+groups-1.

    Only for kernels without native GQA, on the compute side: K/V never travel repeated.
    """
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def sum_kv_groups(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of ``repeat_kv`` for gradients: sum each kv head's q-head group."""
    if groups == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // groups, groups, s, d).sum(dim=2)
