"""``ReplayComm`` (dtensor_ring/comm/replay.py): one rank of a ring, its communication replaced by
ready buffers. The buffers have the shapes and dtypes a peer would send, hold N(0, 1) values, and
are allocated once: a second iteration after ``rewind()`` reuses every one and, since no schedule
reads a buffer after writing into it, gives the same results bit for bit."""

import pytest
import torch

import dtensor_ring as dr
from dtensor_ring.comm.replay import ReplayComm
from dtensor_ring.kernels import get_kernel


def test_operations_hand_back_buffers_of_the_peers_shapes():
    comm = ReplayComm(1, 3)
    k = torch.zeros(2, 4, 8, 16, dtype=torch.bfloat16)
    dk = torch.zeros(2, 4, 8, 16)
    got_k, got_dk = comm.send_recv_next([k, dk]).wait()
    gathered = comm.all_gather(k).wait()
    reduced = comm.reduce_scatter(torch.zeros(3, 5, 7)).wait()
    assert (got_k.shape, got_k.dtype) == (k.shape, torch.bfloat16)
    assert (got_dk.shape, got_dk.dtype) == (dk.shape, torch.float32)
    assert (gathered.shape, gathered.dtype) == ((3, 2, 4, 8, 16), torch.bfloat16)
    assert (reduced.shape, reduced.dtype) == ((5, 7), torch.float32)
    for x in (got_k, got_dk, gathered, reduced):  # realistic values, not zeros
        assert 0.8 < x.float().std().item() < 1.2 and x.float().mean().abs().item() < 0.2
    ptrs = {x.data_ptr() for x in (got_k, got_dk, gathered, reduced)}
    assert len(ptrs) == 4 and k.data_ptr() not in ptrs  # no buffer shared, nothing sent returned


def test_one_rank_has_nothing_to_exchange():
    k = torch.randn(1, 2, 4, 8)
    got = ReplayComm(0, 1).send_recv_next([k]).wait()
    assert got[0] is k  # as ProcessGroupComm and SimComm at W = 1


def test_buffers_are_reused_after_rewind_and_differ_per_operation_and_rank():
    comm, k = ReplayComm(0, 4), torch.zeros(1, 2, 4, 8)
    first = [comm.send_recv_next([k]).wait()[0] for _ in range(3)]
    comm.rewind()
    second = [comm.send_recv_next([k]).wait()[0] for _ in range(3)]
    assert [x.data_ptr() for x in first] == [x.data_ptr() for x in second]
    assert not torch.equal(first[0], first[1])
    assert not torch.equal(first[0], ReplayComm(1, 4).send_recv_next([k]).wait()[0])
    assert torch.equal(first[0], ReplayComm(0, 4).send_recv_next([k]).wait()[0])  # seeded


def test_a_missing_rewind_is_an_error_not_a_leak():
    comm, k = ReplayComm(0, 2, max_ops=3), torch.zeros(2, 2)
    for _ in range(3):
        comm.send_recv_next([k])
    with pytest.raises(RuntimeError, match=r"3 operations since the last rewind\(\)"):
        comm.send_recv_next([k])


@pytest.mark.parametrize("rank, world", [(2, 2), (-1, 2), (0, 0)])
def test_bad_rank_or_world_size(rank, world):
    with pytest.raises(ValueError, match=f"rank={rank}, world_size={world}"):
        ReplayComm(rank, world)


def test_rank_must_be_an_int():
    with pytest.raises(TypeError, match="rank must be an int; got 1.0"):
        ReplayComm(1.0, 2)


@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("precision", ["fp32", "exact"])
@pytest.mark.parametrize("schedule", ["ring", "zigzag", "stripe", "llama3"])
def test_every_schedule_runs_one_rank_and_repeats_bit_for_bit(schedule, precision, world):
    b, hq, hkv, s, d = 1, 4, 2, 8, 16
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(b, hq, s, d, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, hkv, s, d, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    kernel = get_kernel("auto", q.device, q.dtype, d, precision)
    options = dict(is_causal=True, scale=d ** -0.5, kernel=kernel)
    sched = dr.get_schedule(schedule)
    comm = ReplayComm(world - 1, world)  # the last rank: the most work in the causal ring

    def iteration():
        comm.rewind()
        out, lse = sched.forward(comm, q, k, v, **options)
        return (out, lse, *sched.backward(comm, dout, q, k, v, out, lse, **options))

    first = [x.clone() for x in iteration()]
    buffers = dict(comm._buffers)
    second = iteration()
    assert comm._buffers.keys() == buffers.keys()  # nothing new allocated
    assert all(comm._buffers[key] is buffers[key] for key in buffers)
    for name, a, b_, like in zip(("out", "lse", "dq", "dk", "dv"), first, second,
                                 (q, q[..., 0], q, k, v)):
        assert a.shape == like.shape, name
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b_), f"{name} changed between iterations"
    ops = {"ring": 3 * (world - 1), "zigzag": 3 * (world - 1), "stripe": 3 * (world - 1),
           "llama3": 3 * min(hkv, world)}[schedule]
    assert len({key[0] for key in comm._buffers}) == ops
