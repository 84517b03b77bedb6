"""Activation checkpointing with ring attention: a selective-checkpointing policy that saves the
ring's outputs, so the recompute does not redo the ring's communication.

    from torch.utils.checkpoint import checkpoint
    import dtensor_ring as dr

    h = checkpoint(block, h, use_reentrant=False, context_fn=dr.save_ring_attention_context)
    # or with checkpoint_wrapper:
    block = checkpoint_wrapper(block, context_fn=dr.save_ring_attention_context)

Plain activation checkpointing works with ring attention as with any op (``ContextParallel`` routes
the recompute's SDPA to the ring as in the forward; the DTensor rule needs nothing), but its
recompute runs the ring's forward again: W-1 K/V exchanges (ring schedules) or an all-gather
(llama3) per attention, on top of the backward's. With this policy the recompute takes the ring's
(out, lse) from the forward instead -- one output-sized tensor and one fp32 [B, H, S] LSE per
attention kept -- and recomputes everything else (the projections, norms, MLP).

How: selective checkpointing (``torch.utils.checkpoint.create_selective_checkpoint_contexts``) asks
a policy about each op it sees through a dispatch mode; ``save_ring_attention`` answers
``MUST_SAVE`` for the ring's custom op ``dtensor_ring::ring_attention_fwd`` (and the hybrid's,
``hybrid_attention_fwd``, on a 2-D mesh) and for SDPA's aten
forward ops (the DTensor rule runs the ring inside those), ``PREFER_RECOMPUTE`` for the rest.
``ring_attention`` calls the custom op whenever a dispatch mode is active, so the policy sees the
ring as one op eagerly too; under ``torch.compile`` the partitioner applies the same policy.

``dtensor_ring.comm.TRAFFIC`` counts the exchanges the eager ring posts and
``dtensor_ring.passes.COUNTERS["recomputed_ring_attention_fwd"]`` the ring forwards the compile
pass finds in backward graphs, which is how the tests check that the policy leaves the recompute
without communication.
"""
import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from . import ops  # noqa: F401 - registers torch.ops.dtensor_ring
from .dtensor.sdpa_ops import FORWARD_OPS
from .hybrid import ops as _hybrid_ops  # noqa: F401 - registers the hybrid's op

SAVED_OPS = frozenset((torch.ops.dtensor_ring.ring_attention_fwd.default,
                       torch.ops.dtensor_ring.hybrid_attention_fwd.default, *FORWARD_OPS))


def save_ring_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpointing policy: save the attention outputs (``SAVED_OPS``), recompute the
    rest.

    The signature of a policy for ``torch.utils.checkpoint.create_selective_checkpoint_contexts``
    (``save_ring_attention_context`` builds the contexts from it).

    Args:
        ctx: the ``SelectiveCheckpointContext`` of the call (unused).
        op (torch._ops.OpOverload): the op about to run, e.g.
            ``torch.ops.dtensor_ring.ring_attention_fwd.default``.
        *args, **kwargs: the op's arguments (unused).

    Returns:
        CheckpointPolicy: ``MUST_SAVE`` for the ring's and the hybrid's forward ops and SDPA's
        aten forward ops (the DTensor rule runs the ring inside those), ``PREFER_RECOMPUTE`` for
        every other op.
    """
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def save_ring_attention_context(also_save=()):
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` and
    ``checkpoint_wrapper``: selective checkpointing with ``save_ring_attention``. ``also_save``:
    more ops to save (e.g. ``torch.ops.aten.mm.default``), through ``functools.partial``.

    Args:
        also_save (Iterable[torch._ops.OpOverload]): ops to save besides the attention outputs,
            e.g. ``(torch.ops.aten.mm.default,)``. Default: none.

    Returns:
        tuple: the (forward context, recompute context) pair of
        ``torch.utils.checkpoint.create_selective_checkpoint_contexts``, as ``context_fn`` must
        return.

    Raises:
        TypeError: an entry of ``also_save`` that is not an op overload (e.g. an
            ``OpOverloadPacket`` such as ``torch.ops.aten.mm``).
    """
    extra = frozenset(also_save)
    for op in extra:
        if not isinstance(op, torch._ops.OpOverload):
            raise TypeError(f"also_save must hold op overloads such as torch.ops.aten.mm.default; "
                            f"got {op!r} ({type(op).__name__})")
    if not extra:
        return create_selective_checkpoint_contexts(save_ring_attention)

    def policy(ctx, op, *args, **kwargs):
        if op in extra:
            return CheckpointPolicy.MUST_SAVE
        return save_ring_attention(ctx, op, *args, **kwargs)
    return create_selective_checkpoint_contexts(policy)
