"""Eager ``ring_attention`` remembers a call whose arguments passed its checks (``attention.py``,
``_CHECKED``) and skips them when the same call comes again, as a model's does at every layer: on
2 gloo ranks, the repeated call takes no second resolution and gives the same bits; any change
the checks read (an option or its type, a dtype, a shape, another mesh) is checked again, so a
bad argument after a good call still raises; calls with documents are never remembered. The
communicator of a group is made once (``comm/process_group.comm_of``). One boundaries tensor
(int64, on the CPU) is converted and placed once, and anew when it changes in place
(``documents._on_device``)."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import dtensor_ring as dr
from dtensor_ring import attention
from dtensor_ring.comm.process_group import comm_of
from dist_utils import run_on_ranks
from dtensor_ring.tools.numerics import make_inputs


def _counting_prepare(calls):
    real = attention._prepare

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    return counted


def _check(mesh):
    rank = mesh.get_local_rank()
    calls = []
    attention._prepare = _counting_prepare(calls)
    attention._CHECKED.clear()
    whole = [x.float() for x in make_inputs(1, 4, 2, 64, 16, seed=3)[:3]]
    q, k, v = (dr.shard_sequence(x, mesh) for x in whole)

    def ring(q=q, k=k, v=v, mesh=mesh, **options):
        return dr.ring_attention(q, k, v, mesh=mesh, schedule="zigzag", is_causal=True, **options)

    first = ring()
    assert len(calls) == 1, f"rank {rank}: the first call is checked once"
    again = ring()
    assert len(calls) == 1, f"rank {rank}: the repeated call was checked again"
    assert torch.equal(first, again), f"rank {rank}: the remembered call differs"
    ring(q=q.double(), k=k.double(), v=v.double())
    assert len(calls) == 2, f"rank {rank}: another dtype was not checked"
    ring(scale=0.5)
    assert len(calls) == 3, f"rank {rank}: another option was not checked"
    with pytest.raises(ValueError, match="scale"):
        ring(scale=-1.0)
    with pytest.raises(ValueError, match="precision"):
        ring(precision="fp8")
    with pytest.raises(TypeError, match="is_causal"):  # equal to True, refused for its type
        dr.ring_attention(q, k, v, mesh=mesh, schedule="zigzag", is_causal=1)
    with pytest.raises(ValueError, match="max_seqlen"):
        ring(max_seqlen=32)
    other = DeviceMesh.from_group(dist.new_group([0, 1]), "cpu")
    ring(mesh=other)
    assert len(calls) == 8, f"rank {rank}: another mesh was not checked"
    bounds = torch.tensor([0, 32, 64])
    docs = [dr.shard_sequence(x, mesh, cu_seqlens=bounds) for x in whole]
    for _ in range(2):
        dr.ring_attention(*docs, mesh=mesh, schedule="zigzag", is_causal=True, cu_seqlens=bounds)
    assert len(calls) == 10, f"rank {rank}: a call with documents was remembered"
    group = mesh.get_group()
    assert comm_of(group) is comm_of(group), f"rank {rank}: a group's communicator made twice"


def test_a_checked_call_is_remembered_and_any_change_is_checked_again():
    run_on_ranks(2, _check)


def _check_boundaries_tensor(mesh):
    """The same int64 CPU boundaries tensor at every call (as a model's layers pass it): its
    device copy and the placement derived from it are made once; changed in place, anew."""
    from dtensor_ring.layouts import placement
    rank = mesh.get_local_rank()
    made = []
    real = placement.Placement

    class Counted(real):
        def __init__(self, *args):
            made.append(1)
            super().__init__(*args)
    placement.Placement = Counted
    whole = [x.float() for x in make_inputs(1, 4, 2, 64, 16, seed=5)[:3]]
    bounds = torch.tensor([0, 16, 48, 64])  # int64 on the CPU: converted for the call

    def ring():
        shards = [dr.shard_sequence(x, mesh, cu_seqlens=bounds) for x in whole]
        return dr.ring_attention(*shards, mesh=mesh, schedule="zigzag", is_causal=True,
                                 cu_seqlens=bounds)

    first = ring()
    count = len(made)
    again = ring()
    assert len(made) == count, f"rank {rank}: the placement was derived again for one tensor"
    assert torch.equal(first, again), f"rank {rank}: the second call differs"
    bounds.copy_(torch.tensor([0, 32, 48, 64]))  # in place: other documents
    moved = ring()
    assert len(made) > count, f"rank {rank}: boundaries changed in place were not seen"
    fresh = dr.ring_attention(*[dr.shard_sequence(x, mesh, cu_seqlens=bounds.clone())
                                for x in whole], mesh=mesh, schedule="zigzag", is_causal=True,
                              cu_seqlens=bounds.clone())
    assert torch.equal(moved, fresh), f"rank {rank}: stale documents after an in-place change"
    assert not torch.equal(moved, first), f"rank {rank}: the check cannot tell the documents"


def test_one_boundaries_tensor_is_converted_and_placed_once():
    run_on_ranks(2, _check_boundaries_tensor)
