"""One-GPU probe: the exact Triton kernel's variants (inputs by TMA descriptors, causal q tiles
heaviest first) against the current kernel and cuDNN, on zigzag's blocks, in one run.

    python bench/kernel_variants.py --tokens 16384,8192 --out variants.json

Per block (triton_tune's blocks) and head count: the bits of every variant against the current
kernel's (max |diff| of out, lse, dq, dk, dv), then ``--rounds`` rounds in which cuDNN and each
variant are timed in turn (forward, backward; CUDA events, median), the order rotating per round;
the median over rounds is reported. ``--sweep``: then each kernel's candidate tiles for the
fastest variant.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import local_median_ms  # noqa: E402
from triton_tune import CUDNN, KERNEL, block_inputs, blocks  # noqa: E402

from dtensor_ring.kernels import triton_exact as te  # noqa: E402
from dtensor_ring.kernels.triton_exact import TUNED, Tiles  # noqa: E402

VARIANTS = {"current": dict(tma=False, reverse=False), "reverse": dict(tma=False, reverse=True),
            "tma": dict(tma=True, reverse=False), "tma_reverse": dict(tma=True, reverse=True)}
SWEEP = {
    "forward": [Tiles(128, 128, 8, 2), Tiles(128, 128, 8, 3), Tiles(128, 128, 8, 4),
                Tiles(128, 64, 4, 3), Tiles(128, 64, 8, 3)],
    "dkdv": [Tiles(64, 128, 8, 2), Tiles(64, 128, 8, 3), Tiles(64, 128, 8, 4),
             Tiles(128, 128, 8, 2), Tiles(32, 128, 4, 3)],
    "dq": [Tiles(128, 64, 8, 2), Tiles(128, 64, 8, 3), Tiles(128, 64, 8, 4),
           Tiles(128, 128, 8, 2), Tiles(64, 64, 4, 3)],
}
SCALE = 128 ** -0.5


def run(variant, q, k, v, dout, mask, tiles=None):
    te.VARIANT.update(VARIANTS[variant])
    out, lse = KERNEL.forward(q, k, v, mask, SCALE, tiles=tiles)
    return (out, lse, *KERNEL.backward(dout, q, k, v, out, lse, mask, SCALE, tiles=tiles))


def timers(variant, q, k, v, dout, mask, tiles=None):
    out, lse = run(variant, q, k, v, dout, mask, tiles)[:2]

    def fwd():
        te.VARIANT.update(VARIANTS[variant])
        KERNEL.forward(q, k, v, mask, SCALE, tiles=tiles)

    def bwd():
        te.VARIANT.update(VARIANTS[variant])
        KERNEL.backward(dout, q, k, v, out, lse, mask, SCALE, tiles=tiles)
    return fwd, bwd


def cudnn_timers(q, k, v, dout, mask):
    out, lse = CUDNN.forward(q, k, v, mask, SCALE)
    return (lambda: CUDNN.forward(q, k, v, mask, SCALE),
            lambda: CUDNN.backward(dout, q, k, v, out, lse, mask, SCALE))


def compare(args, rows):
    for tokens in args.tokens:
        for kv_heads in args.kv_heads:
            q, k, v, dout = block_inputs(tokens, args.heads, kv_heads)
            for name, (r, c, mask) in blocks(tokens).items():
                qb, kb, vb, db = q[:, :, r], k[:, :, c], v[:, :, c], dout[:, :, r]
                label = f"{tokens} {name} {args.heads}/{kv_heads}"
                base = run("current", qb, kb, vb, db, mask)
                row = dict(block=label, bits={})
                for variant in VARIANTS:
                    got = run(variant, qb, kb, vb, db, mask)
                    row["bits"][variant] = [float((a - b).abs().max()) for a, b in zip(got, base)]
                methods = {"cudnn": cudnn_timers(qb, kb, vb, db, mask)}
                methods.update({n: timers(n, qb, kb, vb, db, mask) for n in VARIANTS})
                names = list(methods)
                times = {n: dict(fwd=[], bwd=[]) for n in names}
                for rnd in range(args.rounds):
                    for n in names[rnd % len(names):] + names[:rnd % len(names)]:
                        fwd, bwd = methods[n]
                        times[n]["fwd"].append(local_median_ms(fwd, args.warmup, args.iters))
                        times[n]["bwd"].append(local_median_ms(bwd, args.warmup, args.iters))
                row["ms"] = {n: {p: statistics.median(t[p]) for p in t} for n, t in times.items()}
                cud = row["ms"]["cudnn"]
                row["vs_cudnn"] = {n: dict(fwd=cud["fwd"] / m["fwd"], bwd=cud["bwd"] / m["bwd"],
                                           fwd_bwd=(cud["fwd"] + cud["bwd"]) / (m["fwd"] + m["bwd"]))
                                   for n, m in row["ms"].items() if n != "cudnn"}
                rows.append(row)
                print(json.dumps(row), flush=True)


def sweep(args, rows, variant):
    """Each kernel's candidate tiles with ``variant``, the other kernels at TUNED; 16K blocks."""
    tokens = args.tokens[0]
    cases = []
    for kv_heads in args.kv_heads:
        q, k, v, dout = block_inputs(tokens, args.heads, kv_heads)
        for name, (r, c, mask) in blocks(tokens).items():
            cases.append((f"{name} {args.heads}/{kv_heads}", q[:, :, r], k[:, :, c], v[:, :, c],
                          dout[:, :, r], mask))
    for part, candidates in SWEEP.items():
        for cand in candidates:
            tiles = {**TUNED, part: cand}
            row = dict(variant=variant, sweep=part, tiles=cand._asdict(), ms={})
            try:
                for label, qb, kb, vb, db, mask in cases:
                    fwd, bwd = timers(variant, qb, kb, vb, db, mask, tiles)
                    row["ms"][label] = local_median_ms(fwd if part == "forward" else bwd,
                                                       args.warmup, args.iters)
            except Exception as exc:  # noqa: BLE001 - an out-of-resources tile is reported
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            else:
                row["total_ms"] = sum(row["ms"].values())
            rows.append(row)
            print(json.dumps(row), flush=True)


def main():
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=ints, default=[16384])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=ints, default=[32, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--sweep", choices=list(VARIANTS), default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows, start = [], time.time()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                cudnn=torch.backends.cudnn.version())
    try:
        import triton  # noqa: PLC0415
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    rows.append(dict(meta=meta, args=vars(args)))
    try:
        compare(args, rows)
        if args.sweep:
            sweep(args, rows, args.sweep)
    finally:
        rows.append(dict(seconds=time.time() - start))
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
