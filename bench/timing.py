"""Timing on CUDA shared by the benchmarks: CUDA events, warm-up, median, worst rank."""
import statistics
import time

import torch
import torch.distributed as dist


def median_ms(fn, warmup, iters):
    """Median time of ``fn()`` in ms over ``iters`` runs after ``warmup``, the max over ranks."""
    worst = torch.tensor(local_median_ms(fn, warmup, iters), device="cuda")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def local_median_ms(fn, warmup, iters, device="cuda"):
    """Median time of ``fn()`` in ms over ``iters`` runs after ``warmup`` on this rank only (no
    collective, so a caller can agree on failures first); CUDA events, or a host clock on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cpu":
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
