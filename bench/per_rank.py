"""Per-rank speed on one GPU: one rank of a W-rank ring, communication replaced by ready buffers.

    python bench/per_rank.py --world 4 --tokens-per-gpu 2048,4096,8192 --heads 32 --kv-heads 32,8 \\
        --out per_rank.json --plot per_rank.png       # one H100/H200; ~3.5 min, estimate printed
    python bench/per_rank.py ... --capture --tokens-per-gpu 2048,4096   # + CUDA graphs, ~6 min
    python bench/per_rank.py --plot-only per_rank.json --plot per_rank.png   # table + plot, no GPU
    python bench/per_rank.py --device cpu --world 4 --tokens-per-gpu 16 --heads 4 --kv-heads 4,2 \\
        --head-dim 16 --iters 2 --warmup 1            # CPU smoke run (seconds; tests/)
    python bench/per_rank.py --world 4 --tokens-per-gpu 8192 --kv-heads 8 --window 4096 \\
        --methods ideal,ring_fp32,zigzag_fp32,llama3_fp32   # a sliding window, one GPU

What runs (DESIGN.md, "How we measure"): rank r of a W-rank ring calls the schedule
(``get_schedule(s).forward`` / ``.backward``, as ``ring_attention`` does, and casts the out it
returns) with a ``dtensor_ring.comm.replay.ReplayComm``: each exchange hands back preallocated
buffers of the right shapes at once, no transfer, no copy. So the time is the rank's own work (block
kernels, fp32 merges and accumulations, copies, host work): what a real ring reaches with perfect
overlap. One function, ``schedule_call``, calls the schedule; a new schedule keyword goes there.
Inputs are [B, H, S, D]-contiguous by default; ``--layout bshd`` makes them [B, S, H, D] memory
seen as [B, H, S, D], as a model's projections do (the ideal gets the same).

Ranks: every rank r = 0..W-1 is timed, one after another, and a row reports the max over ranks
(and which rank; every rank's numbers are in the JSON). The causal ``ring`` schedule is unbalanced
(rank W-1 computes a block at every step, rank 0 only its own), and elsewhere which rank is slowest
depends on the kernel and the host (llama3 without a bottom-right mask gives rank 0 a block less per
head group; stripe's blocks differ per rank): timing every rank costs W times the timing but needs
no model of which is slowest. ``--ranks`` takes a subset (e.g. ``--ranks 3`` at large W).

Methods (``--methods``): ``<schedule>_<precision>``, ring / zigzag / stripe / llama3 x fp32 (block
kernel ``--fp32-backend``, cuDNN by default) / exact (the Triton kernel on CUDA, ``cpu_flash_exact``
on CPU); ``ideal``: the single-GPU kernels over the whole global sequence (W x tokens per GPU; K/V
repeated to the q heads for GQA), cuDNN and PyTorch's flash through their aten ops (``cpu_flash``
on CPU), time / W. A row's fraction = the fastest ideal's time / its time (fwd and fwd+bwd
separately).

``--window W``: a sliding window, Hugging Face's ``sliding_window=W`` (a query sees itself and the
W - 1 tokens before it; non-causal, also the W - 1 after it): ``window=(W - 1, 0)`` for every
method, and the ideal is one GPU's windowed flash attention (PyTorch's flash op with
``window_size_left/right``; cuDNN through PyTorch has no window) over the whole sequence / W.

Columns: fwd and fwd+bwd time (CUDA events, median of --iters after --warmup, each run on an idle
GPU: it includes the GPU's waits for the host, the first launch's among them; bench/timing.py),
on CUDA the same in steady state (``steady_*``, columns "st f" / "st fb": runs back to back after a
lead that puts the host ahead, as in a model whose host enqueues the next layers while the GPU
works; a host-bound call stays host-bound; ``timing.steady_times``; median of --iters / 5 groups of
5), host enqueue time (wall time until
the call returns, unsynchronized, median: near the time itself means the GPU waits for Python), the
peak memory the call adds (``max_memory_allocated`` minus what was allocated before, reset per
method and rank; the communicator's buffers, allocated by a first call, are not in it: they are
``comm_buffers_gib``), and with --profile (default, CUDA) from ``torch.profiler`` on the slowest
rank: kernel launches per forward and per backward, and GPU time per kind (attention / merge and
accumulation / copies / other: ``kernel_kinds.py`` lists the name patterns; the top "other" names
are in the JSON). Ideal rows: time / W, host time and memory of the whole call.

--capture (CUDA): after the eager sweep, each method and rank again, forward and forward+backward
captured in a CUDA graph and replayed (``graph_capture.py``): the replay's time (fraction of the
eager ideal), and its outputs against an eager call bit for bit, next to two eager calls against
each other (cuDNN's backward is not deterministic run to run). A method that cannot be captured
records the error and the innermost dtensor_ring file:line. This pass runs the smallest sizes
first (the issue's capture targets are at 2K and 4K tokens per GPU); at the default sizes it adds
~5 min, so with --capture the default --budget-s cuts the largest captures.

Robustness: a failing method (OOM, unsupported) gets its error in the row and the run goes on; the
JSON is rewritten after every row; --budget-s skips what is left after that many seconds (the
table and plot are still written). Configs run largest first, so a cut drops the smallest.

Run time (``estimate_s``, printed before the run): the default run, 6 configs x (2 ideal kernels +
8 methods x 4 ranks), took 3.3-3.4 min on one H100 (the estimate is pessimistic: ~6 min): per rank
and method 1 + (2 + 20) + 20 forwards and as many forward+backwards (the last 20 the steady-state
groups; under 0.7 s at 8K tokens per GPU, host-bound below), a 4-iteration profile per method and
config (~1 s, most of it the profiler's own), ~1 min of Triton compiles and cuDNN plans.
--budget-s (default 480) keeps a slower run inside a 10-minute limit.
"""
import argparse
import datetime
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dtensor_ring as dr  # noqa: E402
from dtensor_ring.comm.replay import ReplayComm  # noqa: E402
from dtensor_ring.kernels import BACKENDS, get_kernel  # noqa: E402
from dtensor_ring.kernels.base import CAUSAL, NONE, repeat_kv  # noqa: E402
from dtensor_ring.layouts import Segments  # noqa: E402
from dtensor_ring.layouts.boundaries import Documents  # noqa: E402
from dtensor_ring.layouts.placement import placement_of  # noqa: E402
from dtensor_ring.layouts.windows import Band, Window, effective_window  # noqa: E402
from graph_capture import failure, graph_measure, recover  # noqa: E402
from kernel_kinds import breakdown  # noqa: E402
from mixes import document_mix, placed_mix  # noqa: E402
from report import describe, versions, write_json  # noqa: E402
from timing import STEADY_GROUP, run_times, steady_median_ms  # noqa: E402

