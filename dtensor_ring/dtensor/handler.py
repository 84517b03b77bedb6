"""The SDPA rule itself: a DTensor custom-op handler for the SDPA aten ops, forward and backward.

``install()`` (run when ``dtensor_ring`` is imported) adds ``sdpa_handler`` to DTensor's table of
custom op handlers (``DTensor._op_dispatcher._custom_op_handlers``, the hook PyTorch's own loss
parallel and context parallel use, present on torch 2.11 to 2.14) for the ops in ``sdpa_ops``.
A sharding strategy could only choose placements; the ring needs its own local computation.

For inputs that are not ours (``placements.plan_sdpa`` says None) the handler steps aside for the
one call and DTensor runs the op exactly as it would without dtensor_ring. For ours:

    forward:  local q/k/v -> schedule.forward on the sequence dimension's process group (or local
              attention if key/value are replicated) -> out and the fp32 LSE, placed like the query
    backward: local grad/q/k/v/out/LSE -> schedule.backward -> dq placed like q, dk/dv like k/v
              (``Partial`` on the sequence dimension for replicated key/value; in exact mode
              summed here in fp32 and rounded once, so replicated)

Exact mode's fp32 out is kept for the backward beside the 16-bit out the op returns
(``kept_out.py``), so that nothing is rounded before the final cast, as in ``ring_attention``.
"""
import threading

import torch
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .. import ops
from ..call import RingCall
from ..comm.mesh import whole_group
from ..hybrid import ops as hybrid_ops
from ..layouts import get_layout
from ..layouts.windows import check_window
from ..validation import check_options, check_qkv
from .kept_out import keep, kept
from .local_attention import local_backward, local_forward
from .placements import SdpaPlan, plan_sdpa
from .sdpa_ops import SDPA_OPS, bind

_STEP_ASIDE = threading.RLock()


def _handlers() -> dict:
    return DTensor._op_dispatcher._custom_op_handlers


def _default_dispatch(op, args, kwargs):
    """Run ``op`` through DTensor's own dispatch, as if this handler were not installed."""
    with _STEP_ASIDE:
        ours = _handlers().pop(op, None)
        try:
            return op(*args, **kwargs)
        finally:
            if ours is not None:
                _handlers()[op] = ours


def _contiguous_stride(shape) -> tuple:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


def _wrap(local: torch.Tensor, mesh, placements, shape) -> DTensor:
    meta = TensorMeta(torch.Size(shape), _contiguous_stride(shape), local.dtype)
    return DTensor(local, DTensorSpec(mesh, tuple(placements), tensor_meta=meta),
                   requires_grad=False)


def _empty(mesh, device) -> DTensor:
    return _wrap(torch.empty(0, device=device), mesh, [Replicate()] * mesh.ndim, (0,))


def _local(x: DTensor) -> torch.Tensor:
    return x._local_tensor


def _call(plan: SdpaPlan, spec, a, lq) -> RingCall:
    """The call (``call.py``) of SDPA's arguments and the registered schedule's options."""
    mask = a.get(spec.mask_arg) if spec.mask_arg else None
    if mask is not None:
        raise ValueError(
            f"{spec.mask_arg} is not supported with sequence-sharded SDPA (got a "
            f"{type(mask).__name__} of shape {tuple(mask.shape)}; query placements "
            f"{tuple(a['query'].placements)}): use is_causal=True or no mask")
    if a.get("dropout_mask") is not None:
        raise ValueError("dropout_mask is not supported with sequence-sharded SDPA; valid: None")
    check_options(is_causal=a["is_causal"], scale=a["scale"], precision=plan.entry.precision,
                  attn_mask=None, dropout_p=a["dropout_p"])
    # The registered window (SDPA has no argument for one), over the global sequence.
    call, _ = RingCall.resolve(lq, schedule=plan.entry.schedule,
                               mesh_shape=(plan.mesh.size(plan.seq_mesh_dim), plan.inner_size),
                               is_causal=a["is_causal"], scale=a["scale"],
                               backend=plan.entry.backend, precision=plan.entry.precision,
                               window=check_window(plan.entry.window),
                               seq_len=lq.shape[2] * plan.world_size)
    if call.window is not None and plan.inner_mesh_dim is not None:
        raise ValueError(f"window={tuple(call.window)} with a 2-D sequence sharding (mesh dims "
                         f"{plan.seq_mesh_dim}, {plan.inner_mesh_dim}): sliding windows run on a "
                         "1-D one (the hybrid schedule takes none)")
    return call


def _local_options(call: RingCall) -> dict:
    """What local attention (key/value replicated) takes of the call."""
    return dict(is_causal=call.is_causal, scale=call.scale, kernel=call.kernel,
                window=call.window)


def _group_names(plan: SdpaPlan) -> tuple:
    """The ring's process group by name; on a 2-D sequence sharding also the all-to-all's and
    the whole sequence mesh's (``comm/mesh.SequenceMesh``)."""
    outer = plan.mesh.get_group(plan.seq_mesh_dim).group_name
    if plan.inner_mesh_dim is None:
        return (outer,)
    dims = (plan.seq_mesh_dim, plan.inner_mesh_dim)
    names = plan.mesh.mesh_dim_names
    if not names and plan.mesh.ndim != 2:
        raise ValueError(f"a 2-D sequence sharding on a {plan.mesh.ndim}-D mesh needs the mesh's "
                         "dimension names (init_device_mesh(..., mesh_dim_names=...))")
    sequence_mesh = plan.mesh[tuple(names[i] for i in dims)] if names else plan.mesh
    return (outer, plan.mesh.get_group(plan.inner_mesh_dim).group_name,
            whole_group(sequence_mesh).group_name)


