"""The layout interface and the block description shared by all schedules."""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Block:
    """One kernel call: local q rows ``q`` attend k rows ``k`` of the K/V held this step, under
    ``mask``: "none", "causal" (square, q row i sees k rows 0..i of the slice) or
    "causal_bottom_right" (see kernels/base.py)."""

    q: slice
    k: slice
    mask: str


class Layout:
    """Maps local token indices to global positions; subclasses give ``positions`` and ``ring_blocks``."""

    name: str

    def check_local_len(self, local_len: int, arg: str = "local sequence length") -> None:
        """Raise ValueError if ``local_len`` cannot be held by one rank in this layout."""
        if local_len < 1:
            raise ValueError(f"{arg}={local_len} must be at least 1 for layout {self.name!r}")

    def check_global_len(self, seq_len: int, world_size: int, arg: str = "seq_len") -> None:
        if seq_len % world_size:
            raise ValueError(
                f"{arg}={seq_len} is not divisible by the mesh size {world_size}, "
                f"as layout {self.name!r} needs")
        self.check_local_len(seq_len // world_size, f"{arg} // world_size")

    def positions(self, local_len: int, rank: int, world_size: int) -> torch.Tensor:
        """Global positions (int64, length ``local_len``) of rank ``rank``'s tokens."""
        raise NotImplementedError

    def ring_blocks(self, local_len: int, rank: int, src: int, world_size: int,
                    is_causal: bool) -> list[Block]:
        """Blocks rank ``rank`` computes holding the K/V of rank ``src``. Non-causal: all of it."""
        if not is_causal:
            return [Block(slice(0, local_len), slice(0, local_len), "none")]
        return self.causal_ring_blocks(local_len, rank, src, world_size)

    def causal_ring_blocks(self, local_len, rank, src, world_size) -> list[Block]:
        raise NotImplementedError
