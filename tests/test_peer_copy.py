"""Exchanges on the copy engines (``dtensor_ring/comm/peer_copy.py``; two or more GPUs of one
host, skipped otherwise).

On W = min(GPUs, 4) NCCL ranks, every schedule (ring, zigzag, stripe shift K/V and dK/dV to the
next rank; llama3 all-gathers K/V and reduce-scatters dK/dV) in fp32 and exact, eagerly, and
zigzag and llama3 compiled, run once through the copy engines (the default) and once through
NCCL (``DTENSOR_RING_PEER_COPY=0``, on a second process group): both must match float64 within
the usual tolerance of the single-GPU kernel's error, and the forward's output must be the same
bits either way. A second, longer sequence grows the arenas. The check is shown to fail on a
wrong answer: the result unsharded in the wrong layout.

The collectives alone (all-gather, all-to-all, reduce-scatter), interleaved with ring shifts and
the sliding window's direct exchanges (``send_recv``: either side possibly empty), and growing,
match NCCL's on random data (the reduce-scatter to fp32 rounding: NCCL sums in its own
order), eagerly and replayed from a CUDA graph. A capture whose messages the arenas cannot hold
takes NCCL for them, and replays right after the arenas grew.
"""
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import dtensor_ring as dr
from dtensor_ring.comm import peer_copy
from dtensor_ring.tools.numerics import attention_and_grads, check_ratios, make_inputs, ratios, sdpa
from dist_utils import run_on_gpus

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs several GPUs")

RUNS = [(s, p, False) for s in ("ring", "zigzag", "stripe", "llama3") for p in ("fp32", "exact")]
RUNS += [("zigzag", "fp32", True), ("llama3", "fp32", True)]


def results(mesh, schedule, precision, compiled, bf16, window=None):
    """out, dq, dk, dv of causal ring attention of ``bf16`` (q, k, v, dout) sharded over
    ``mesh`` (also tests/test_windows_gpu.py)."""
    def ring(a, b, c):
        return dr.ring_attention(a, b, c, mesh=mesh, schedule=schedule, is_causal=True,
                                 precision=precision, window=window)
    fn = torch.compile(ring, fullgraph=True) if compiled else ring
    layout = dr.SCHEDULE_LAYOUT[schedule]
    shards = [dr.shard_sequence(x, mesh, dim=2, layout=layout) for x in bf16]
    return [x.contiguous() for x in attention_and_grads(fn, *shards, torch.bfloat16)]


def check_whole(got, mesh, schedule, single, reference, where):
    """``got`` (``results``) unsharded, within TOLERANCE of the single GPU's error against
    float64; unsharded in the wrong layout, it fails the same check."""
    layout = dr.SCHEDULE_LAYOUT[schedule]
    whole = [dr.unshard_sequence(x, mesh, dim=2, layout=layout) for x in got]
    check_ratios(ratios(whole, single, reference), torch.bfloat16, where)
    if layout != "contiguous":  # a wrong answer fails the same check
        wrong = [dr.unshard_sequence(x, mesh, dim=2, layout="contiguous") for x in got]
        with pytest.raises(AssertionError):
            check_ratios(ratios(wrong, single, reference), torch.bfloat16, where)