def _ring_ops(plan: SdpaPlan):
    """The custom ops (forward, backward) of the plan's schedule."""
    if plan.inner_mesh_dim is None:
        return ops.ring_attention_fwd, ops.ring_attention_bwd
    return hybrid_ops.hybrid_attention_fwd, hybrid_ops.hybrid_attention_bwd


def _local_layout_args(plan: SdpaPlan) -> dict:
    return dict(layout=get_layout(plan.entry.layout), world=plan.world_size,
                rank=plan.mesh.get_local_rank(plan.seq_mesh_dim))


def _forward(plan, spec, a):
    q, k, v = a["query"], a["key"], a["value"]
    lq, lk, lv = (_local(x).contiguous() for x in (q, k, v))
    if lk.shape[2] == lq.shape[2]:  # local attention may have a longer key/value
        check_qkv(lq, lk, lv)
    call = _call(plan, spec, a, lq)
    if plan.ring:
        out, lse = _ring_ops(plan)[0](lq, lk, lv, *call.op_args(_group_names(plan), None))
    else:
        out, lse = local_forward(lq, lk, lv, **_local_layout_args(plan), **_local_options(call))
    # Exact kernels return an fp32 out; SDPA's op returns the input dtype, and its backward
    # receives that: the fp32 one is kept for it (kept_out.py).
    rounded = out.to(lq.dtype)
    if rounded is not out and _needs_backward(q, k, v):
        keep(rounded, out)
    out = _wrap(rounded, plan.mesh, q.placements, q.shape)
    if spec.out_only:
        return out
    results = [out, _wrap(lse, plan.mesh, q.placements, q.shape[:3])]
    for extra in spec.extras:
        results.append(q.shape[2] if extra == "max" else _empty(plan.mesh, lq.device))
    return tuple(results)


def _needs_backward(*xs) -> bool:
    """Whether autograd will call the backward: an input needs a gradient and nothing traces
    this call (the rule's eager path; traced, see docs/guide.md's exact mode)."""
    return torch.is_grad_enabled() and any(x.requires_grad for x in xs)


def _backward(plan, spec, a):
    q, k, v, out, lse = a["query"], a["key"], a["value"], a["out"], a["logsumexp"]
    grad = a[spec.grad_arg]
    if tuple(grad.placements) != tuple(out.placements):
        grad = grad.redistribute(out.device_mesh, out.placements)
    lq, lk, lv = (_local(x).contiguous() for x in (q, k, v))
    call = _call(plan, spec, a, lq)
    fp32_out = kept(_local(out))
    lout = _local(out).contiguous() if fp32_out is None else fp32_out
    locals_ = (_local(grad).contiguous(), lq, lk, lv, lout, _local(lse))
    if plan.ring:
        dq, dk, dv = _ring_ops(plan)[1](*locals_, *call.op_args(_group_names(plan), None))
        kv_placements = k.placements
    else:
        dq, dk, dv = local_backward(*locals_, **_local_layout_args(plan), **_local_options(call))
        kv_placements = list(k.placements)
        if call.kernel.exact:  # the fp32 shares summed here, then rounded once
            group = plan.mesh.get_group(plan.seq_mesh_dim)
            dk, dv = (funcol.all_reduce(x, "sum", group).to(y.dtype)
                      for x, y in ((dk, lk), (dv, lv)))
        else:
            kv_placements[plan.seq_mesh_dim] = Partial()
    return (_wrap(dq, plan.mesh, q.placements, q.shape),
            _wrap(dk, plan.mesh, kv_placements, k.shape),
            _wrap(dv, plan.mesh, kv_placements, v.shape),
            *([None] * spec.extra_grads))


def sdpa_handler(op, args, kwargs):
    """DTensor custom-op handler for every op in ``SDPA_OPS``."""
    spec = SDPA_OPS[op]
    a = bind(op, args, kwargs)
    plan = plan_sdpa(a["query"], a["key"], a["value"])
    if plan is None:
        return _default_dispatch(op, args, kwargs)
    return _backward(plan, spec, a) if spec.backward else _forward(plan, spec, a)


# The handler each SDPA op had before ``install`` put ours there (None: none), while ours is.
_PREVIOUS: dict = {}


def install() -> bool:
    """Register ``sdpa_handler`` for the SDPA ops, keeping the handler each had for ``uninstall``
    (idempotent; other ops' handlers are left alone). Returns whether any op changed."""
    with _STEP_ASIDE:
        handlers, changed = _handlers(), False
        for op in SDPA_OPS:
            if handlers.get(op) is not sdpa_handler:
                _PREVIOUS[op] = handlers.get(op)
                handlers[op] = sdpa_handler
                changed = True
        return changed


def uninstall() -> bool:
    """Give each SDPA op back the handler it had before ``install`` (none: DTensor's own sharding
    rule); an op whose handler is no longer ours is left alone. Returns whether any op changed."""
    with _STEP_ASIDE:
        handlers, changed = _handlers(), False
        for op in SDPA_OPS:
            previous = _PREVIOUS.pop(op, None)
            if handlers.get(op) is sdpa_handler:
                if previous is None:
                    del handlers[op]
                else:
                    handlers[op] = previous
                changed = True
        return changed


def installed() -> bool:
    return all(_handlers().get(op) is sdpa_handler for op in SDPA_OPS)
