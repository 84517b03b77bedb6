"""Where a profiled iteration's GPU time goes, by kind of kernel and by phase, from the chrome trace
``torch.profiler`` exports (bench/per_rank.py).

Kinds: ``KINDS`` is (kind, pattern) pairs; a kernel takes the first kind whose pattern (a regular
expression, case-insensitive) its name matches, else "other". Memcpy events are copies, memsets are
other.

    attention            cuDNN's SDPA kernels, PyTorch's flash and memory-efficient (CUTLASS) ones,
                         the exact mode's Triton kernels (``_forward``, ``_dq``, ``_dkdv``)
    copies               casts and copies (``.to``, ``.contiguous``, ``copy_``, stack/cat, index),
                         memcpy, and the exact mode's fp16 copies (Triton ``_to_fp16``)
    merge/accumulation   the fp32 merge and accumulation (Triton ``_merge_many``,
                         ``_sum_many``), and
                         torch's elementwise add/sub/mul/div/sigmoid kernels (the final dK/dV add,
                         the torch form of the merge where Triton is missing)
    other                the rest, e.g. fills and memsets (``RowSums`` zeroing rows no block
                         reached) and the exact mode's amax reductions; its top names are kept, so
                         a kernel no pattern knows stays visible

Phases: a kernel belongs to the ``record_function`` range (``<prefix><phase>``, e.g.
``per_rank.fwd``) that was open on the host when it was launched, found through the correlation id
linking it to its launch call (cudaLaunchKernel, cuLaunchKernel, cudaMemcpyAsync, ...); failing
that (a launch the trace does not hold), to the range's GPU-side span ("gpu_user_annotation") that
holds its start; one in neither counts under "unattributed".
"""
import re

KINDS = (
    ("attention", r"cudnn|sdpa|fmha|flash_fwd|flash_bwd|flash::|cutlass.*attention"
                  r"|^_(forward|dq|dkdv)$"),
    # copies before merges: a copy kernel's templated name may hold "mul" or "div" (its offset
    # calculators), a merge kernel's never holds "copy"
    ("copies", r"^_to_fp16$|copy|catarray|memcpy|index|stack"),
    ("merge/accumulation", r"^_(merge_many|sum_many)$|add|sub|mul|div|sigmoid"),
)
OTHER = "other"
KIND_NAMES = tuple(kind for kind, _ in KINDS) + (OTHER,)
_COMPILED = tuple((kind, re.compile(pattern, re.IGNORECASE)) for kind, pattern in KINDS)
_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
TOP = 6  # names kept per phase (the longest), and of "other"


def kind_of(name: str, cat: str = "kernel") -> str:
    if cat == "gpu_memset":
        return OTHER
    for kind, pattern in _COMPILED:
        if pattern.search(name):
            return kind
    return OTHER


def breakdown(events: list[dict], iters: int, prefix: str) -> dict:
    """{phase: {"launches", "gpu_ms", "kinds": {kind: ms}, "top": [[name, ms, launches]],
    "other_top": [...]}}, per iteration (``iters`` iterations profiled), from chrome-trace
    ``events``; phases are the ``record_function`` names after ``prefix``."""
    launched = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {})}

    def spans(cat):
        return [(e["ts"], e["ts"] + e.get("dur", 0), e["name"][len(prefix):]) for e in events
                if e.get("cat") == cat and e.get("name", "").startswith(prefix)]

    def phase_at(t, ranges):
        return next((p for a, b, p in ranges if t is not None and a <= t <= b), None)

    host, device = spans("user_annotation"), spans("gpu_user_annotation")
    phases: dict[str, dict] = {}
    for e in events:
        if e.get("cat") not in _GPU_CATS:
            continue
        phase = (phase_at(launched.get(e.get("args", {}).get("correlation")), host)
                 or phase_at(e["ts"], device) or "unattributed")
        acc = phases.setdefault(phase, {"launches": 0, "us": 0.0, "kinds": {}, "names": {}})
        kind, dur = kind_of(e["name"], e["cat"]), e.get("dur", 0.0)
        acc["launches"] += 1
        acc["us"] += dur
        acc["kinds"][kind] = acc["kinds"].get(kind, 0.0) + dur
        name = acc["names"].setdefault(e["name"], [kind, 0.0, 0])
        name[1] += dur
        name[2] += 1
    return {phase: _summary(acc, iters) for phase, acc in phases.items()}


def _summary(acc, iters):
    def top(names):
        return [[name, round(us / iters / 1e3, 4), count / iters]
                for name, (_, us, count) in sorted(names, key=lambda kv: -kv[1][1])[:TOP]]

    names = list(acc["names"].items())
    return {"launches": acc["launches"] / iters,
            "gpu_ms": acc["us"] / iters / 1e3,
            "kinds": {kind: acc["kinds"].get(kind, 0.0) / iters / 1e3 for kind in KIND_NAMES},
            "top": top(names),
            "other_top": top([kv for kv in names if kv[1][0] == OTHER])}
