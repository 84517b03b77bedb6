"""bench/timing.py's steady-state timing on CUDA: a GPU-bound call is timed at its GPU time
(without the idle GPU's wait for the first launch that a synchronised run includes) and a
host-bound call at its host time. Known durations come from ``torch.cuda._sleep`` (GPU) and
``time.sleep`` (host)."""
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from timing import _sleep_cycles, run_times, steady_times  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _call(gpu_ms, host_ms):
    cycles = _sleep_cycles(gpu_ms)

    def call():
        time.sleep(host_ms / 1e3)  # the host's work before its launch
        torch.cuda._sleep(cycles)
    return call


def test_a_gpu_bound_call_is_timed_at_its_gpu_time():
    call = _call(gpu_ms=2.0, host_ms=0.5)
    synced = min(run_times(call, 2, 5)[0])
    steady = min(steady_times(call, 3, 5, lead_ms=2.0))
    assert 1.9 < steady < 2.2, steady
    assert synced > steady + 0.4, (synced, steady)  # the wait for the first launch


def test_a_host_bound_call_is_timed_at_its_host_time():
    call = _call(gpu_ms=0.5, host_ms=3.0)
    steady = min(steady_times(call, 3, 5, lead_ms=1.0))
    # 5 runs of 3 ms host time each, the first overlapping the 1 ms lead: >= (15 - 1) / 5
    assert steady > 2.7, steady