SCHEDULES = ("ring", "zigzag", "stripe", "llama3")
PRECISIONS = ("fp32", "exact")
METHODS = ("ideal", *(f"{s}_{p}" for s in SCHEDULES for p in PRECISIONS))
IDEAL_KERNELS = {"cuda": ("cudnn", "flash"), "cpu": ("cpu_flash",)}
# With packed documents: the kernels with a varlen form (cuDNN's ragged op is no contender:
# 50-70 ms a call on an H100, kernels/cuda.py).
DOCUMENT_IDEAL_KERNELS = {"cuda": ("flash",), "cpu": ("cpu_flash",)}
# With a sliding window: the kernels that take one (cuDNN through PyTorch does not).
WINDOW_IDEAL_KERNELS = {"cuda": ("flash",), "cpu": ("cpu_flash",)}


def ideal_kernels(args, device):
    table = (DOCUMENT_IDEAL_KERNELS if args.documents else
             WINDOW_IDEAL_KERNELS if args.window is not None else IDEAL_KERNELS)
    return table[torch.device(device).type]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LAYOUTS = ("bhsd", "bshd")  # --layout
STEADY_TIMES = ("steady_fwd_ms", "steady_fwd_bwd_ms")  # CUDA: the host ahead (measure)
TIMES = ("fwd_ms", "fwd_bwd_ms", *STEADY_TIMES)  # each gets a fraction of the fastest ideal
MARK = "per_rank."  # record_function prefix of the profiled phases: per_rank.fwd, per_rank.bwd
OUTPUTS = {False: ("out", "lse"), True: ("out", "lse", "dq", "dk", "dv")}  # call(backward) returns


# ---------------------------------------------------------------------------------------------
# Arguments


def _ints(text, minimum=1):
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < minimum:
        raise argparse.ArgumentTypeError(
            f"has {text!r}; expected comma-separated integers >= {minimum}, e.g. 2048,4096")
    return values


def _at_least(minimum):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"has {text!r}; expected an integer >= {minimum}")
        return value
    return parse


_positive = _at_least(1)


def _methods(text):
    if text == "all":
        return list(METHODS)
    names = text.split(",")
    for name in names:
        if name not in METHODS:
            raise argparse.ArgumentTypeError(f"has {name!r}; valid: {list(METHODS)}")
    return list(dict.fromkeys(names))


def _ranks(text):
    return None if text == "all" else sorted(set(_ints(text, minimum=0)))


