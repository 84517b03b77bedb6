"""The layout interface (the blocks it gives: ``blocks.py``) and helpers of the layouts' files."""
import torch

from .blocks import Block, Segments
from .placement import placement_of


class Layout:
    """Maps local token indices to global positions; subclasses give ``positions`` and
    ``ring_blocks``, and with packed documents (``boundaries.Documents``) their per-document
    forms. A layout that ``places_documents`` applies its per-document form to the long
    documents only and keeps the short ones whole (``placement.py``)."""

    name: str
    places_documents = False

    def placement_world(self, world_size: int) -> int:
        """The ranks that packed documents are placed over (``placement.py``) on a mesh of
        ``world_size``: all of them (a hybrid layout: its ring's)."""
        return world_size

    def document_multiple(self, world_size: int) -> int:
        """What every packed document's length must be a multiple of."""
        return 1

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

    def positions(self, local_len: int, rank: int, world_size: int, docs=None) -> torch.Tensor:
        """Global positions (int64, length ``local_len``) of rank ``rank``'s tokens; with
        documents, on their device."""
        if docs is None:
            return self.dense_positions(local_len, rank, world_size)
        if self.places_documents:
            return placement_of(docs, world_size, local_len).positions(self, rank)
        return self.document_positions(local_len, rank, world_size, docs)

    def dense_positions(self, local_len, rank, world_size) -> torch.Tensor:
        raise NotImplementedError

    def runs(self, local_len: int, rank: int, world_size: int) -> list:
        """Rank ``rank``'s tokens (no documents) as ``windows.Run``s: local rows at evenly spaced
        global positions (what ``windows.band_block`` takes)."""
        raise NotImplementedError

    def document_positions(self, local_len, rank, world_size, docs) -> torch.Tensor:
        raise NotImplementedError

    def ring_blocks(self, local_len: int, rank: int, src: int, world_size: int,
                    is_causal: bool, docs=None) -> list[Block]:
        """Blocks rank ``rank`` computes holding the K/V of rank ``src``. Non-causal: all of it
        (with documents: each document's rows against its keys)."""
        if docs is not None and self.places_documents:
            placement = placement_of(docs, world_size, local_len)
            return (placement.own_blocks(rank, is_causal) if src == rank
                    else placement.long_blocks(self, rank, src, is_causal))
        if docs is not None:
            return self.document_ring_blocks(local_len, rank, src, world_size, is_causal, docs)
        if not is_causal:
            return [Block(slice(0, local_len), slice(0, local_len), "none")]
        return self.causal_ring_blocks(local_len, rank, src, world_size)

    def causal_ring_blocks(self, local_len, rank, src, world_size) -> list[Block]:
        raise NotImplementedError

    def document_ring_blocks(self, local_len, rank, src, world_size, is_causal,
                             docs) -> list[Block]:
        raise NotImplementedError


def whole(local_len: int, mask: str, segments: Segments) -> Block:
    """A block over every local row and every held key row, split by ``segments``."""
    return Block(slice(0, local_len), slice(0, local_len), mask, segments)


def local_bounds(docs, world_size):
    """Each document's local rows on every rank (stripe and zigzag): [cu / W] (int32)."""
    return docs.cached(("local_bounds", world_size), lambda: torch.div(
        docs.cu, world_size, rounding_mode="floor").to(torch.int32))


def doc_index(local_bounds: torch.Tensor, local_len: int):
    """For each local row: its document and its index within the document's local rows."""
    rows = torch.arange(local_len, device=local_bounds.device)
    doc = torch.searchsorted(local_bounds, rows, right=True) - 1
    return doc, rows - local_bounds[doc]


def pairs(*columns: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Interleave per-document columns into segment boundaries: [c0[0], c1[0], ..., c0[1], ...,
    last] (int32)."""
    return torch.cat([torch.stack(columns, 1).flatten(), last.reshape(1)]).to(torch.int32)
