"""The packed-document mix of the benchmarks (``--documents`` of per_rank.py and speed.py): many
short documents and a few long ones over one row, as a long-context training batch packs them."""
import itertools

import torch

from dtensor_ring.layouts.placement import plan_row


def document_mix(seq: int, world: int, seed: int) -> tuple:
    """A long-tailed mix of packed documents over a row of ``seq`` tokens: many short, a few
    long (lengths log-uniform between 32W and seq / 2, multiples of 32W; the last one fills)."""
    gen = torch.Generator().manual_seed(seed)
    unit, bounds = 32 * world, [0]
    while bounds[-1] < seq:
        length = unit * round(2 ** (torch.rand((), generator=gen).item()
                                    * torch.log2(torch.tensor(seq / 2 / unit)).item()))
        bounds.append(min(seq, bounds[-1] + max(unit, length)))
    return tuple(bounds)


def placed_mix(seq: int, world: int, seed: int) -> tuple:
    """``document_mix`` over 63/64 of a row of ``seq`` tokens (less if that does not fit),
    ordered and padded to ``seq`` tokens as ``dr.pad_documents(..., world_size=world,
    length=seq)`` does: the documents to cut first, each rank's short ones whole after them."""
    for slack in (64, 32, 16, 8):
        mix = document_mix(seq - seq // slack, world, seed)
        try:
            row = plan_row([b - a for a, b in zip(mix, mix[1:])], world, length=seq)
        except ValueError:
            continue
        return tuple(itertools.accumulate((p for _, p in row), initial=0))
    raise ValueError(f"no placement of the documents in {seq} tokens on {world} ranks")
