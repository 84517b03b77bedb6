"""A call captured in a CUDA graph and replayed (bench/per_rank.py --capture): its time, and its
outputs against eager bit for bit; a failure kept as data, with where it happened.

``graph_one(fn, names, args)``: two eager calls of ``fn`` (their outputs kept), warm-up on a side
stream (as ``torch.cuda.graph``'s documentation asks: lazy initialisations such as Triton's module
loading and cuDNN's plans happen outside the capture), capture with ``torch.cuda.graph`` (default
global capture mode: any CUDA call that is illegal during capture, from any thread, fails it), one
replay compared bit for bit with the first eager call, the second eager call compared the same way
(a kernel that is not deterministic run to run, such as cuDNN's backward, differs there too), then
the replay timed like an eager call (bench/timing.py).

``failure(exc)``: the error, its first cause (an error inside the capture is usually followed by
another when the capture ends) and the innermost dtensor_ring frame (file:line) of each.
"""
import gc
import math
import os
import statistics
import traceback

import torch

from report import describe
from timing import run_times


def where(exc):
    """file:line (function) of the innermost frame of ``exc``'s traceback in dtensor_ring, else
    in this script, else the innermost."""
    frames = traceback.extract_tb(exc.__traceback__)
    for part in ("/dtensor_ring/", "/bench/"):
        ours = [f for f in frames if part in f.filename.replace(os.sep, "/")]
        if ours:
            f = ours[-1]
            path = f.filename.replace(os.sep, "/")
            return f"{path[path.rindex(part) + 1:]}:{f.lineno} ({f.name})"
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else None


def failure(exc):
    """An exception as the row keeps it: message and where, and its first cause's (an error
    inside graph capture is often followed by another from ending the capture)."""
    root = exc
    while (root.__cause__ or root.__context__) is not None:
        root = root.__cause__ or root.__context__
    info = {"error": describe(exc), "at": where(exc)}
    if root is not exc:
        info.update(cause=describe(root), cause_at=where(root))
    return info


def _bits(t):
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
    return t.contiguous().view(ints[t.element_size()])


def differences(results, reference, names):
    """{name: elements that differ bit-wise}, and the largest absolute difference of any (None
    if not finite)."""
    counts, largest = {}, 0.0
    for name, a, b in zip(names, results, reference):
        counts[name] = int((_bits(a) != _bits(b)).sum())
        if counts[name]:
            diff = (a.double() - b.double()).abs().max().item()
            largest = max(largest, diff if math.isfinite(diff) else math.inf)
    return counts, (largest if math.isfinite(largest) else None)


def recover():
    """After a failed capture: back on the default stream, the pool of the graph released."""
    if not torch.cuda.is_available():
        return
    torch.cuda.set_stream(torch.cuda.default_stream())
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - a sticky error shows in the next rows' errors
        pass
    gc.collect()
    torch.cuda.empty_cache()


def graph_one(fn, names, args):
    """``fn()`` captured in a CUDA graph and replayed: time, host time, and the replay's outputs
    against an eager call's, next to a second eager call's."""
    eager = [t.clone() for t in fn()]
    again = [t.clone() for t in fn()]
    side = torch.cuda.Stream()  # warm-up on a side stream, as torch.cuda.graph's docs ask
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(1, args.warmup)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()
    graph.replay()
    torch.cuda.synchronize()
    replay_diff, replay_max = differences(static, eager, names)
    eager_diff, eager_max = differences(again, eager, names)
    times, host = run_times(graph.replay, args.warmup, args.iters, "cuda")
    del graph, static
    return dict(ms=statistics.median(times), host_ms=statistics.median(host),
                replay_vs_eager=replay_diff, replay_max_abs=replay_max,
                eager_vs_eager=eager_diff, eager_max_abs=eager_max)


def graph_measure(call, args, outputs):
    """``graph_one`` of ``call(False)`` (forward) and ``call(True)`` (forward+backward), whose
    outputs ``outputs[backward]`` names; errors kept, never raised."""
    out = {}
    for backward, key in ((False, "fwd"), (True, "fwd_bwd")):
        try:
            out[key] = graph_one(lambda: call(backward), outputs[backward], args)
        except Exception as exc:  # noqa: BLE001 - what breaks capture is the finding
            out[key] = failure(exc)
        if "error" in out[key]:
            recover()  # outside the except block: the traceback's tensors are free
    return out
