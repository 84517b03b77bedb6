"""Timing on CUDA shared by the benchmarks: CUDA events, warm-up, median, worst rank."""
import statistics

import torch
import torch.distributed as dist


def median_ms(fn, warmup, iters):
    """Median time of ``fn()`` in ms over ``iters`` runs after ``warmup``, the max over ranks."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    worst = torch.tensor(statistics.median(times), device="cuda")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()
