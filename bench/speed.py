"""Side-by-side speed of attention over a sequence split across W GPUs, on the same inputs.

    torchrun --nproc-per-node=2 bench/speed.py --tokens-per-gpu 2048,4096,8192,16384,32768 \\
        --heads 32 --kv-heads 32,8 --out speed.json --plot speed.png
    python bench/speed_plot.py speed.json --out speed.png                # table and plot again
    torchrun --nproc-per-node=2 bench/speed.py --device cpu --tokens-per-gpu 64 --heads 4 \\
        --kv-heads 4,2 --head-dim 16 --iters 2 --warmup 1 --out smoke.json   # gloo smoke run

Methods, per config (tokens per GPU x kv heads; d = 128, causal bf16 unless told otherwise):

* ``ideal_cudnn``, ``ideal_flash``: one GPU's SDPA kernel over the whole global sequence, time / W
  (every rank times it on its own GPU; the max over ranks). The cuDNN one is *the* ideal: every
  row's fraction is ideal_cudnn / its time.
* ``torch_cp_allgather``, ``torch_cp_alltoall``: PyTorch's ``context_parallel`` with
  ``set_rotate_method(...)``, SDPA under cuDNN. It shards with its own load balancer (a position
  buffer tells which global tokens each rank holds); only the attention call is timed.
* ``<schedule>_<precision>``: ``dr.ring_attention`` for ring / zigzag / stripe / llama3 in precision
  fp32 (cuDNN block kernels by default) and exact (the Triton kernel); ``..._compiled`` the same
  under ``torch.compile``, ``..._captured`` captured in CUDA graphs with NCCL inside and replayed
  (``Ours``).
* ``<O>x<I>_<schedule>_<precision>`` (with ``--mesh OxI``): the same on a 2-D mesh of O ring ranks x
  I all-to-all ranks (``dtensor_ring/hybrid/``: the schedule over the ring ranks on head groups
  gathered by an all-to-all), e.g. ``--mesh 2x2`` on 4 GPUs, in the same run as the 1-D rows:

      torchrun --nproc-per-node=4 bench/speed.py --tokens-per-gpu 8192 --heads 32 --kv-heads 8 \\
          --mesh 2x2 --methods ideal,zigzag_fp32,2x2_zigzag_fp32,2x2_llama3_fp32 --out hybrid.json


Columns: forward and forward+backward time (CUDA events, --warmup, median of --iters, max over
ranks; each run starts on an idle GPU, on every rank at once (``timing.aligned``), so its time
holds the GPU's wait for the host to reach the first kernel), fraction of the ideal, on CUDA the
same fractions in steady state (``st f`` / ``st fb``: runs back to back with the host ahead, as
a model's layers run; ``steady_ms``), the
memory the call adds on top of its inputs at its peak (``max_memory_allocated`` - allocated before, reset per method, max over ranks; for the ideal rows
on one GPU over the whole sequence), and the rel-RMS error of out/dq/dk/dv against a float64
reference of the whole attention, as a ratio to single-GPU cuDNN's own rel-RMS (1.00 = splitting
added no error), for global lengths up to --accuracy-max-seq (the reference is O(S^2) per head).

Robustness: a method that raises (OOM, unsupported) gets an error string in its row and the run goes
on; each rank's failure flag is all-reduced so every rank takes the same branch. The JSON is
rewritten after every row, so a run stopped by a time limit keeps what it measured; --budget-s
skips what is left once that many seconds have passed (the ranks agree on it).

--window W: a sliding window, Hugging Face's ``sliding_window=W`` (a query sees itself and the
W - 1 tokens before it; non-causal, also the W - 1 after it), for the reference and every method:
``window=(W - 1, 0)`` for ours; the ideal is one GPU's windowed flash (PyTorch's flash op with
window sizes; cuDNN through PyTorch and PyTorch's context_parallel take no window: their rows say
so). Each of our rows also gets ``sent_mib``: the bytes this rank's exchanges sent in one forward
and backward (``dtensor_ring.comm.TRAFFIC``; the max over ranks), to hold against the full ring's.

--documents: packed documents. Each config's row holds bench/per_rank.py's long-tailed mix
(``mixes.placed_mix``: many short documents, a few long ones, over 63/64 of the row) ordered and
padded as ``dr.pad_documents(..., world_size=W)`` places it (short documents whole on one rank,
long ones cut), attention within each document, for the reference and every method. The ideal is
one GPU's flash varlen kernel over the whole row / W (cuDNN through PyTorch and PyTorch's
context_parallel take no documents: their rows say so); ``sent_mib`` shows what the placement
leaves off the wire, against the same call without documents.

--nccl-high-priority: NCCL's streams at high priority (a user setting passed to
init_process_group), to see whether the exchanges then start before the compute they overlap.

--profile FILE: first, a torch.profiler summary of forward+backward for each of --profile-methods
(``<schedule>_<precision>``, default zigzag_fp32; --profile-tokens per GPU, --heads q heads and
--profile-kv-heads kv heads): the top kernels by GPU time, per-category totals and how much NCCL
time no compute kernel overlaps, per rank and method (FILE with ``_<method>_r<rank>`` before the
suffix, and the chrome trace beside it).
"""
import argparse
import datetime
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention import SDPBackend, sdpa_kernel

