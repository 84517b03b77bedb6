"""Timing on CUDA shared by the benchmarks: CUDA events, warm-up, median, worst rank."""
import statistics
import time

import torch
import torch.distributed as dist


def median_ms(fn, warmup, iters):
    """Median time of ``fn()`` in ms over ``iters`` runs after ``warmup``, the max over ranks."""
    return max_over_ranks(local_median_ms(fn, warmup, iters))


def max_over_ranks(ms: float) -> float:
    """The largest of every rank's ``ms`` (CUDA: an all-reduce on the current device)."""
    worst = torch.tensor(ms, device="cuda")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def local_median_ms(fn, warmup, iters, device="cuda"):
    """Median time of ``fn()`` in ms over ``iters`` runs after ``warmup`` on this rank only (no
    collective, so a caller can agree on failures first); CUDA events, or a host clock on CPU."""
    return statistics.median(run_times(fn, warmup, iters, device)[0])


def run_times(fn, warmup, iters, device="cuda"):
    """(times, host times) in ms of each of ``iters`` runs of ``fn()`` after ``warmup`` runs.

    On CUDA a run is timed by CUDA events recorded before and after it, with a synchronization
    before and after each run, so a run starts on an idle GPU and its time
    includes any wait of the GPU for the host; its host time is the wall time until ``fn()``
    returns, before that synchronization: how long the host takes to enqueue the run. On CPU
    both are the host clock's time of the run.

    With a process group, every rank starts each run together (``aligned``): a run that
    exchanges with other ranks is then timed from a common start. Without it, a rank whose GPU
    finished the previous run first starts the next one first and waits for its peers' first
    messages, so its time would hold the skew the previous run left (up to ~1 ms on 4 H200s for
    a windowed ring call of 2 ms: docs/results.md).
    """
    for _ in range(warmup):
        fn()
    cuda = torch.device(device).type == "cuda"
    times, host = [], []
    for _ in range(iters):
        aligned()  # the warm-up's (and the last run's) work done, on every rank
        if not cuda:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
            host.append(times[-1])
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        began = time.perf_counter()
        fn()
        host.append((time.perf_counter() - began) * 1e3)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times, host


def aligned():
    """Every rank of the default process group here at once, with its GPU idle (a barrier, then a
    synchronization); nothing without a process group."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


STEADY_GROUP = 5  # runs back to back per steady-state timing (steady_median_ms)


def steady_median_ms(fn, iters, lead_ms):
    """Median of ``steady_times`` in ms over about ``iters`` runs: ``iters // STEADY_GROUP``
    groups (at least one) of ``STEADY_GROUP``, each after a head start of ``lead_ms``."""
    return statistics.median(steady_times(fn, max(1, iters // STEADY_GROUP), STEADY_GROUP,
                                          lead_ms))


def steady_times(fn, groups, per_group, lead_ms):
    """Times in ms per run of ``fn()`` in steady state, as in a model whose host enqueues the
    next layers while the GPU works: ``groups`` times, ``per_group`` runs back to back between
    two CUDA events, the total / ``per_group``. Before each group the GPU is held busy for
    ``lead_ms`` (``torch.cuda._sleep``), so the host is that far ahead when the first run starts
    and the idle GPU's wait for the first launch (which ``run_times`` includes, and which a model
    pays once per step, not per layer) is not in the time. A run whose host time exceeds its GPU
    time is still host-bound here: after the lead, the GPU waits for the host as it would in the
    model. CUDA only. Warm ``fn`` up first (``run_times`` does)."""
    cycles = _sleep_cycles(lead_ms)
    times = []
    for _ in range(groups):
        aligned()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        for _ in range(per_group):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / per_group)
    return times


_CYCLES_PER_MS = {}


def _sleep_cycles(ms):
    """``torch.cuda._sleep``'s argument (GPU clock cycles) for about ``ms`` milliseconds,
    calibrated once per device."""
    device = torch.cuda.current_device()
    if device not in _CYCLES_PER_MS:
        probe = 10_000_000
        torch.cuda._sleep(probe)  # the first call's launch is slow
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        torch.cuda.synchronize()
        _CYCLES_PER_MS[device] = probe / start.elapsed_time(end)
    return int(ms * _CYCLES_PER_MS[device])
