"""Installing the passes into inductor without displacing a user's own custom pass.

Inductor has one slot per custom pass position; ``install`` puts ``RingExpandPass`` in
``post_grad_custom_pre_pass`` (before inductor's own post-grad passes, so the merges it inserts are
fused and re-inplaced like any other code). A pass already in that slot is kept and run after ours,
through ``ComposedPass``, whose uuid combines both (None if the other has none: the FX graph cache
is then bypassed, as inductor does for any pass without a uuid). A user who sets the slot after
importing dtensor_ring should set ``ComposedPass(RingExpandPass(), their_pass)``.
"""
import hashlib

import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

from .ring_expand import RingExpandPass


class ComposedPass(CustomGraphPass):
    def __init__(self, *passes):
        self.passes = passes

    def __call__(self, graph):
        for graph_pass in self.passes:
            graph_pass(graph)

    def uuid(self):
        parts = [p.uuid() if hasattr(p, "uuid") else None for p in self.passes]
        if any(part is None for part in parts):
            return None
        return hashlib.sha256(repr(parts).encode()).hexdigest()


def _has_ring_expand(graph_pass) -> bool:
    if isinstance(graph_pass, RingExpandPass):
        return True
    return isinstance(graph_pass, ComposedPass) and any(map(_has_ring_expand, graph_pass.passes))


def install() -> bool:
    """Idempotent: put ``RingExpandPass`` in front of whatever pre pass is set. Returns whether the
    slot changed."""
    current = inductor_config.post_grad_custom_pre_pass
    if _has_ring_expand(current):
        return False
    ours = RingExpandPass()
    inductor_config.post_grad_custom_pre_pass = ours if current is None else ComposedPass(ours,
                                                                                        current)
    return True


def _without_ring_expand(graph_pass):
    """``graph_pass`` with every ``RingExpandPass`` taken out (None if nothing is left); the same
    object where it holds none, so that ``install``'s ``ComposedPass(ours, previous)`` gives back
    ``previous`` itself."""
    if isinstance(graph_pass, RingExpandPass):
        return None
    if not _has_ring_expand(graph_pass):
        return graph_pass
    rest = [p for p in map(_without_ring_expand, graph_pass.passes) if p is not None]
    return None if not rest else rest[0] if len(rest) == 1 else ComposedPass(*rest)


def uninstall() -> bool:
    """Take ``RingExpandPass`` out of the slot: what ``install`` put there gives back what the slot
    held before it (a ``ComposedPass`` a user set around ours gives back their pass). Returns
    whether the slot changed."""
    current = inductor_config.post_grad_custom_pre_pass
    if not _has_ring_expand(current):
        return False
    inductor_config.post_grad_custom_pre_pass = _without_ring_expand(current)
    return True
