"""fp32 online-softmax merge of partial attention results.

Two partial results over disjoint key sets, (out_a, lse_a) and (out_b, lse_b), combine into the
attention over their union:

    out = (exp(lse_a) out_a + exp(lse_b) out_b) / (exp(lse_a) + exp(lse_b))
    lse = log(exp(lse_a) + exp(lse_b))

written in the form that never overflows and loses least when one side dominates:

    out -= sigmoid(lse_b - lse_a) * (out_a - out_b)
    lse -= logsigmoid(lse_a - lse_b)

The accumulator (out, lse) is fp32 whatever the input dtype; the block is upcast as it is read.

Implementations, one per device kind (``MERGES``): on CUDA one Triton kernel (``triton_merge.py``,
one pass over the accumulator), elsewhere these torch ops. Traced code (the compile pass's
``make_fx``) takes the torch ops on any device: inductor fuses them into one kernel itself.
"""
import importlib.util

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.proxy_tensor import get_proxy_mode


def torch_merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                 block_lse: torch.Tensor) -> None:
    weight = torch.sigmoid(block_lse - lse).unsqueeze(-1)
    out.sub_(weight * (out - block_out))
    lse.sub_(F.logsigmoid(lse - block_lse))


def triton_merge_(out, lse, block_out, block_lse) -> None:
    from .triton_merge import merge_  # noqa: PLC0415 - triton is optional

    merge_(out, lse, block_out, block_lse)


_HAS_TRITON = importlib.util.find_spec("triton") is not None
MERGES = {"cuda": triton_merge_ if _HAS_TRITON else torch_merge_, "other": torch_merge_}


def merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    """Merge one block into the fp32 accumulator in place.

    ``out`` [B, H, S, D] and ``lse`` [B, H, S] are fp32 (views are fine); ``block_out`` is in any
    float dtype, ``block_lse`` fp32. ``lse`` must be finite: start the accumulator from a block
    that covers every row (``init_``).
    """
    traced = get_proxy_mode() is not None or is_fake(out)
    kind = "cuda" if out.device.type == "cuda" and not traced else "other"
    MERGES[kind](out, lse, block_out, block_lse)


def init_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> None:
    """Start the accumulator from a block that covers its rows."""
    out.copy_(block_out)
    lse.copy_(block_lse)
