"""Numerics report: error against float64 vs the number of simulated ranks, per schedule and precision.

    python -m dtensor_ring.tools.numerics_report --seq 1024 --heads 4 --kv-heads 2 --head-dim 64 \\
        --out report_dir [--device cuda] [--max-world 64] [--dtype bfloat16] [--no-causal]

For each input kind — ``normal`` (N(0,1)) and ``outliers`` (the FlashAttention-3 paper's hard case:
N(0,1) + N(0,100) * Bernoulli(0.001), i.e. std-10 spikes on 0.1% of q/k/v entries) — it runs
``simulate_ring`` at W = 1, 2, 4, ... (every power of two up to --max-world that the layout can
split the sequence into) for every schedule and precision, forward and backward. Errors are against
float64 attention on the *same* rounded inputs (so only the arithmetic is measured), as rel-RMS and
max-abs of out, dq, dk, dv, each divided by the single-device SDPA kernel's error in the same dtype
(1.00 = splitting added no error). Writes ``numerics.json``, ``numerics.md`` (tables) and, when
matplotlib is installed, ``numerics.png`` (ratio vs W, one line per schedule x precision).
"""
import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..attention import simulate_ring
from ..schedules import SCHEDULES
from ..validation import PRECISIONS
from .numerics import NAMES, errors, fwd_bwd

INPUT_KINDS = ("normal", "outliers")


def make_inputs(kind, batch, heads, kv_heads, seq, head_dim, seed=0):
    """q, k, v, dout in float64 (CPU generator, so every device sees the same numbers)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, seq, head_dim), (batch, kv_heads, seq, head_dim),
              (batch, kv_heads, seq, head_dim), (batch, heads, seq, head_dim)]
    tensors = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    if kind == "outliers":
        for x in tensors[:3]:
            spikes = torch.rand(x.shape, generator=gen, dtype=torch.float64) < 0.001
            x += 10.0 * torch.randn(x.shape, generator=gen, dtype=torch.float64) * spikes
    return tensors


def world_sizes(schedule, seq, max_world):
    sizes, w = [], 1
    while w <= max_world:
        parts = 2 * w if SCHEDULES[schedule].layout.name == "zigzag" else w
        if seq % parts == 0:
            sizes.append(w)
        w *= 2
    return sizes


def ratio_rows(errs, single):
    return {metric: {n: errs[n][metric] / single[n][metric] for n in NAMES}
            for metric in ("rel_rms", "max_abs")}


def run(args, partial=None):
    """Every (inputs, schedule, precision, W) row; each appended to ``partial`` (JSON lines)."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows = []
    for kind in args.inputs:
        inputs = [x.to(device) for x in make_inputs(kind, 1, args.heads, args.kv_heads, args.seq,
                                                     args.head_dim)]
        lowp = [x.to(dtype) for x in inputs]
        sdpa = lambda a, b, c: F.scaled_dot_product_attention(  # noqa: E731
            a, b, c, is_causal=args.causal, enable_gqa=True)
        reference = fwd_bwd(sdpa, *(x.double() for x in lowp))
        single = errors(fwd_bwd(sdpa, *lowp), reference)
        for schedule in args.schedules:
            for precision in args.precisions:
                for world in world_sizes(schedule, args.seq, args.max_world):
                    start = time.perf_counter()
                    got = fwd_bwd(lambda a, b, c: simulate_ring(
                        a, b, c, world_size=world, schedule=schedule, is_causal=args.causal,
                        precision=precision), *lowp)
                    errs = errors(got, reference)
                    rows.append(dict(inputs=kind, schedule=schedule, precision=precision,
                                     world=world, errors=errs, single=single,
                                     ratio=ratio_rows(errs, single),
                                     seconds=round(time.perf_counter() - start, 3)))
                    del got
                    print(_line(rows[-1]), flush=True)
                    if partial is not None:
                        with open(partial, "a") as f:
                            f.write(json.dumps(rows[-1]) + "\n")
    return rows


def _line(row):
    rel = "/".join(f"{row['ratio']['rel_rms'][n]:.3f}" for n in NAMES)
    mx = "/".join(f"{row['ratio']['max_abs'][n]:.2f}" for n in NAMES)
    return (f"| {row['inputs']} | {row['schedule']} | {row['precision']} | {row['world']} | "
            f"{rel} | {mx} |")


def markdown(rows, config):
    lines = [f"# Numerics report: {config['command']}", "",
             f"{config['device_name']}, torch {config['torch']}, triton {config['triton']}, "
             f"Python {config['python']}", "",
             "Ratios: error against float64 (on the same rounded inputs) over the single-device "
             "SDPA kernel's error, for out/dq/dk/dv. 1.00 = splitting added no error.", "",
             "## Worst ratio over W >= 2 (rel-RMS | max-abs)", "",
             "| inputs | schedule | precision | worst rel-RMS | worst max-abs |", "|---|---|---|---|---|"]
    groups = {}
    for row in rows:
        if row["world"] >= 2:
            groups.setdefault((row["inputs"], row["schedule"], row["precision"]), []).append(row)
    for (kind, schedule, precision), group in groups.items():
        rel = max(max(r["ratio"]["rel_rms"].values()) for r in group)
        mx = max(max(r["ratio"]["max_abs"].values()) for r in group)
        lines.append(f"| {kind} | {schedule} | {precision} | {rel:.3f} | {mx:.3f} |")
    lines += ["", "## Every run", "",
              "| inputs | schedule | precision | W | rel-RMS ratio out/dq/dk/dv | "
              "max-abs ratio out/dq/dk/dv |", "|---|---|---|---|---|---|"]
    lines += [_line(r) for r in rows]
    return "\n".join(lines) + "\n"


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m dtensor_ring.tools.numerics_report")
    parser.add_argument("--seq", type=int, default=1024, help="global sequence length")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-world", type=int, default=64)
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--schedule", dest="schedules", choices=sorted(SCHEDULES),
                        action="append", help="repeat to pick several (default: all)")
    parser.add_argument("--precision", dest="precisions", choices=PRECISIONS, action="append")
    parser.add_argument("--inputs", choices=INPUT_KINDS, action="append")
    parser.add_argument("--out", type=Path, required=True, help="directory for the report")
    args = parser.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    args.schedules = args.schedules or sorted(SCHEDULES)
    args.precisions = args.precisions or list(PRECISIONS)
    args.inputs = args.inputs or list(INPUT_KINDS)
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    try:
        import triton  # noqa: PLC0415 - only its version is recorded
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    device = torch.device(args.device)
    config = dict(command="python -m dtensor_ring.tools.numerics_report " + " ".join(argv),
                  torch=torch.__version__, triton=triton_version,
                  python=platform.python_version(),
                  device_name=(torch.cuda.get_device_name(device) if device.type == "cuda"
                               else platform.processor() or "cpu"),
                  seq=args.seq, heads=args.heads, kv_heads=args.kv_heads,
                  head_dim=args.head_dim, dtype=args.dtype, causal=args.causal)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rows = run(args, partial=args.out / "numerics_partial.jsonl")
    config["seconds"] = round(time.perf_counter() - start, 1)
    (args.out / "numerics.json").write_text(json.dumps(dict(config=config, rows=rows), indent=1))
    (args.out / "numerics.md").write_text(markdown(rows, config))
    from .numerics_plot import plot  # noqa: PLC0415 - matplotlib is optional
    written = plot(rows, config, args.out / "numerics.png")
    print(f"wrote {args.out}/numerics.json, numerics.md" + (", numerics.png" if written else
          " (no plot: matplotlib is not installed)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
