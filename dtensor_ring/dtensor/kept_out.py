"""Exact mode's fp32 output, kept from the SDPA rule's forward for its backward.

SDPA's aten ops return the input dtype, and autograd hands their backward that 16-bit ``out``.
Exact mode's backward takes D = rowsum(dO * O) from the fp32 merged out, as ``ring_attention``
does: computed from the rounded out instead, the rule's dq and dk carried 1.08-1.10x the error
of ``ring_attention``'s exact mode (W = 2, CPU; tests/test_dtensor_rule.py checks it).

So the rule keeps the fp32 out beside the 16-bit one it returns, for exactly as long as the 16-bit
out's storage lives: autograd saves that out for the backward, so until the graph is freed; where
nothing saves it, it goes with the 16-bit out. The key is the storage's identity, which the
16-bit out shares with every view, detached copy and the tensor autograd saves of it; the entry
is dropped by a finalizer on that storage, which runs when the storage is freed (before its
``id`` can be reused).
"""
import weakref

import torch

_KEPT: dict = {}  # id(16-bit out's storage) -> fp32 out


def keep(rounded: torch.Tensor, fp32_out: torch.Tensor) -> None:
    """Keep ``fp32_out`` for the backward of ``rounded``, its 16-bit cast (a new tensor: were it
    ``fp32_out`` itself, the entry would keep its own key alive)."""
    if rounded.dtype == fp32_out.dtype:
        raise ValueError(f"keep: rounded has fp32_out's dtype {fp32_out.dtype}; nothing to keep")
    storage = rounded.untyped_storage()
    key = id(storage)
    _KEPT[key] = fp32_out
    weakref.finalize(storage, _KEPT.pop, key, None).atexit = False  # at exit the dict goes anyway


def kept(rounded: torch.Tensor):
    """The fp32 out kept for ``rounded`` (the out autograd saved), or None if there is none."""
    found = _KEPT.get(id(rounded.untyped_storage()))
    if found is None or found.shape != rounded.shape:
        return None
    return found
