"""``dr.global_mean_loss`` on one rank (a one-process gloo group): the sum over the count, eager and
under ``torch.compile`` with ``fullgraph=True`` (its all-reduce of the count is a traceable
functional collective), exactly the cross-entropy's own mean; bad arguments are named. Its use on
several ranks, with FSDP2 over data x context, is in ``test_data_parallel.py``."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import dtensor_ring as dr


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_global_mean_loss_is_the_mean_eager_and_compiled(mesh):
    total = torch.tensor(6.0, requires_grad=True)
    loss = dr.global_mean_loss(total, torch.tensor(4), mesh)
    loss.backward()
    assert loss.item() == 1.5 and total.grad.item() == 0.25
    assert dr.global_mean_loss(total, 3, dist.group.WORLD).item() == 2.0

    def mean(logits, labels):
        summed = F.cross_entropy(logits, labels, reduction="sum")
        return dr.global_mean_loss(summed, (labels != -100).sum(), mesh)

    logits = torch.randn(8, 5)
    labels = torch.tensor([1, 2, -100, 3, 4, -100, 0, 1])
    expected = F.cross_entropy(logits, labels)
    for fn in (mean, torch.compile(mean, fullgraph=True)):
        assert torch.allclose(fn(logits, labels), expected, rtol=1e-6, atol=0)
    counting_ignored = dr.global_mean_loss(F.cross_entropy(logits, labels, reduction="sum"),
                                           labels.numel(), mesh)  # the -100 labels counted
    assert not torch.allclose(counting_ignored, expected, rtol=1e-3, atol=0)


def test_global_mean_loss_errors(mesh):
    total = torch.tensor(6.0)
    with pytest.raises(TypeError, match=r"count must be a non-negative int or an integer tensor "
                       r"\(the number of valid labels\); got 2.5"):
        dr.global_mean_loss(total, 2.5, mesh)
    with pytest.raises(TypeError, match=r"count must be an int or a one-element integer tensor.*"
                       r"torch.float32 tensor of shape \(\)"):
        dr.global_mean_loss(total, torch.tensor(2.0), mesh)
    with pytest.raises(TypeError, match=r"loss_sum must be a floating-point tensor \(a sum of "
                       r"token losses\); got int"):
        dr.global_mean_loss(6, 4, mesh)
    with pytest.raises(ValueError, match=r"mesh must be a 1-D DeviceMesh; got a 2-D mesh"):
        dr.global_mean_loss(total, 4, init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "cp")))