import dtensor_ring as dr
from dtensor_ring.comm import TRAFFIC
from dtensor_ring.kernels.base import CAUSAL, NONE
from dtensor_ring.layouts.windows import Band
from dtensor_ring.layouts import Segments
from dtensor_ring.tools.numerics import NAMES, errors, fwd_bwd
from mixes import placed_mix
from report import describe, versions, write_json
from speed_plot import fmt_row, plot, print_table
from timing import local_median_ms, max_over_ranks, steady_median_ms

# The real SDPA, taken before anything can patch it: PyTorch's context_parallel replaces
# F.scaled_dot_product_attention while it is active (and on torch 2.11 does not put it back if its
# generator is closed instead of run to the end), so the single-GPU rows call this one.
SDPA = F.scaled_dot_product_attention
SCHEDULES = ("ring", "zigzag", "stripe", "llama3")
PRECISIONS = ("fp32", "exact")
ROTATIONS = ("allgather", "alltoall")


def ints(text):
    return [int(x) for x in text.split(",") if x]


def mesh_shape(text):
    """``--mesh``: ``OxI`` (ring ranks x all-to-all ranks) -> (O, I)."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not OxI (ring ranks x all-to-all ranks, "
                                         "e.g. 2x2)")
    return int(parts[0]), int(parts[1])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens-per-gpu", type=ints, default=[2048, 4096, 8192, 16384, 32768])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=ints, default=[32, 8])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--no-causal", action="store_true", help="non-causal attention for every config")
    p.add_argument("--window", type=int, default=None, metavar="W",
                   help="a sliding window of W tokens (Hugging Face's sliding_window)")
    p.add_argument("--also-non-causal", type=ints, default=[], metavar="TOKENS",
                   help="after the causal sweep, non-causal configs at these tokens per GPU "
                        "(first --kv-heads value)")
    p.add_argument("--non-causal-methods", default="ideal,torch_cp,ring_",
                   help="method-name prefixes run in the --also-non-causal configs")
    p.add_argument("--methods", default="",
                   help="comma list of method-name prefixes to run; a name ending in '$' runs "
                        "only itself (zigzag_fp32$: eager, not _compiled; default: all)")
    p.add_argument("--mesh", type=mesh_shape, metavar="OxI",
                   help="also run every schedule on a 2-D mesh of O ring x I all-to-all ranks "
                        "(rows <O>x<I>_<schedule>_<precision>; O * I = the number of GPUs)")
    p.add_argument("--documents", action="store_true",
                   help="packed documents (bench/mixes.py's mix, placed as dr.pad_documents does)")
    p.add_argument("--fp32-backend", default="auto", help="block kernel of the fp32 rows")
    p.add_argument("--triton-tiles", metavar="JSON",
                   help="exact rows with the tiles bench/triton_tune.py chose (its --out JSON)")
    p.add_argument("--torch-cp-kernel", default="cudnn", choices=("cudnn", "flash"))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--accuracy-max-seq", type=int, default=16384,
                   help="accuracy column only for global sequence lengths up to this")
    p.add_argument("--budget-s", type=float, default=0, help="skip what is left after this (0: no)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="JSON results (rewritten after every row)")
    p.add_argument("--plot", help="PNG: fraction of the ideal vs tokens per GPU")
    p.add_argument("--profile", metavar="FILE", help="profile --profile-methods' fwd+bwd first")
    p.add_argument("--profile-methods", type=profile_methods, default="zigzag_fp32",
                   help="comma-separated <schedule>_<precision> names to profile")
    p.add_argument("--profile-tokens", type=int, default=8192)
    p.add_argument("--profile-kv-heads", type=int, help="kv heads to profile (default: --heads)")
    p.add_argument("--profile-iters", type=int, default=5)
    p.add_argument("--nccl-high-priority", action="store_true",
                   help="NCCL's internal streams at high priority (a user setting: "
                        "ProcessGroupNCCL.Options(is_high_priority_stream=True))")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Inputs and the float64 reference


def make_inputs(cfg, device, seed, need64):
    """Whole-sequence q, k, v, dout in bf16 (and float64 when the accuracy column needs it), the
    same on every rank (one seed)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    b, s, d = cfg["batch"], cfg["seq"], cfg["head_dim"]
    shapes = [(b, cfg["heads"], s, d), (b, cfg["kv_heads"], s, d), (b, cfg["kv_heads"], s, d),
              (b, cfg["heads"], s, d)]
    if need64:
        x64 = [torch.randn(sh, generator=gen, device=device, dtype=torch.float64) for sh in shapes]
        return [x.bfloat16() for x in x64], x64
    return [torch.randn(sh, generator=gen, device=device, dtype=torch.float32).bfloat16()
            for sh in shapes], None


