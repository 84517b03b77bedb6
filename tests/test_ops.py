"""The custom ops pass torch.library.opcheck (schema, fake implementation, autograd registration,
AOT dispatch) for every schedule, on a one-process gloo group."""
import pytest
import torch
import torch.distributed as dist

import dtensor_ring  # noqa: F401 - registers the ops
from dtensor_ring import ops


@pytest.fixture(scope="module")
def group_name():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def _inputs(requires_grad):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 8, 16, generator=gen, requires_grad=requires_grad)
    k = torch.randn(1, 2, 8, 16, generator=gen, requires_grad=requires_grad)
    v = torch.randn(1, 2, 8, 16, generator=gen, requires_grad=requires_grad)
    return q, k, v


@pytest.mark.parametrize("schedule", sorted(dtensor_ring.SCHEDULES))
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("window", [(-1, -1), (3, 2)], ids=["no window", "window"])
def test_opcheck(group_name, schedule, is_causal, window):
    options = (group_name, schedule, is_causal, 0.25, "cpu_flash", "fp32", None, 0, *window)
    torch.library.opcheck(ops.ring_attention_fwd, (*_inputs(True), *options))
    q, k, v = _inputs(False)
    out, lse = ops.ring_attention_fwd(q, k, v, *options)
    torch.library.opcheck(ops.ring_attention_bwd, (torch.randn_like(out), q, k, v, out, lse,
                                                   *options))


def test_opcheck_transposed_inputs(group_name):
    """q/k/v as a model makes them, [B, S, H, D] transposed to [B, H, S, D] views: the fake
    implementations must give the real outputs' strides (contiguous)."""
    def transposed(x):
        return x.transpose(1, 2).contiguous().transpose(1, 2)

    options = (group_name, "zigzag", True, 0.25, "cpu_flash", "fp32", None, 0, -1, -1)
    q, k, v = map(transposed, _inputs(False))
    torch.library.opcheck(ops.ring_attention_fwd, (q, k, v, *options))
    out, lse = ops.ring_attention_fwd(q, k, v, *options)
    torch.library.opcheck(ops.ring_attention_bwd, (torch.randn_like(out), q, k, v, out, lse,
                                                   *options))


def _eager_and_op(group_name, precision, backend):
    """ring_attention's eager path (its own autograd.Function) and the custom op's, fwd and bwd."""
    group = dist.group.WORLD
    results = []
    for use_op in (False, True):
        q, k, v = (x.bfloat16().detach().requires_grad_() for x in _inputs(False))
        if use_op:
            out, _ = ops.ring_attention_fwd(q, k, v, group_name, "zigzag", True, 0.25, backend,
                                            precision, None, 0, -1, -1)
            out = out.to(q.dtype)
        else:
            out = dtensor_ring.ring_attention(q, k, v, mesh=group, schedule="zigzag",
                                              is_causal=True, scale=0.25, precision=precision)
            assert type(out.grad_fn).__name__ == "_RingBackward"
        out.backward(torch.ones_like(out))
        results.append([out, q.grad, k.grad, v.grad])
    return results


@pytest.mark.parametrize("precision,backend", [("fp32", "cpu_flash"), ("exact", "cpu_flash_exact")])
def test_eager_ring_attention_gives_the_ops_bits(group_name, precision, backend):
    """Eagerly ring_attention skips the op's dispatch; the results are the op's, bit for bit."""
    eager, via_op = _eager_and_op(group_name, precision, backend)
    for name, a, b in zip(("out", "dq", "dk", "dv"), eager, via_op):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), name


def test_traced_ring_attention_is_the_op(group_name):
    """Traced (here make_fx on fake tensors) ring_attention is one op node, as the pass needs."""
    from torch.fx.experimental.proxy_tensor import make_fx  # noqa: PLC0415

    def attend(q, k, v):
        return dtensor_ring.ring_attention(q, k, v, mesh=dist.group.WORLD, schedule="zigzag",
                                           is_causal=True)
    gm = make_fx(attend, tracing_mode="fake")(*_inputs(False))
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count("dtensor_ring.ring_attention_fwd.default") == 1, targets


def test_flop_counter_counts_ring_attention(group_name):
    """Under FlopCounterMode ring_attention runs its custom op (a dispatch mode is active), whose
    formulas count as FlopCounterMode counts SDPA on CUDA: 2 matmuls of B*H*S_q*S_k*D forward,
    5 backward (here W = 1, so S_k = S_q); the mode cannot see inside the op, so without the
    formulas it counted 0."""
    from torch.utils.flop_counter import FlopCounterMode  # noqa: PLC0415

    gen = torch.Generator().manual_seed(1)
    batch, heads, seq, head_dim = 1, 4, 8, 16
    q, k, v = (torch.randn(batch, heads, seq, head_dim, generator=gen, requires_grad=True)
               for _ in range(3))
    with FlopCounterMode(display=False) as counter:
        out = dtensor_ring.ring_attention(q, k, v, mesh=dist.group.WORLD, schedule="zigzag",
                                          is_causal=True)
        forward = counter.get_total_flops()
        out.sum().backward()
    matmul = 2 * batch * heads * seq * seq * head_dim
    assert (forward, counter.get_total_flops()) == (2 * matmul, 7 * matmul)
