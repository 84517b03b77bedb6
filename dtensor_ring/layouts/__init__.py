"""Sequence layouts: which global tokens each rank holds, and which blocks a ring step computes.

A layout maps rank ``r`` of ``W`` to the global positions of its ``S_local`` tokens and, for the ring
exchange, says which (q rows, k rows, mask) blocks rank ``r`` computes when it holds the K/V of rank
``src``. Each layout's file draws its block grid once.
"""
from .base import Layout
from .blocks import Block, Segments
from .contiguous import CONTIGUOUS
from .stripe import STRIPE
from .zigzag import ZIGZAG

LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (CONTIGUOUS, ZIGZAG, STRIPE)}


def get_layout(name) -> Layout:
    if name not in LAYOUTS:
        raise ValueError(f"layout={name!r} is not a known layout; valid layouts: {sorted(LAYOUTS)}")
    return LAYOUTS[name]


__all__ = ["Block", "Layout", "LAYOUTS", "Segments", "get_layout"]
