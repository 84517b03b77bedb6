"""bench/timing.py: on CUDA, steady-state timing times a GPU-bound call at its GPU time (without
the idle GPU's wait for the first launch that a synchronised run includes) and a host-bound call
at its host time; on ranks (gloo here), each run starts on every rank at once. Known durations
come from ``torch.cuda._sleep`` (GPU) and ``time.sleep`` (host)."""
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from dist_utils import run_on_ranks  # noqa: E402
from timing import _sleep_cycles, run_times, steady_times  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _call(gpu_ms, host_ms):
    cycles = _sleep_cycles(gpu_ms)

    def call():
        time.sleep(host_ms / 1e3)  # the host's work before its launch
        torch.cuda._sleep(cycles)
    return call


@needs_cuda
def test_a_gpu_bound_call_is_timed_at_its_gpu_time():
    call = _call(gpu_ms=2.0, host_ms=0.5)
    synced = min(run_times(call, 2, 5)[0])
    steady = min(steady_times(call, 3, 5, lead_ms=2.0))
    assert 1.9 < steady < 2.2, steady
    assert synced > steady + 0.4, (synced, steady)  # the wait for the first launch


@needs_cuda
def test_a_host_bound_call_is_timed_at_its_host_time():
    call = _call(gpu_ms=0.5, host_ms=3.0)
    steady = min(steady_times(call, 3, 5, lead_ms=1.0))
    # 5 runs of 3 ms host time each, the first overlapping the 1 ms lead: >= (15 - 1) / 5
    assert steady > 2.7, steady


LATE_MS = 60  # rank 1's work after each exchange, before its next run starts


def _late_rank_run(mesh):
    import torch.distributed as dist

    def call():  # an exchange, then (rank 1 only) work that delays its next run
        dist.all_reduce(torch.ones(1))
        if dist.get_rank() == 1:
            time.sleep(LATE_MS / 1e3)
    times = run_times(call, 1, 5, "cpu")[0]
    if dist.get_rank() == 0:
        # Started with rank 1, rank 0's exchange meets it at once; unaligned, rank 0 would start
        # each run while rank 1 still works on the last one, and wait LATE_MS in the exchange.
        assert max(times) < LATE_MS / 2, times
    else:
        assert min(times) >= LATE_MS, times  # its own work is timed: the check can see it


def test_every_rank_starts_each_run_together():
    run_on_ranks(2, _late_rank_run)