def reference(q, k, v, dout, causal, scale, window=None, max_bytes=8 << 30, cu_seqlens=None):
    """out, dq, dk, dv of the whole attention in the inputs' dtype (float64), a few q heads at a
    time so the S x S matrices stay under ``max_bytes``; GQA through the kv head of each q head.
    ``window``: Hugging Face's sliding_window (--window). ``cu_seqlens``: packed documents'
    boundaries (--documents), each document attended alone."""
    if cu_seqlens is not None:
        parts = [reference(*(x[:, :, a:b] for x in (q, k, v, dout)), causal, scale, window,
                           max_bytes) for a, b in zip(cu_seqlens, cu_seqlens[1:])]
        return [torch.cat(xs, dim=2) for xs in zip(*parts)]
    b, hq, s, _ = q.shape
    groups = hq // k.shape[1]
    out, dq = torch.empty_like(q), torch.empty_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    step = max(1, min(hq, max_bytes // (3 * b * s * s * q.element_size())))
    keep = torch.ones(s, s, dtype=torch.bool, device=q.device)
    if causal:
        keep = keep.tril()
    if window is not None:
        keep = keep.tril(window - 1).triu(1 - window)
    for h0 in range(0, hq, step):
        heads = slice(h0, min(hq, h0 + step))
        kv_index = torch.arange(heads.start, heads.stop, device=q.device) // groups
        qh, doh, kh, vh = q[:, heads], dout[:, heads], k[:, kv_index], v[:, kv_index]
        p = qh @ kh.transpose(-1, -2) * scale
        if causal or window is not None:
            p.masked_fill_(~keep, float("-inf"))
        p = p.softmax(-1)
        oh = p @ vh
        dvh = p.transpose(-1, -2) @ doh
        ds = doh @ vh.transpose(-1, -2)
        ds.sub_((doh * oh).sum(-1, keepdim=True)).mul_(p)
        del p
        out[:, heads], dq[:, heads] = oh, ds @ kh * scale
        dk.index_add_(1, kv_index, ds.transpose(-1, -2) @ qh * scale)
        dv.index_add_(1, kv_index, dvh)
        del ds
    return out, dq, dk, dv


# ---------------------------------------------------------------------------------------------
# The methods: each yields (forward(), forward_backward(), whole_results()) for one config


class Ctx:
    """What every method needs for one config: the mesh, the whole inputs, shards by layout."""

    def __init__(self, args, cfg, mesh, inputs):
        self.args, self.cfg, self.mesh, self.inputs = args, cfg, mesh, inputs
        self.world, self.rank = mesh.size(), mesh.get_local_rank()
        self.causal, self.gqa = cfg["causal"], cfg["heads"] != cfg["kv_heads"]
        size = args.window
        self.window = None if size is None else (size - 1, 0 if self.causal else size - 1)
        bounds = cfg.get("cu_seqlens")
        self.cu_seqlens = (None if bounds is None else
                           torch.tensor(bounds, dtype=torch.int32, device=inputs[0].device))
        self.max_seqlen = None if bounds is None else max(b - a for a, b in zip(bounds, bounds[1:]))
        self._shards = {}

    def shards(self, layout, mesh=None):
        """This rank's shards in ``layout`` on ``mesh`` (default: the 1-D mesh of all ranks)."""
        mesh = mesh or self.mesh
        key = (layout, tuple(mesh.shape))
        if key not in self._shards:
            self._shards[key] = [dr.shard_sequence(x, mesh, layout=layout,
                                                   cu_seqlens=self.cu_seqlens)
                                 for x in self.inputs]
        return self._shards[key]


class Ideal:
    kind = "ideal"

    def __init__(self, name, backend):
        self.name, self.backend = name, backend

    def run(self, ctx):
        q, k, v, dout = ctx.inputs

        def single(a, b, c):
            if ctx.window is not None or ctx.cu_seqlens is not None:
                return _block_kernel(self.backend, a, b, c, ctx)
            with sdpa_kernel(self.backend) if self.backend is not None else _nullcontext():
                return SDPA(a, b, c, is_causal=ctx.causal, enable_gqa=ctx.gqa)

        def forward():
            with torch.no_grad():
                single(q, k, v)

        def forward_backward():
            return fwd_bwd(single, q, k, v, dout)

        yield forward, forward_backward, forward_backward  # the whole sequence already


# The block kernels that take a window or packed documents (cuDNN through PyTorch takes neither).
_BLOCK_KERNELS = {SDPBackend.FLASH_ATTENTION: "flash", None: "cpu_flash"}


def _block_kernel(backend, q, k, v, ctx):
    """--window's and --documents' ideal, which SDPA cannot give: the block kernel over the whole
    sequence, with the window as one band or the documents as its varlen segments, with
    autograd."""
    if backend not in _BLOCK_KERNELS:
        what = "sliding window (--window)" if ctx.window is not None else "documents (--documents)"
        raise ValueError(f"{backend}: no {what} through PyTorch")
    kernel = dr.BACKENDS[_BLOCK_KERNELS[backend]]
    mask, band, segments = NONE, None, None
    if ctx.window is not None:
        band = Band(-ctx.window[0], 0 if ctx.causal else ctx.window[1])
    if ctx.cu_seqlens is not None:
        mask = CAUSAL if ctx.causal else NONE
        segments = Segments(ctx.cu_seqlens, ctx.cu_seqlens, ctx.max_seqlen, ctx.max_seqlen)
    return _KernelAttention.apply(q, k, v, kernel, mask, band, segments, q.shape[-1] ** -0.5)


class _KernelAttention(torch.autograd.Function):
    @staticmethod
    def forward(autograd_ctx, q, k, v, kernel, mask, band, segments, scale):
        out, lse = kernel.forward(q, k, v, mask, scale, segments, band)
        autograd_ctx.save_for_backward(q, k, v, out, lse)
        autograd_ctx.call = kernel, mask, band, segments, scale
        return out

    @staticmethod
    def backward(autograd_ctx, dout):
        q, k, v, out, lse = autograd_ctx.saved_tensors
        kernel, mask, band, segments, scale = autograd_ctx.call
        return (*kernel.backward(dout, q, k, v, out, lse, mask, scale, segments, band),
                None, None, None, None, None)


class Ours:
    """``dr.ring_attention`` on the 1-D mesh of all ranks, or on a 2-D ``mesh`` (the hybrid):
    eagerly (``<schedule>_<precision>``), compiled (``..._compiled``:
    ``torch.compile(fullgraph=True)``, the compile pass's expansion) or captured
    (``..._captured``, CUDA only: forward and forward+backward each captured once in a CUDA
    graph, NCCL inside, after warm-up on a side stream, then replayed)."""

    kind = "ours"

    def __init__(self, schedule, precision, mode="eager", mesh=None):
        self.schedule, self.precision, self.mode, self.mesh = schedule, precision, mode, mesh
        prefix = "" if mesh is None else "{}x{}_".format(*mesh.shape)
        self.name = f"{prefix}{schedule}_{precision}" + ("" if mode == "eager" else f"_{mode}")

    def run(self, ctx):
        layout = dr.SCHEDULE_LAYOUT[self.schedule]
        mesh = self.mesh or ctx.mesh
        shards = ctx.shards(layout, mesh)
        backend = ctx.args.fp32_backend if self.precision == "fp32" else "auto"

        def ring(a, b, c):
            return dr.ring_attention(a, b, c, mesh=mesh, schedule=self.schedule,
                                     is_causal=ctx.causal, precision=self.precision,
                                     backend=backend, window=ctx.window,
                                     cu_seqlens=ctx.cu_seqlens, max_seqlen=ctx.max_seqlen)

        def forward_of(fn):
            def forward():
                with torch.no_grad():
                    return fn(*shards[:3])
            return forward

        fn = torch.compile(ring, fullgraph=True) if self.mode == "compiled" else ring
        forward, forward_backward = forward_of(fn), lambda: fwd_bwd(fn, *shards)
        if self.mode == "captured":
            forward, forward_backward = (_captured(call) for call in (forward, forward_backward))

        def whole():
            return [dr.unshard_sequence(x.contiguous(), mesh, layout=layout,
                                        cu_seqlens=ctx.cu_seqlens)
                    for x in forward_backward()]

        yield forward, forward_backward, whole


def _captured(call):
    """``call`` captured in a CUDA graph: a function that replays it and returns its outputs."""
    for _ in range(2):  # warm-up as torch.cuda.graph asks: on a side stream
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            call()
        torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = call()

    def replay():
        graph.replay()
        return static
    return replay


class TorchCP:
    """PyTorch's context_parallel. A position buffer, sharded by it like any buffer, says which
    global tokens this rank holds in its load-balanced layout; q/k/v/dout are cut to match (so
    only our small int buffer goes through its in-place resharding), and results go back to
    natural order through the gathered positions."""

    kind = "torch_cp"

    def __init__(self, rotation):
        self.rotation = rotation
        self.name = f"torch_cp_{rotation}"

    def run(self, ctx):
        if ctx.window is not None:
            raise ValueError("PyTorch's context_parallel takes no sliding window (--window)")
        if ctx.cu_seqlens is not None:
            raise ValueError("PyTorch's context_parallel takes no packed documents (--documents)")
        from torch.distributed.tensor.experimental import context_parallel
        try:
            from torch.distributed.tensor.experimental._attention import (_cp_options,
                                                                           set_rotate_method)
        except ImportError:  # where the back-compat module lacks them
            from torch.distributed.tensor.experimental._context_parallel._attention import (
                _cp_options, set_rotate_method)
        kernel = {"cudnn": SDPBackend.CUDNN_ATTENTION,
                  "flash": SDPBackend.FLASH_ATTENTION}[ctx.args.torch_cp_kernel]
        seq = ctx.cfg["seq"]
        device = ctx.inputs[0].device
        positions = torch.arange(seq, device=device).view(1, seq)
        old_balance, old_rotation = _cp_options.enable_load_balance, _cp_options.rotate_method
        # Its load balancer is for causal attention only (non-causal raises with it on).
        _cp_options.enable_load_balance = ctx.causal
        set_rotate_method(self.rotation)
        try:
            with context_parallel(ctx.mesh, buffers=[positions], buffer_seq_dims=[1],
                                  no_restore_buffers={positions}):
                index = positions[0].clone()
                local = [x.index_select(2, index) for x in ctx.inputs]

                def attention(a, b, c):
                    extra = {"enable_gqa": True} if ctx.gqa else {}
                    with sdpa_kernel(kernel):  # looked up now: context_parallel patches F.sdpa
                        return F.scaled_dot_product_attention(a, b, c, is_causal=ctx.causal,
                                                              **extra)

                def forward():
                    with torch.no_grad():
                        attention(*local[:3])

                def whole():
                    return [_unshard_by_index(x, index, ctx.world)
                            for x in fwd_bwd(attention, *local)]

                yield forward, lambda: fwd_bwd(attention, *local), whole
        finally:
            _cp_options.enable_load_balance = old_balance
            _cp_options.rotate_method = old_rotation


def _unshard_by_index(x, index, world):
    """Shards along dim 2 whose global positions are ``index`` (per rank) -> natural order."""
    xs = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(xs, x.contiguous())
    idx = [torch.empty_like(index) for _ in range(world)]
    dist.all_gather(idx, index)
    whole = x.new_empty((*x.shape[:2], x.shape[2] * world, *x.shape[3:]))
    whole.index_copy_(2, torch.cat(idx), torch.cat(xs, 2))
    return whole


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def all_methods(device, mesh_2d=None):
    ideals = ([Ideal("ideal_cudnn", SDPBackend.CUDNN_ATTENTION),
               Ideal("ideal_flash", SDPBackend.FLASH_ATTENTION)] if device == "cuda"
              else [Ideal("ideal_cpu", None)])
    modes = ("eager", "compiled", "captured") if device == "cuda" else ("eager", "compiled")
    hybrid = ([] if mesh_2d is None
              else [Ours(s, p, mesh=mesh_2d) for s in SCHEDULES for p in PRECISIONS])
    return (ideals + [TorchCP(r) for r in ROTATIONS]
            + [Ours(s, p, mode) for mode in modes for s in SCHEDULES for p in PRECISIONS]
            + hybrid)


def selected(methods, prefixes):
    prefixes = [p for p in prefixes.split(",") if p]

    def chosen(name, prefix):
        return name == prefix[:-1] if prefix.endswith("$") else name.startswith(prefix)

    return [m for m in methods if not prefixes or any(chosen(m.name, p) for p in prefixes)]


# ---------------------------------------------------------------------------------------------
# Running one method: agree on failures, time, measure memory, accuracy


class Runner:
    def __init__(self, args, mesh, device):
        self.args, self.mesh, self.device = args, mesh, device
        self.start = time.monotonic()

    def agree(self, local_error, *values):
        """All-reduce a failure flag and ``values`` (max over ranks); every rank gets the same."""
        t = torch.tensor([float(local_error is not None), *values], dtype=torch.float64,
                         device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        failed, *worst = t.tolist()
        error = local_error or ("failed on another rank" if failed else None)
        return error, worst

    def over_budget(self):
        mine = self.args.budget_s > 0 and time.monotonic() - self.start > self.args.budget_s
        return self.agree("over" if mine else None)[0] is not None

    def sent_mib(self, forward_backward):
        """MiB this rank's exchanges sent in one forward and backward, the max over ranks."""
        TRAFFIC.clear()
        forward_backward()
        _, (sent,) = self.agree(None, TRAFFIC["bytes"] / 2**20)
        return sent

    def clean(self):
        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def measure(self, method, ctx, reference, single_err):
        """One row's numbers for ``method`` (errors as strings, never raised)."""
        row = {"method": method.name, "kind": method.kind, "error": None}
        cuda = self.device == "cuda"
        gen = method.run(ctx)
        error, acc = None, None
        try:
            forward, forward_backward, whole = next(gen)
        except Exception as exc:  # noqa: BLE001 - reported in the row
            error = describe(exc)
        error, _ = self.agree(error)
        if error is None:
            try:
                if reference is not None:
                    acc = errors(whole(), reference)
            except Exception as exc:  # noqa: BLE001
                error = describe(exc)
            error, _ = self.agree(error)
        if error is None:
            fwd_ms = fb_ms = mem = peak = st_fwd_ms = st_fb_ms = 0.0
            try:
                self.clean()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                a = self.args
                fwd_ms = local_median_ms(forward, a.warmup, a.iters, self.device)
                fb_ms = local_median_ms(forward_backward, a.warmup, a.iters, self.device)
                if cuda:
                    peak = torch.cuda.max_memory_allocated()
                    mem = peak - base
                    st_fwd_ms, st_fb_ms = (steady_ms(fn, a.iters) for fn in (forward,
                                                                            forward_backward))
            except Exception as exc:  # noqa: BLE001
                error = describe(exc)
            error, (fwd_ms, fb_ms, mem, peak, st_fwd_ms, st_fb_ms) = self.agree(
                error, fwd_ms, fb_ms, mem, peak, st_fwd_ms, st_fb_ms)
            if error is None:
                scale = ctx.world if method.kind == "ideal" else 1
                row.update(fwd_ms=fwd_ms / scale, fwd_bwd_ms=fb_ms / scale,
                           mem_gib=mem / 2**30 if cuda else None,
                           peak_gib=peak / 2**30 if cuda else None)
                if cuda:
                    row.update(steady_fwd_ms=st_fwd_ms / scale, steady_fwd_bwd_ms=st_fb_ms / scale)
                if method.kind == "ours":
                    row["sent_mib"] = self.sent_mib(forward_backward)
                if acc is not None:
                    row["rel_rms"] = {n: acc[n]["rel_rms"] for n in NAMES}
                    row["max_abs"] = {n: acc[n]["max_abs"] for n in NAMES}
                    if single_err is not None:
                        row["acc_ratio"] = {n: acc[n]["rel_rms"] / single_err[n]["rel_rms"]
                                            for n in NAMES}
        row["error"] = error
        # Run the method's generator to its end (not close(): torch 2.11's context_parallel has no
        # try/finally around its yield, so only a normal exit unpatches SDPA).
        next(gen, None)
        if F.scaled_dot_product_attention is not SDPA:  # never let a patch leak into later rows
            F.scaled_dot_product_attention = SDPA
            row["note"] = "F.scaled_dot_product_attention was left patched; restored"
        self.clean()
        return row


# ---------------------------------------------------------------------------------------------
# The sweep


def configs(args):
    base = dict(batch=args.batch, heads=args.heads, head_dim=args.head_dim)
    out = []
    for kv in args.kv_heads:
        for tokens in args.tokens_per_gpu:
            out.append(dict(base, tokens_per_gpu=tokens, kv_heads=kv, causal=not args.no_causal))
    for tokens in args.also_non_causal:
        out.append(dict(base, tokens_per_gpu=tokens, kv_heads=args.kv_heads[0], causal=False,
                        methods=args.non_causal_methods))
    return sorted(out, key=lambda c: c["tokens_per_gpu"])  # stable: a budget cut takes the largest


def meta(args, world):
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv), "world_size": world, "device": args.device,
            "heads": args.heads, "head_dim": args.head_dim,
            "batch": args.batch, "dtype": "bfloat16", "iters": args.iters,
            "warmup": args.warmup, "fp32_backend": args.fp32_backend,
            "torch_cp_kernel": args.torch_cp_kernel, "accuracy_max_seq": args.accuracy_max_seq,
            "window": args.window, "documents": args.documents,
            "nccl_high_priority": args.nccl_high_priority}
    info.update(versions(args.device))
    return info


def use_triton_tiles(path):
    """Replace the exact kernel's tuned tiles with the ones in a bench/triton_tune.py JSON."""
    from dtensor_ring.kernels.triton_exact import TUNED, Tiles  # noqa: PLC0415 - optional

    with open(path) as f:
        best = json.load(f)["meta"]["best"]
    TUNED.update({part: Tiles(**tiles) for part, tiles in best.items()})
    return best


def sweep(args, mesh, device, info, mesh_2d=None):
    world, rank = mesh.size(), mesh.get_local_rank()
    runner = Runner(args, mesh, device)
    rows = []
    methods = selected(all_methods(device, mesh_2d), args.methods)
    for cfg in configs(args):
        cfg = dict(cfg, seq=cfg["tokens_per_gpu"] * world)
        if args.documents:
            cfg["cu_seqlens"] = list(placed_mix(cfg["seq"], world, args.seed))
        chosen = selected(methods, cfg.pop("methods", ""))
        label = {k: cfg[k] for k in ("tokens_per_gpu", "seq", "kv_heads", "causal")}
        if args.documents:
            label.update(documents=len(cfg["cu_seqlens"]) - 1, cu_seqlens=cfg["cu_seqlens"])
        if runner.over_budget():
            for method in chosen:
                rows.append({**label, "method": method.name, "kind": method.kind,
                             "error": f"skipped: past --budget-s {args.budget_s}"})
            continue
        accuracy = cfg["seq"] <= args.accuracy_max_seq
        inputs, inputs64 = make_inputs(cfg, device, args.seed, accuracy)
        ref = None
        if accuracy:
            ref = reference(*inputs64, cfg["causal"], 1.0 / cfg["head_dim"] ** 0.5, args.window,
                            cu_seqlens=cfg.get("cu_seqlens"))
            del inputs64
        ctx = Ctx(args, cfg, mesh, inputs)
        single_err, ideal = None, None
        for method in chosen:
            if runner.over_budget():
                row = {"method": method.name, "kind": method.kind,
                       "error": f"skipped: past --budget-s {args.budget_s}"}
            else:
                row = runner.measure(method, ctx, ref, single_err)
            row = {**label, **row}
            if method.kind == "ideal" and row.get("fwd_ms") is not None and ideal is None:
                ideal = row  # the first ideal that ran (cuDNN on CUDA) is the yardstick
                if "rel_rms" in row:
                    single_err = {n: {"rel_rms": row["rel_rms"][n]} for n in NAMES}
                    row["acc_ratio"] = {n: 1.0 for n in NAMES}
            if ideal is not None and row.get("fwd_ms") is not None:
                row["ideal"] = ideal["method"]
                row["frac_fwd"] = ideal["fwd_ms"] / row["fwd_ms"]
                row["frac_fwd_bwd"] = ideal["fwd_bwd_ms"] / row["fwd_bwd_ms"]
                for key in ("fwd", "fwd_bwd"):
                    if ideal.get(f"steady_{key}_ms") and row.get(f"steady_{key}_ms"):
                        row[f"frac_steady_{key}"] = (ideal[f"steady_{key}_ms"]
                                                     / row[f"steady_{key}_ms"])
            rows.append(row)
            if rank == 0:
                print(f"[{time.monotonic() - runner.start:6.1f}s] {fmt_row(row)}", flush=True)
                if args.out:
                    write_json(args.out, info, rows)
        del ctx, inputs, ref
        runner.clean()
    return rows


# ---------------------------------------------------------------------------------------------
# Profile


def profile_methods(text):
    """``--profile-methods``: comma-separated ``<schedule>_<precision>`` names, checked before any
    rank starts, -> [(schedule, precision)]."""
    valid = {f"{s}_{p}": (s, p) for s in SCHEDULES for p in PRECISIONS}
    for name in text.split(","):
        if name not in valid:
            raise argparse.ArgumentTypeError(f"has {name!r}; valid: {list(valid)}")
    return [valid[name] for name in text.split(",")]


def profile(args, mesh, device, path):
    """torch.profiler over each --profile-methods' fwd+bwd: top kernels, where GPU time goes."""
    for schedule, precision in args.profile_methods:
        profile_one(args, mesh, device, path, schedule, precision)


def profile_one(args, mesh, device, path, schedule, precision):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    rank, world = mesh.get_local_rank(), mesh.size()
    gen = torch.Generator(device=device).manual_seed(args.seed + rank)
    kv_heads = args.profile_kv_heads or args.heads
    shapes = [(args.batch, heads, args.profile_tokens, args.head_dim)
              for heads in (args.heads, kv_heads, kv_heads, args.heads)]
    q, k, v, dout = (torch.randn(shape, generator=gen, device=device).bfloat16()
                     for shape in shapes)
    backend = args.fp32_backend if precision == "fp32" else "auto"

    def step():
        fwd_bwd(lambda a, b, c: dr.ring_attention(a, b, c, mesh=mesh, schedule=schedule,
                                                  is_causal=True, precision=precision,
                                                  backend=backend),
                q, k, v, dout)

    for _ in range(3):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    if device == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    with torch_profile(activities=activities) as prof:
        for _ in range(args.profile_iters):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
    root, ext = os.path.splitext(path)
    stem = f"{root}_{schedule}_{precision}_r{rank}"
    trace = f"{stem}.trace.json"
    prof.export_chrome_trace(trace)
    lines = [f"{schedule} {precision} fwd+bwd, W={world}, rank {rank}, {args.profile_tokens} "
             f"tokens/GPU, {args.heads}/{kv_heads} heads, d={args.head_dim}, causal bf16, "
             f"{args.profile_iters} iterations profiled after 3 warm-up; torch {torch.__version__}"
             f"{'; NCCL high-priority streams' if args.nccl_high_priority else ''}",
             ""]
    lines += kernel_summary(trace, args.profile_iters)
    averages = prof.key_averages()
    for key in ("self_cuda_time_total", "cuda_time_total") if device == "cuda" else (
            "self_cpu_time_total",):
        lines += ["", f"key_averages sorted by {key}, top 25:"]
        try:
            lines.append(averages.table(sort_by=key, row_limit=25, max_name_column_width=70))
        except Exception as exc:  # noqa: BLE001 - newer torch: device_time
            alt = key.replace("cuda", "device")
            lines.append(averages.table(sort_by=alt, row_limit=25, max_name_column_width=70)
                         if alt != key else describe(exc))
    with open(f"{stem}{ext}", "w") as f:
        f.write("\n".join(lines) + "\n")
    if rank == 0:
        print("\n".join(lines[:40]), flush=True)


CATEGORIES = [  # (category, substrings of the lower-cased kernel name), first match wins
    ("nccl", ("nccl",)),
    ("attention", ("sdpa", "fmha", "flash", "cudnn", "attention", "attn", "_fwd_kernel",
                   "_bwd_")),
    ("memcpy/memset", ("memcpy", "memset")),
    ("copy/cast/cat (contiguous, stack, .to)", ("copy", "cat", "index")),
    ("fill/zeros", ("fill",)),
    ("reduce", ("reduce",)),
    ("merge/accumulate elementwise", ("sigmoid", "log", "exp", "add", "sub", "mul", "div",
                                      "elementwise")),
]


def category(name):
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(key in low for key in keys):
            return cat
    return "other"


def _union(intervals):
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _subtract(intervals, cover):
    """Length of ``intervals``' union not covered by ``cover``'s union."""
    return _union(intervals + cover) - _union(cover)


def steady_ms(fn, iters):
    """Median time in ms of ``fn()`` in steady state on CUDA (``timing.steady_median_ms``: runs
    back to back with the host ahead, as a model's layers run; the max over ranks). The per-run
    columns synchronise before each run, so they also hold how long the GPU waits for the host
    to reach the first kernel, which a model pays once per step, not per layer."""
    return max_over_ranks(steady_median_ms(fn, iters, STEADY_LEAD_MS))


STEADY_LEAD_MS = 20.0  # the host's head start before each steady-state group


def kernel_summary(trace_path, iters):
    """Per-category GPU time per iteration, and overlap: from the chrome trace's GPU events."""
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in
           ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return ["(no GPU kernels in the trace)"]
    span = max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)
    by_cat, by_name = {}, {}
    for e in gpu:
        cat = "memcpy/memset" if e["cat"] != "kernel" else category(e["name"])
        by_cat.setdefault(cat, []).append(e)
        by_name.setdefault(e["name"], [0.0, 0])
        by_name[e["name"]][0] += e["dur"]
        by_name[e["name"]][1] += 1
    iv = {c: [(e["ts"], e["ts"] + e["dur"]) for e in es] for c, es in by_cat.items()}
    compute = [x for c, xs in iv.items() if c != "nccl" for x in xs]
    busy, comm = _union(compute), iv.get("nccl", [])
    lines = [f"GPU span {span / iters / 1e3:.3f} ms/iter (first kernel start to last end / iters);"
             f" non-NCCL kernels busy {busy / iters / 1e3:.3f} ms/iter "
             f"({100 * busy / span:.1f}% of the span); idle (no kernel at all) "
             f"{(span - _union(compute + comm)) / iters / 1e3:.3f} ms/iter",
             f"NCCL kernels {_union(comm) / iters / 1e3:.3f} ms/iter, of which not overlapped by "
             f"any compute kernel {_subtract(comm, compute) / iters / 1e3:.3f} ms/iter "
             "(NCCL kernels also spin while waiting for the peer)",
             "", f"{'category':40} {'ms/iter':>9} {'calls/iter':>10} {'% of busy':>9}"]
    for cat, es in sorted(by_cat.items(), key=lambda kv: -sum(e["dur"] for e in kv[1])):
        t = sum(e["dur"] for e in es)
        lines.append(f"{cat:40} {t / iters / 1e3:9.3f} {len(es) / iters:10.1f} "
                     f"{100 * t / busy:9.1f}")
    lines += ["", "top 25 GPU kernels by total time:",
              f"{'ms/iter':>9} {'calls/iter':>10}  name"]
    for name, (t, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]:
        lines.append(f"{t / iters / 1e3:9.3f} {n / iters:10.1f}  {name[:150]}")
    return lines


