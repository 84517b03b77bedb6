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
def test_opcheck(group_name, schedule, is_causal):
    options = (group_name, schedule, is_causal, 0.25, "cpu_flash", "fp32")
    torch.library.opcheck(ops.ring_attention_fwd, (*_inputs(True), *options))
    q, k, v = _inputs(False)
    out, lse = ops.ring_attention_fwd(q, k, v, *options)
    torch.library.opcheck(ops.ring_attention_bwd, (torch.randn_like(out), q, k, v, out, lse,
                                                   *options))