def _ranks(rank, world):
    copies = DeviceMesh.from_group(dist.group.WORLD, "cuda")
    nccl = DeviceMesh.from_group(dist.new_group(list(range(world))), "cuda")
    for tokens in (1024, 2048):  # the second grows the arena
        q, k, v, dout = (x.cuda() for x in make_inputs(1, 8, 4, tokens * world, 128))
        bf16 = [x.bfloat16() for x in (q, k, v, dout)]
        reference = attention_and_grads(sdpa(True), q, k, v, dout, torch.float64)
        single = attention_and_grads(sdpa(True), q, k, v, dout, torch.bfloat16)
        for schedule, precision, compiled in RUNS:
            where = f"rank {rank}: {tokens} tokens, {schedule} {precision} compiled={compiled}"
            got = results(copies, schedule, precision, compiled, bf16)
            os.environ[peer_copy.ENV] = "0"  # read when a group first shifts
            try:
                sent_by_nccl = results(nccl, schedule, precision, compiled, bf16)
            finally:
                del os.environ[peer_copy.ENV]
            # The forward kernels are deterministic; cuDNN's backward need not be, so the
            # gradients are held to the reference below, not to NCCL's bits.
            assert torch.equal(got[0], sent_by_nccl[0]), f"{where}: out differs from NCCL's"
            check_whole(got, copies, schedule, single, reference, where)
        ring = peer_copy._RINGS[dist.group.WORLD.group_name]
        assert ring is not None, f"rank {rank}: the copy engines were not used"
        assert peer_copy._RINGS[nccl.get_group().group_name] is None
        # the largest messages: exact's fp32 dK and dV of a rank's rows; llama3's fp32 dK/dV of
        # a head group (min(4 kv heads, W) groups) for every rank's rows
        assert ring.arena.buffer.numel() >= 2 * 4 * tokens * 128 * 4, f"rank {rank}"
        group_heads = -(-4 // min(4, world))
        assert ring.slots.buffer.numel() >= world * tokens * 2 * group_heads * 128 * 4, f"rank {rank}"


def test_copy_engine_shift_matches_nccl_and_float64():
    world = min(torch.cuda.device_count(), 4)
    run_on_gpus(world, _ranks)


def _collectives(comm, rank, world, rows, seed):
    """(all-gather, all-to-all, reduce-scatter) of seeded random data through ``comm``, with a
    ring shift between each (the shifts use the other arena), and the sliding window's direct
    exchanges (a third arena): to rank + 1, K/V-like rows (bf16) and strided fp32 ones, rank r
    sending rows // (r + 1) of each and the last rank none (rank 0 receives none); then every
    row to rank - 1."""
    generator = torch.Generator(device="cuda").manual_seed(seed * 100 + rank)
    kv = torch.randn(rows, 2, 3, 128, generator=generator, device="cuda").bfloat16()
    rows_by_rank = torch.randn(world, rows, 5, generator=generator, device="cuda").bfloat16()
    grads = torch.randn(world, rows, 2, 3, 128, generator=generator, device="cuda")
    window_kv = torch.randn(1, 2, rows, 128, generator=generator, device="cuda").bfloat16()
    window_grads = torch.randn(1, 3, rows, 64, generator=generator, device="cuda")

    def ahead(r):  # what rank r sends to rank r + 1: the first n rows of each, the last's none
        n = 0 if r == world - 1 else rows // (r + 1)
        return [window_kv[:, :, :n], window_grads[:, :, rows - n:]]

    def shapes(r):
        return [(t.shape[0], t.shape[1], 0 if r == world - 1 else rows // (r + 1), t.shape[3])
                for t in (window_kv, window_grads)]
    shifted = comm.send_recv_next([kv])
    forward = comm.send_recv(1, ahead(rank), shapes((rank - 1) % world), rows)
    gathered = comm.all_gather(kv)
    shifted_again = comm.send_recv_next([kv + 1])
    swapped = comm.all_to_all(rows_by_rank)
    back = comm.send_recv(-1, [window_kv, window_grads],
                          [window_kv.shape, window_grads.shape], rows)
    summed = comm.reduce_scatter(grads)
    return [gathered.wait(), swapped.wait(), summed.wait(), *shifted.wait(), *shifted_again.wait(),
            *forward.wait(), *back.wait()]


def _check_collectives(got, want, where):
    for name, a, b in zip(("all_gather", "all_to_all"), got[:2], want[:2]):
        assert torch.equal(a, b), f"{where}: {name} differs from NCCL's"
    torch.testing.assert_close(got[2], want[2], rtol=1e-6, atol=1e-5,
                               msg=lambda m: f"{where}: reduce_scatter: {m}")
    assert torch.equal(got[3], want[3]) and torch.equal(got[4], want[4]), f"{where}: shifts"
    for a, b in zip(got[5:], want[5:], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: send_recv differs from NCCL's"


def _collective_ranks(rank, world):
    from dtensor_ring.comm.process_group import ProcessGroupComm
    copies = ProcessGroupComm(dist.group.WORLD)
    os.environ[peer_copy.ENV] = "0"
    try:
        nccl = ProcessGroupComm(dist.new_group(list(range(world))))
        for rows in (64, 4096):  # the second grows the arenas
            _collectives(nccl, rank, world, rows, 0)
    finally:
        del os.environ[peer_copy.ENV]
    for rows in (64, 4096, 1000):
        for seed in range(3):
            where = f"rank {rank}: {rows} rows, seed {seed}"
            got = _collectives(copies, rank, world, rows, seed)
            want = _collectives(nccl, rank, world, rows, seed)
            _check_collectives(got, want, where)
            with pytest.raises(AssertionError):  # a wrong answer fails the same check
                _check_collectives([got[0].roll(1, 0), *got[1:]], want, where)
    assert peer_copy._RINGS[dist.group.WORLD.group_name] is not None, f"rank {rank}"
    # Replayed from a CUDA graph: the flags come back as they were after each exchange.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        inputs = [torch.zeros(4096, 2, 3, 128, device="cuda").bfloat16(),
                  torch.zeros(world, 4096, 2, 3, 128, device="cuda")]
        comm_ops = lambda: (copies.all_gather(inputs[0]).wait(),  # noqa: E731
                            copies.reduce_scatter(inputs[1]).wait())
        comm_ops()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            outputs = comm_ops()
    for replay in range(3):
        inputs[0].fill_(rank + 10 * replay)
        inputs[1].copy_(torch.arange(world, device="cuda").view(world, 1, 1, 1, 1) + replay)
        graph.replay()
        torch.cuda.synchronize()
        where = f"rank {rank}: replay {replay}"
        expected = torch.arange(world, device="cuda").float() + 10 * replay
        assert torch.equal(outputs[0].float().flatten(1).amax(1), expected), where
        assert torch.equal(outputs[0].float().flatten(1).amin(1), expected), where
        assert torch.all(outputs[1] == world * (rank + replay)), where
        eager = copies.all_gather(inputs[0]).wait()  # eager exchanges between replays
        assert torch.equal(eager, outputs[0]), where


def test_copy_engine_collectives_match_nccl():
    world = min(torch.cuda.device_count(), 4)
    run_on_gpus(world, _collective_ranks)


def _capture_ranks(rank, world):
    """A capture whose messages outgrow the arenas eager calls sized (packed documents' traced
    form sends every row where the eager exact form sent the long part's): those go through
    NCCL, the others still through the copy engines; then an eager call grows the arenas, and
    the graph, which holds views of the outgrown ones, still replays right."""
    from dtensor_ring.comm.process_group import ProcessGroupComm
    comm = ProcessGroupComm(dist.new_group(list(range(world))))  # a new group: new arenas
    small = torch.zeros(64, 2, 3, 128, device="cuda").bfloat16()
    big = torch.zeros(4096, 2, 3, 128, device="cuda").bfloat16()
    ring = peer_copy.peer_copy_ring(comm.group)
    assert ring is not None, f"rank {rank}"
    exchanges = lambda: (comm.send_recv_next([small]).wait()[0],  # noqa: E731
                         comm.send_recv_next([big]).wait()[0], comm.all_gather(big).wait())
    comm.send_recv_next([small]).wait()
    comm.all_gather(small).wait()  # eager: the arenas hold the small messages only
    assert not ring.holds([big]) and not ring.holds([big], collective=True), f"rank {rank}"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph):
            outputs = exchanges()
    comm.send_recv_next([big]).wait()  # eager: grows the ring's arena past the graph's views
    torch.cuda.synchronize()
    assert ring.holds([big]), f"rank {rank}"
    for replay in range(3):
        small.fill_(rank + 10 * replay)
        big.fill_(rank + 100 * replay)
        graph.replay()
        torch.cuda.synchronize()
        where = f"rank {rank}: replay {replay}"
        before = (rank - 1) % world
        assert torch.all(outputs[0] == before + 10 * replay), where
        assert torch.all(outputs[1] == before + 100 * replay), where
        gathered = outputs[2].float().flatten(1)
        expected = torch.arange(world, device="cuda").float() + 100 * replay
        assert torch.equal(gathered.amax(1), expected) and torch.equal(gathered.amin(1),
                                                                       expected), where


def test_a_capture_beyond_the_arenas_takes_nccl_and_outgrown_arenas_stay():
    world = min(torch.cuda.device_count(), 4)
    run_on_gpus(world, _capture_ranks)