# ---------------------------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    options = None
    if args.nccl_high_priority:
        options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=120), pg_options=options)
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(device, (world,))
    mesh_2d = None
    if args.mesh is not None:
        if args.mesh[0] * args.mesh[1] != world:
            raise SystemExit(f"--mesh {args.mesh[0]}x{args.mesh[1]} needs "
                             f"{args.mesh[0] * args.mesh[1]} ranks; this run has {world}")
        mesh_2d = init_device_mesh(device, args.mesh, mesh_dim_names=("cp_ring", "cp_a2a"))
    info = meta(args, world)
    info["mesh_2d"] = None if args.mesh is None else list(args.mesh)
    if args.triton_tiles:
        info["triton_tiles"] = use_triton_tiles(args.triton_tiles)
    info["mesh_group_is_default"] = mesh.get_group() is dist.group.WORLD  # --nccl-high-priority
    if args.profile:
        try:
            profile(args, mesh, device, args.profile)
        except Exception as exc:  # noqa: BLE001 - the sweep still runs
            print(f"rank {rank}: profile failed: {describe(exc)}", flush=True)
        dist.barrier()
    rows = sweep(args, mesh, device, info, mesh_2d)
    if rank == 0:
        print()
        print_table(info, rows)
        if args.out:
            write_json(args.out, info, rows)
        if args.plot:
            try:
                print("plot:", args.plot if plot({"meta": info, "rows": rows}, args.plot)
                      else "matplotlib missing: python bench/speed_plot.py JSON --out PNG")
            except Exception as exc:  # noqa: BLE001 - the numbers matter more than the picture
                print("plot failed:", describe(exc))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