def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog="Details: the docstring of bench/per_rank.py.")
    p.add_argument("--world", type=_positive, default=4,
                   help="W, ranks in the ring (default %(default)s)")
    p.add_argument("--tokens-per-gpu", type=_ints, default="2048,4096,8192", metavar="LIST",
                   help="comma list of local sequence lengths; the global one is W x each "
                        "(default %(default)s)")
    p.add_argument("--heads", type=_positive, default=32,
                   help="query heads (default %(default)s)")
    p.add_argument("--kv-heads", type=_ints, default="32,8", metavar="LIST",
                   help="comma list of key/value head counts, each dividing --heads (GQA); each "
                        "makes its own configs (default %(default)s)")
    p.add_argument("--head-dim", type=_positive, default=128,
                   help="head dimension d (default %(default)s)")
    p.add_argument("--batch", type=_positive, default=1, help="batch size (default %(default)s)")
    p.add_argument("--no-causal", action="store_true",
                   help="non-causal attention (default: causal)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16",
                   help="dtype of q, k, v (default %(default)s)")
    p.add_argument("--layout", choices=LAYOUTS, default="bhsd",
                   help="memory of q, k, v and dout: bhsd, [B, H, S, D] contiguous; bshd, "
                        "[B, S, H, D] memory seen as [B, H, S, D], as a model's projections "
                        "make them (the ideal gets the same; default %(default)s)")
    p.add_argument("--window", type=_positive, default=None, metavar="W",
                   help="a sliding window of W tokens (Hugging Face's sliding_window: a query "
                        "sees itself and the W - 1 before it); the ideal is windowed flash "
                        "(default: none)")
    p.add_argument("--documents", action="store_true",
                   help="packed documents: each config's row holds a long-tailed mix (lengths "
                        "log-uniform between 32W tokens and half the row, multiples of 32W; "
                        "--seed), attention within each, placed as dr.pad_documents(..., "
                        "world_size=W, length=the row) places it (--placement); the ideal is "
                        "PyTorch's flash varlen kernel over the same row")
    p.add_argument("--placement", choices=("pad", "none"), default="pad",
                   help="with --documents: 'pad', the mix over 63/64 of the row ordered and "
                        "padded by dr.pad_documents(world_size=W) (short documents whole on one "
                        "rank); 'none', the mix over the whole row as it is (every document cut "
                        "across the ranks, as before the placement; default %(default)s)")
    p.add_argument("--methods", type=_methods, default="all", metavar="LIST",
                   help=f"comma list of methods to run, from {','.join(METHODS)}, or 'all' "
                        "(default)")
    p.add_argument("--fp32-backend", choices=("auto", *sorted(BACKENDS)), default="auto",
                   help="block kernel of the fp32 methods; auto: cuDNN on Hopper, with "
                        "--documents the first kernel with a varlen form (default %(default)s)")
    p.add_argument("--ranks", type=_ranks, default="all", metavar="all|LIST",
                   help="ranks to time, 'all' or a comma list; a row reports the max over "
                        "them (default %(default)s)")
    p.add_argument("--iters", type=_positive, default=20,
                   help="timed runs per measurement; the median is reported (default "
                        "%(default)s)")
    p.add_argument("--warmup", type=_at_least(0), default=2,
                   help="untimed runs before them, after one first call per rank and method "
                        "(default %(default)s)")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.profiler on the slowest rank: kernel launches and GPU time by "
                        "kind, per forward and per backward (CUDA only; default on)")
    p.add_argument("--profile-iters", type=_positive, default=3,
                   help="profiled forward+backward runs (default %(default)s)")
    p.add_argument("--capture", action="store_true",
                   help="after the eager sweep, time CUDA-graph replays of each method and "
                        "compare their outputs with eager bit for bit (CUDA only)")
    p.add_argument("--budget-s", type=float, default=480,
                   help="skip what is left after this many seconds; 0: no limit (default "
                        "%(default)s)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the smoke run (host clock, no profile, no capture; default "
                        "%(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the inputs and the replay buffers (default %(default)s)")
    p.add_argument("--out", metavar="JSON", help="write the run here, after every row")
    p.add_argument("--plot", metavar="PNG",
                   help="fraction of the ideal per method and size (needs matplotlib)")
    p.add_argument("--plot-only", metavar="JSON",
                   help="no run: print the table of an earlier run's JSON (and --plot it)")
    return p


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plot_only:
        return args
    args.methods = [m for m in METHODS if m in args.methods]  # the ideal first: fractions need it
    for kv in args.kv_heads:
        if args.heads % kv:
            valid = [d for d in range(1, args.heads + 1) if args.heads % d == 0]
            parser.error(f"argument --kv-heads: {kv} does not divide --heads {args.heads}; "
                         f"valid: {valid}")
    if args.ranks is not None and args.ranks[-1] >= args.world:
        parser.error(f"argument --ranks: {args.ranks[-1]} is not a rank of --world "
                     f"{args.world}; valid: all or 0..{args.world - 1}")
    if args.window is not None and args.documents:
        parser.error("argument --window: not with --documents (no single-GPU kernel takes a "
                     "window with packed documents to give the ideal)")
    if args.capture and args.device != "cuda":
        parser.error("argument --capture: needs --device cuda (CUDA graphs)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("argument --device: cuda, but no CUDA device is visible; "
                     "valid here: cpu (the smoke run)")
    if args.device == "cpu":
        args.profile = False  # the breakdown is of GPU kernels
    return args


# ---------------------------------------------------------------------------------------------
# Configs, inputs and the two calls


@dataclass(frozen=True)
class Config:
    world: int
    tokens: int
    heads: int
    kv_heads: int
    head_dim: int
    batch: int
    causal: bool
    dtype: torch.dtype
    documents: tuple | None = None  # packed documents' boundaries over the global row
    layout: str = "bhsd"  # --layout
    window: int | None = None  # --window: Hugging Face's sliding_window

    def window_arg(self):
        """``window=`` as ``ring_attention`` takes it, normalised as it does (None: none)."""
        if self.window is None:
            return None
        return effective_window(Window(self.window - 1, 0 if self.causal else self.window - 1),
                                self.causal, self.world * self.tokens)

    def label(self):
        label = dict(world=self.world, tokens_per_gpu=self.tokens, seq=self.world * self.tokens,
                     heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
                     batch=self.batch, causal=self.causal)
        if self.window is not None:
            label.update(window=self.window)
        if self.documents is not None:
            lengths = [b - a for a, b in zip(self.documents, self.documents[1:])]
            label.update(documents=len(lengths), longest_document=max(lengths),
                         cu_seqlens=list(self.documents))
        return label


def configs(args):
    mix = placed_mix if args.placement == "pad" else document_mix
    out = [Config(args.world, tokens, args.heads, kv, args.head_dim, args.batch,
                  not args.no_causal, DTYPES[args.dtype],
                  mix(args.world * tokens, args.world, args.seed)
                  if args.documents else None, args.layout, args.window)
           for kv in args.kv_heads for tokens in args.tokens_per_gpu]
    # Largest first (stable: kv heads in the order given): the issue's main targets are at 8K
    # tokens per GPU, and a budget cut drops the smallest, host-bound sizes.
    return sorted(out, key=lambda c: -c.tokens)


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor


def make_inputs(cfg, seq, device, seed, kv_repeat=1):
    """q, k, v, dout of ``seq`` tokens, N(0, 1), [B, H, S, D] in ``cfg.layout``'s memory; k/v
    repeated ``kv_repeat`` times per head (in that layout too)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(heads, repeat=1):
        if cfg.layout == "bhsd":
            return repeat_kv(torch.randn((cfg.batch, heads, seq, cfg.head_dim), generator=gen,
                                         device=device, dtype=cfg.dtype), repeat)
        x = torch.randn((cfg.batch, seq, heads, cfg.head_dim), generator=gen, device=device,
                        dtype=cfg.dtype)
        return x.repeat_interleave(repeat, dim=2).transpose(1, 2)

    q, k, v = randn(cfg.heads), randn(cfg.kv_heads, kv_repeat), randn(cfg.kv_heads, kv_repeat)
    return Inputs(q, k, v, randn(cfg.heads))


def _unmarked(_phase):
    return nullcontext()


class Schedule:
    """A ``<schedule>_<precision>`` method for one config: the schedule, its kernel and options.
    Raises ValueError (kept in the row) where it cannot run: no kernel, a bad local length."""

    kind = "ours"

    def __init__(self, name, cfg, args, device):
        self.name = name
        schedule, self.precision = name.rsplit("_", 1)
        self.schedule = dr.get_schedule(schedule)
        self.schedule.layout.check_local_len(cfg.tokens, "--tokens-per-gpu")
        backend = args.fp32_backend if self.precision == "fp32" else "auto"
        docs = cfg.documents is not None
        window = cfg.window_arg()
        # auto takes a kernel with a document form; a named one without it is the row's error
        self.kernel = get_kernel(backend, torch.device(device), cfg.dtype, cfg.head_dim,
                                 self.precision, docs, window is not None)
        self.options = dict(is_causal=cfg.causal, scale=cfg.head_dim ** -0.5, kernel=self.kernel,
                            window=window)
        self.documents = None if not docs else (
            torch.tensor(cfg.documents, dtype=torch.int32, device=device), _longest(cfg),
            list(cfg.documents))


def _longest(cfg):
    return max(b - a for a, b in zip(cfg.documents, cfg.documents[1:]))


def schedule_call(method, comm, x, backward, mark=_unmarked):
    """One iteration of one rank: ``method``'s schedule forward (and backward) through ``comm``,
    as ``ring_attention`` runs them, eagerly. The one place the schedules are called.

    Returns out (in q's dtype, as ``ring_attention`` returns it), lse, and dq, dk, dv."""
    comm.rewind()
    # Packed documents as ring_attention gets them from ContextParallel: boundaries already on
    # the device, the longest given (no host sync), their values known on the host (ContextParallel
    # read them: the placement's exact form), the same tensor every call (its segments are
    # derived once and reused, as by a model's layers; Documents.of).
    docs = None if method.documents is None else Documents.of(*method.documents)
    with mark("fwd"):
        out, lse = method.schedule.forward(comm, x.q, x.k, x.v, docs=docs, **method.options)
        result = out.to(x.q.dtype)  # exact mode's merged out is fp32 (kept for the backward)
    if not backward:
        return result, lse
    with mark("bwd"):
        grads = method.schedule.backward(comm, x.dout, x.q, x.k, x.v, out, lse, docs=docs,
                                         **method.options)
    return (result, lse, *grads)


class Ideal:
    """One single-GPU kernel over the whole global sequence (its time is divided by W)."""

    kind = "ideal"

    def __init__(self, kernel_name, cfg, device):
        self.name = f"ideal_{kernel_name}"
        docs = cfg.documents is not None
        window = cfg.window_arg()
        self.kernel = get_kernel(kernel_name, torch.device(device), cfg.dtype, cfg.head_dim,
                                 documents=docs, window=window is not None)
        self.mask, self.scale = (CAUSAL if cfg.causal else NONE), cfg.head_dim ** -0.5
        self.segments = self.window = None
        if window is not None:  # the whole sequence as one band block
            self.mask = NONE
            self.window = Band(-window.left if window.left >= 0 else None,
                               0 if cfg.causal else (window.right if window.right >= 0 else None))
        if docs:  # one varlen call over the whole packed row (its segments: the documents)
            cu = torch.tensor(cfg.documents, dtype=torch.int32, device=device)
            self.segments = Segments(cu, cu, _longest(cfg), _longest(cfg))


def ideal_call(method, x, backward, mark=_unmarked):
    with mark("fwd"):
        out, lse = method.kernel.forward(x.q, x.k, x.v, method.mask, method.scale,
                                         method.segments, method.window)
    if not backward:
        return out, lse
    with mark("bwd"):
        grads = method.kernel.backward(x.dout, x.q, x.k, x.v, out, lse, method.mask, method.scale,
                                       method.segments, method.window)
    return (out, lse, *grads)


# ---------------------------------------------------------------------------------------------
# Measuring one call: times, memory, profile


def _cuda(device):
    return torch.device(device).type == "cuda"


def clean(device, collect=False):
    """The previous measurement's memory back to the GPU. ``collect``: a garbage collection first
    (after an error: its traceback held tensors in a cycle); otherwise reference counting has
    freed everything already, and a collection costs 0.1-0.4 s in this process."""
    if collect:
        gc.collect()
    if _cuda(device):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def measure(call, args, device):
    """Median times and host times of ``call(False)`` (fwd) and ``call(True)`` (fwd+bwd), and the
    peak memory they add. One untimed first call before (compiles, plans, comm buffers)."""
    clean(device)
    call(True)
    cuda = _cuda(device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    fwd, host_fwd = run_times(lambda: call(False), args.warmup, args.iters, device)
    fb, host_fb = run_times(lambda: call(True), args.warmup, args.iters, device)
    med = statistics.median
    m = dict(fwd_ms=med(fwd), fwd_bwd_ms=med(fb), host_fwd_ms=med(host_fwd),
             host_fwd_bwd_ms=med(host_fb),
             mem_gib=(torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None)
    if cuda:
        for backward, key in ((False, "fwd"), (True, "fwd_bwd")):
            lead = 2 * m[f"host_{key}_ms"] + 0.5  # the host's first call, with room
            m[f"steady_{key}_ms"] = steady_median_ms(lambda: call(backward), args.iters, lead)
    return m


def profile(call, args):
    """Kernel launches and GPU time by kind per forward and per backward (``kernel_kinds``)."""
    from torch.profiler import ProfilerActivity, record_function  # noqa: PLC0415
    from torch.profiler import profile as torch_profile  # noqa: PLC0415

    def mark(phase):
        return record_function(MARK + phase)

    call(True)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.profile_iters):
            call(True, mark)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    return breakdown(events, args.profile_iters, MARK)


# ---------------------------------------------------------------------------------------------
# Rows


def _ranks_of(args, cfg):
    return list(range(cfg.world)) if args.ranks is None else args.ranks


def _schedule_caller(method, x, cfg, rank, seed):
    comm = ReplayComm(rank, cfg.world, seed=seed)

    def call(backward, mark=_unmarked):
        return schedule_call(method, comm, x, backward, mark)
    return call, comm


def _worst(per_rank, key):
    best = max(per_rank, key=lambda r: r[key])
    return best[key], best["rank"]


def run_ideal(kernel_name, cfg, x, args, device):
    row = {"method": f"ideal_{kernel_name}", "kind": "ideal", "error": None}
    try:
        method = Ideal(kernel_name, cfg, device)
        row["kernel"] = method.kernel.name

        def call(backward, mark=_unmarked):
            return ideal_call(method, x, backward, mark)
        m = measure(call, args, device)
        row.update({key: m[key] / cfg.world for key in TIMES if key in m},
                   host_fwd_ms=m["host_fwd_ms"], host_fwd_bwd_ms=m["host_fwd_bwd_ms"],
                   mem_gib=m["mem_gib"])
        if args.profile:
            row["profile"] = _profiled(call, args)
    except Exception as exc:  # noqa: BLE001 - kept in the row
        row["error"] = describe(exc)
    if row["error"] is not None:
        clean(device, collect=True)
    return row


def run_schedule(name, cfg, x, args, device):
    row = {"method": name, "kind": "ours", "error": None}
    try:
        method = Schedule(name, cfg, args, device)
    except Exception as exc:  # noqa: BLE001
        row["error"] = describe(exc)
        return row
    row["kernel"] = method.kernel.name
    per_rank = []
    for rank in _ranks_of(args, cfg):
        call, comm = _schedule_caller(method, x, cfg, rank, args.seed)
        try:
            m = measure(call, args, device)
        except Exception as exc:  # noqa: BLE001
            row["error"], m = f"rank {rank}: {describe(exc)}", None
        if m is None:
            del call, comm
            clean(device, collect=True)  # outside the except block: the traceback is gone
            break
        per_rank.append(dict(rank=rank, **m, comm_buffers_gib=comm.buffer_bytes() / 2**30))
        del call, comm
    row["per_rank"] = per_rank
    if row["error"] is not None:
        return row
    for key in TIMES:  # the steady-state times only on CUDA
        if all(key in r for r in per_rank):
            row[key], row[key.removesuffix("_ms") + "_rank"] = _worst(per_rank, key)
    for key in ("host_fwd_ms", "host_fwd_bwd_ms", "mem_gib", "comm_buffers_gib"):
        values = [r[key] for r in per_rank if r[key] is not None]
        row[key] = max(values) if values else None
    if args.profile:
        call, _ = _schedule_caller(method, x, cfg, row["fwd_bwd_rank"], args.seed)
        row["profile"] = dict(rank=row["fwd_bwd_rank"], **_profiled(call, args))
    if cfg.documents is not None:
        row.update(_exchanged(method, x, cfg, args.seed))
    return row


def _exchanged(method, x, cfg, seed):
    """The bytes rank 0 hands the exchanges per forward and per forward+backward
    (``ReplayComm.sent_bytes``), and as a fraction of the same call's without documents (every
    row exchanged, as every document cut into 2W chunks needs); which documents are cut."""
    sent = {}
    for documents in (method.documents, None):
        method.documents, kept = documents, method.documents
        for backward, key in ((False, "fwd"), (True, "fwd_bwd")):
            call, comm = _schedule_caller(method, x, cfg, 0, seed)
            call(backward)
            sent[key, documents is None] = comm.sent_bytes
        method.documents = kept
    placed = placement_of(Documents(*method.documents), cfg.world, cfg.tokens)
    return {"bytes_fwd": sent["fwd", False], "bytes_fwd_bwd": sent["fwd_bwd", False],
            "bytes_fraction": sent["fwd_bwd", False] / max(1, sent["fwd_bwd", True]),
            "documents_cut": placed.cut.count(True), "documents_whole": placed.cut.count(False)}


def _profiled(call, args):
    try:
        return profile(call, args)
    except Exception as exc:  # noqa: BLE001 - the times still count
        return {"error": describe(exc)}


def add_fractions(rows):
    """The fastest ideal (fwd and fwd+bwd separately) and each row's fraction of it."""
    ideals = [r for r in rows if r["kind"] == "ideal" and r.get("fwd_ms") is not None]
    if not ideals:
        return
    for key in TIMES:
        timed = [r for r in ideals if r.get(key) is not None]
        if not timed:
            continue
        best = min(timed, key=lambda r: r[key])
        frac = "frac_" + key.removesuffix("_ms")
        for row in rows:
            row[f"ideal_{key}"], row[f"ideal_{key}_from"] = best[key], best["method"]
            if row.get(key):
                row[frac] = best[key] / row[key]


def graph_row(row, cfg, x, args, device):
    """--capture for one eager row: per rank (schedules) or once (ideal), then the worst."""
    if row["kind"] == "ideal":
        method = Ideal(row["method"].removeprefix("ideal_"), cfg, device)
        per_rank = [dict(rank=None, **graph_measure(
            lambda backward, mark=_unmarked: ideal_call(method, x, backward, mark), args,
            OUTPUTS))]
        scale = cfg.world
    else:
        method, per_rank, scale = Schedule(row["method"], cfg, args, device), [], 1
        if method.documents is not None:
            # A capture derives the placement from the device boundaries alone (Documents.of
            # drops the host values): its eager warm-up and eager reference take the same form.
            method.documents = method.documents[:2]
        for rank in _ranks_of(args, cfg):
            call, _ = _schedule_caller(method, x, cfg, rank, args.seed)
            clean(device)
            per_rank.append(dict(rank=rank, **graph_measure(call, args, OUTPUTS)))
        clean(device)
    graph = {"per_rank": per_rank}
    for key, frac in (("fwd", "frac_fwd"), ("fwd_bwd", "frac_fwd_bwd")):
        done = [r[key] for r in per_rank if "ms" in r[key]]
        failed = [dict(rank=r["rank"], **r[key]) for r in per_rank if "error" in r[key]]
        if failed:
            graph[f"{key}_error"] = failed[0]
        if done and not failed:
            graph[f"{key}_ms"] = max(d["ms"] for d in done) / scale
            graph[f"host_{key}_ms"] = max(d["host_ms"] for d in done)
            graph[frac] = row[f"ideal_{key}_ms"] / graph[f"{key}_ms"] if row.get(
                f"ideal_{key}_ms") else None
            graph[f"{key}_replay_vs_eager"] = _sum_counts(d["replay_vs_eager"] for d in done)
            graph[f"{key}_eager_vs_eager"] = _sum_counts(d["eager_vs_eager"] for d in done)
    return graph


def _sum_counts(dicts):
    total = {}
    for d in dicts:
        for name, count in d.items():
            total[name] = total.get(name, 0) + count
    return total


# ---------------------------------------------------------------------------------------------
# Run-time model: the estimate printed before the run, and the time left printed after each row.
# Rough, from the issue-20 profile on an H100 at W = 4: cuDNN's causal forward at ~600 TFLOP/s,
# fwd+bwd ~3.5x the forward, flash ~1.7x cuDNN; a rank's GPU time ~1.15x its ideal share (exact
# ~1.7x); its host time per forward ~0.35 ms per ring step, ~2.5 ms per llama3 head group (exact
# 1.3x), per fwd+bwd 3.5x that; per rank ~0.1 s of set-up, per profile ~1 s, per config and
# method ~0.5 s of first calls (cuDNN plans); ~15 s to start and ~45 s of Triton compiles.


STARTUP_S, COMPILE_S = 15.0, 45.0


def _model_ms(cfg, name):
    """(fwd, fwd+bwd) ms of one run of ``name`` on one rank (ideal: both kernels, whole seq)."""
    seq = cfg.world * cfg.tokens
    reach = seq if cfg.window is None else min(seq, cfg.window * (1 if cfg.causal else 2))
    flops = 4 * cfg.batch * cfg.heads * seq * reach * cfg.head_dim * (
        0.5 if cfg.causal and reach == seq else 1)
    share = flops / 600e12 * 1e3 / cfg.world
    if name == "ideal":
        return share * cfg.world * 2.7, share * cfg.world * 2.7 * 3.5
    schedule, precision = name.rsplit("_", 1)
    gpu = share * (1.7 if precision == "exact" else 1.15)
    host = 2.5 * min(cfg.kv_heads, cfg.world) if schedule == "llama3" else 0.35 * cfg.world
    host *= 1.3 if precision == "exact" else 1.0
    return max(gpu, host) + 0.1, max(3.5 * gpu, 3.5 * host) + 0.1


def estimate_s(args, cfg, name, capture=False):
    fwd, fb = _model_ms(cfg, name)
    ranks = 1 if name == "ideal" else len(_ranks_of(args, cfg))
    runs = args.warmup + args.iters
    if capture:  # per rank 2 captures (each with torch.cuda.graph's own gc.collect)
        return ranks * (0.8 + (4 + 2 * args.warmup + args.iters) * (fwd + fb) / 1e3)
    steady = max(1, args.iters // STEADY_GROUP) * STEADY_GROUP  # measure's steady-state runs
    seconds = 0.5 + ranks * (0.1 + (1 + runs + steady) * (fwd + fb) / 1e3 + fb / 1e3)
    if args.profile:
        seconds += 1.0 + (1 + args.profile_iters) * fb / 1e3
    return seconds


def estimate_total_s(args):
    if not _cuda(args.device):
        return None
    fixed = STARTUP_S + (COMPILE_S if any(m.endswith("_exact") for m in args.methods) else 0)
    return fixed + sum(estimate_s(args, cfg, name) + (estimate_s(args, cfg, name, True)
                                                      if args.capture else 0)
                       for cfg in configs(args) for name in args.methods)


class Clock:
    """Elapsed time, the budget, and the model's time left scaled by how fast the run goes."""

    def __init__(self, args):
        self.args, self.start = args, time.monotonic()
        self.total = estimate_total_s(args)
        self.done, self._started, self._compiled = 0.0, False, False

    def compile_s(self, name):
        """The model's start-up and Triton compile time, counted with the first row (and first
        exact row) that pays them."""
        if not self.total:
            return 0.0
        extra = 0.0 if self._started else STARTUP_S
        self._started = True
        if name.endswith("_exact") and not self._compiled:
            self._compiled = True
            extra += COMPILE_S
        return extra

    def elapsed(self):
        return time.monotonic() - self.start

    def over_budget(self):
        return self.args.budget_s > 0 and self.elapsed() > self.args.budget_s

    def advance(self, model_s):
        self.done += model_s

    def status(self):
        if not self.total:
            return f"{self.elapsed():6.1f}s"
        left = max(0.0, self.total - self.done) * self.elapsed() / max(self.done, 1.0)
        return f"{self.elapsed():6.1f}s, ~{left:4.0f}s left"


# ---------------------------------------------------------------------------------------------
# The sweep


def meta(args, argv):
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python bench/per_rank.py " + shlex.join(argv),
            "device": args.device, "world": args.world,
            "heads": args.heads, "head_dim": args.head_dim, "batch": args.batch,
            "dtype": args.dtype, "causal": not args.no_causal, "iters": args.iters,
            "warmup": args.warmup, "fp32_backend": args.fp32_backend, "layout": args.layout,
            "window": args.window,
            "ranks": args.ranks or "all", "profile_iters": args.profile_iters if args.profile
            else None, "capture": args.capture, "budget_s": args.budget_s,
            "host": {"cpu": cpu_name(),
                     "cpu_count": os.cpu_count(), "python": platform.python_version()}}
    info.update(versions(args.device))  # git_commit among them
    if _cuda(args.device):
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(gpu_memory_gib=props.total_memory / 2**30, gpu_sms=props.multi_processor_count,
                    gpu_capability=f"{props.major}.{props.minor}")
    return info


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def sweep(args, info, clock):
    rows, device = [], args.device

    def add(cfg, cfg_rows, row):
        row = {**cfg.label(), **row}
        cfg_rows.append(row)
        rows.append(row)
        add_fractions(cfg_rows)
        print(f"[{clock.status()}] {fmt_row(row)}", flush=True)
        if args.out:
            write_json(args.out, info, rows)

    for cfg in configs(args):
        cfg_rows, x = [], None
        for name in args.methods:
            kernels = ideal_kernels(args, device) if name == "ideal" else (None,)
            if clock.over_budget():
                for kernel in kernels:
                    add(cfg, cfg_rows, {"method": f"ideal_{kernel}" if kernel else name,
                                        "kind": "ideal" if kernel else "ours",
                                        "error": f"skipped: past --budget-s {args.budget_s:g}"})
                continue
            if name == "ideal":
                try:  # K/V repeated for GQA, except for the varlen kernels, which take it
                    whole = make_inputs(cfg, cfg.world * cfg.tokens, device, args.seed,
                                        1 if args.documents else cfg.heads // cfg.kv_heads)
                except Exception as exc:  # noqa: BLE001
                    whole, error = None, describe(exc)
                for kernel in kernels:
                    row = (run_ideal(kernel, cfg, whole, args, device) if whole is not None
                           else {"method": f"ideal_{kernel}", "kind": "ideal", "error": error})
                    clock.advance((estimate_s(args, cfg, name) + clock.compile_s(name))
                                  / len(kernels))
                    add(cfg, cfg_rows, row)
                del whole
                clean(device)
            else:
                if x is None:
                    x = make_inputs(cfg, cfg.tokens, device, args.seed + 1)
                row = run_schedule(name, cfg, x, args, device)
                clock.advance(estimate_s(args, cfg, name) + clock.compile_s(name))
                add(cfg, cfg_rows, row)
        del x
        clean(device, collect=True)
    return rows


def capture_pass(args, info, rows, clock):
    """--capture: each eager row's method again, captured in a CUDA graph (``graph_row``);
    smallest sizes first."""
    device = args.device
    for cfg in reversed(configs(args)):
        mine = [r for r in rows if all(r.get(k) == v for k, v in cfg.label().items())]
        x = x_whole = None
        for row in mine:
            name = "ideal" if row["kind"] == "ideal" else row["method"]
            model = estimate_s(args, cfg, name, capture=True) / (2 if name == "ideal" else 1)
            clock.advance(model)
            if row.get("error"):
                continue
            if clock.over_budget():
                row["graph"] = {"error": f"skipped: past --budget-s {args.budget_s:g}"}
                continue
            try:
                if row["kind"] == "ideal":
                    if x_whole is None:
                        x_whole = make_inputs(cfg, cfg.world * cfg.tokens, device, args.seed,
                                              cfg.heads // cfg.kv_heads)
                    row["graph"] = graph_row(row, cfg, x_whole, args, device)
                else:
                    x_whole = None
                    if x is None:
                        x = make_inputs(cfg, cfg.tokens, device, args.seed + 1)
                    row["graph"] = graph_row(row, cfg, x, args, device)
            except Exception as exc:  # noqa: BLE001
                row["graph"] = failure(exc)
            if "error" in row["graph"]:
                recover()
            print(f"[{clock.status()}] graph {fmt_graph(row)}", flush=True)
            if args.out:
                write_json(args.out, info, rows)
        del x, x_whole
        clean(device, collect=True)


# ---------------------------------------------------------------------------------------------
# Printing


def _f(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) else "-"


KIND_COLUMNS = (("attention", "attn"), ("merge/accumulation", "merge"), ("copies", "copy"),
                ("other", "other"))
HEADER = (f"{'tok/GPU':>7} {'kv':>3} {'method':15} {'fwd ms':>8} {'frac':>5} {'fwd+bwd':>8} "
          f"{'frac':>5} {'st f':>5} {'st fb':>5} {'host f':>7} {'host fb':>7} {'GiB':>5} "
          f"{'launch f/b':>10}  {'fwd+bwd GPU ms: attn/merge/copy/other':38} rank")


def _kinds(profile):
    if not profile or "error" in profile:
        return (profile or {}).get("error", "-")[:38]
    phases = [profile[p] for p in ("fwd", "bwd") if p in profile]
    return "/".join(f"{sum(p['kinds'][kind] for p in phases):.2f}" for kind, _ in KIND_COLUMNS)


def fmt_row(r):
    head = f"{r['tokens_per_gpu']:>7} {r['kv_heads']:>3} {r['method']:15}"
    if r.get("error"):
        return f"{head} ERROR {r['error']}"
    prof = r.get("profile") or {}
    launches = (f"{_f(prof.get('fwd', {}).get('launches'), '.0f')}/"
                f"{_f(prof.get('bwd', {}).get('launches'), '.0f')}")
    rank = "" if r["kind"] == "ideal" else f"{r.get('fwd_rank')}/{r.get('fwd_bwd_rank')}"
    return (f"{head} {_f(r.get('fwd_ms'), '8.3f')} {_f(r.get('frac_fwd'), '5.2f')} "
            f"{_f(r.get('fwd_bwd_ms'), '8.3f')} {_f(r.get('frac_fwd_bwd'), '5.2f')} "
            f"{_f(r.get('frac_steady_fwd'), '5.2f')} {_f(r.get('frac_steady_fwd_bwd'), '5.2f')} "
            f"{_f(r.get('host_fwd_ms'), '7.2f')} {_f(r.get('host_fwd_bwd_ms'), '7.2f')} "
            f"{_f(r.get('mem_gib'), '5.2f')} {launches:>10}  {_kinds(r.get('profile')):38} {rank}")


def fmt_graph(r):
    head = f"{r['tokens_per_gpu']:>7} {r['kv_heads']:>3} {r['method']:15}"
    g = r.get("graph") or {}
    if "error" in g:
        return f"{head} ERROR {g['error']} at {g.get('at')}"
    parts = []
    for key in ("fwd", "fwd_bwd"):
        if f"{key}_error" in g:
            e = g[f"{key}_error"]
            parts.append(f"{key}: ERROR {e.get('cause', e['error'])} at "
                         f"{e.get('cause_at', e.get('at'))}")
            continue
        if f"{key}_ms" not in g:
            continue
        replay, eager = g[f"{key}_replay_vs_eager"], g[f"{key}_eager_vs_eager"]
        same = ("= eager bit for bit" if not any(replay.values()) else
                "differs from eager: " + ", ".join(f"{n} {c}" for n, c in replay.items() if c)
                + " elements (eager vs eager: "
                + (", ".join(f"{n} {c}" for n, c in eager.items() if c) or "none") + ")")
        parts.append(f"{key} {g[f'{key}_ms']:.3f} ms frac {_f(g.get('frac_' + key), '.2f')} "
                     f"host {g[f'host_{key}_ms']:.2f} ms, replay {same}")
    return f"{head} " + "; ".join(parts)


def print_table(info, rows):
    window = f", window {info['window']}" if info.get("window") else ""
    print(f"\nW={info['world']} {info['heads']} q heads, d={info['head_dim']}, batch "
          f"{info['batch']}, {'causal' if info['causal'] else 'non-causal'}{window} "
          f"{info['dtype']}, "
          f"{info.get('gpu', info['device'])}; torch {info['torch']}, cuDNN {info.get('cudnn')}, "
          f"Triton {info.get('triton')}; {info.get('git_commit')}")
    print("times: median over --iters, max over ranks (rank of the max fwd/fwd+bwd at the end); "
          "frac = fastest single-GPU ideal over the whole sequence / W, divided by the time; "
          "st f / st fb = the same fractions in steady state (runs back to back, the host ahead); "
          "host = enqueue time; GiB = peak added; launches and kinds from the profile of the "
          "slowest rank, per iteration")
    print(HEADER)
    for r in rows:
        print(fmt_row(r))
    if any("bytes_fwd_bwd" in r for r in rows):
        print("\nPacked documents: bytes rank 0 hands the exchanges per fwd / fwd+bwd, and the "
              "fraction of what every row would take (every document cut: before the placement)")
        for r in rows:
            if "bytes_fwd_bwd" in r:
                print(f"{r['tokens_per_gpu']:>7} {r['kv_heads']:>3} {r['method']:15} "
                      f"{r['bytes_fwd'] / 2**20:9.1f} / {r['bytes_fwd_bwd'] / 2**20:9.1f} MiB "
                      f"{r['bytes_fraction']:5.2f}  documents cut {r['documents_cut']}, whole "
                      f"{r['documents_whole']}")
    if any("graph" in r for r in rows):
        print("\nCUDA graphs (--capture): replay time, max over ranks")
        for r in rows:
            if "graph" in r:
                print(fmt_graph(r))


def plot(info, rows, path):
    from per_rank_plot import plot as draw  # noqa: PLC0415
    try:
        made = draw({"meta": info, "rows": rows}, path)
    except Exception as exc:  # noqa: BLE001 - the numbers matter more than the picture
        print(f"plot failed: {describe(exc)}")
        return
    print(f"plot: {path}" if made else "plot skipped: matplotlib is not installed "
          "(pip install matplotlib; then --plot-only JSON --plot PNG)")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.plot_only:
        with open(args.plot_only) as f:
            data = json.load(f)
        print_table(data["meta"], data["rows"])
        if args.plot:
            plot(data["meta"], data["rows"], args.plot)
        return data
    info = meta(args, argv)
    clock = Clock(args)
    info["estimate_s"] = clock.total
    n_cfg = len(configs(args))
    print(f"{len(args.methods)} methods x {n_cfg} configs, ranks "
          f"{args.ranks or f'0..{args.world - 1}'} of W={args.world}, {args.iters} runs after "
          f"{args.warmup} warm-up; estimated "
          + (f"~{clock.total / 60:.1f} min" if clock.total else "- (no model for CPU)")
          + (f", budget {args.budget_s:g} s" if args.budget_s > 0 else ""), flush=True)
    with torch.no_grad():
        rows = sweep(args, info, clock)
        if args.capture:
            capture_pass(args, info, rows, clock)
    info["elapsed_s"] = round(clock.elapsed(), 1)
    print_table(info, rows)
    print(f"\nelapsed {info['elapsed_s']:.0f} s"
          + (f" (estimated {clock.total:.0f} s)" if clock.total else ""))
    if args.out:
        write_json(args.out, info, rows)
        print(f"JSON: {args.out}")
    if args.plot:
        plot(info, rows, args.plot)
    return {"meta": info, "rows": rows}


if __name__ == "__main__":
    main()
