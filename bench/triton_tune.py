"""One-GPU sweep of the exact Triton kernel's tiles against cuDNN, on the ring's block shapes.

    python bench/triton_tune.py --tokens 16384 --heads 32 --kv-heads 32,8 --out tune.json

For each kernel (forward, dK/dV, dq) it times every candidate ``Tiles`` on the blocks zigzag runs
at ``--tokens`` per GPU (S = tokens: the causal own block S x S and the half blocks S/2 x S and
S x S/2, non-causal), 32/32 and 32/8 heads, and keeps the one with the least total time; dK/dV is
swept with dq at its tuned tiles, then dq with the best dK/dV. Then, per block: cuDNN's forward
and backward time against the best tiles' and the current ``TUNED`` tiles' (CUDA events, median).

``--seeds N``: the accuracy of the best and the current tiles and of cuDNN against float64 on the
whole sequence (S = ``--accuracy-seq``, 8 heads, causal) for N seeds: rel-RMS and max-abs of out,
dq, dk, dv (also of SDPA's own pick, which the numerics report calls the single-device kernel);
the ratio Triton / cuDNN per seed says whether a max-abs gap is systematic.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import versions  # noqa: E402
from timing import local_median_ms  # noqa: E402

from dtensor_ring.kernels.base import CAUSAL, NONE  # noqa: E402
from dtensor_ring.kernels.cuda import Cudnn  # noqa: E402
from dtensor_ring.kernels.triton_exact import TUNED, Tiles, TritonExact  # noqa: E402
from dtensor_ring.tools.numerics import NAMES, errors, fwd_bwd, make_inputs, sdpa  # noqa: E402

# Around the best of a first, wider sweep on an H200 (d = 128, bf16, 16K tokens per GPU).
CANDIDATES = {
    "forward": [Tiles(128, 64, 4, 2), Tiles(128, 64, 8, 3), Tiles(128, 64, 8, 4),
                Tiles(128, 128, 8, 2), Tiles(128, 128, 8, 3), Tiles(128, 128, 8, 4),
                Tiles(64, 64, 4, 3)],
    # dK/dV runs two of its four products with the q tile as the reduction: 128-row q tiles
    # (the last five) give those the same depth as the other two.
    "dkdv": [Tiles(32, 64, 4, 3), Tiles(32, 128, 8, 3), Tiles(64, 64, 4, 3), Tiles(64, 128, 8, 2),
             Tiles(64, 128, 8, 3), Tiles(64, 128, 8, 4), Tiles(128, 64, 4, 2),
             Tiles(128, 64, 4, 3), Tiles(128, 64, 8, 2), Tiles(128, 64, 8, 3),
             Tiles(128, 128, 8, 2)],
    "dq": [Tiles(64, 32, 4, 3), Tiles(128, 32, 8, 3), Tiles(128, 64, 8, 2), Tiles(128, 64, 8, 3),
           Tiles(128, 64, 8, 4), Tiles(128, 128, 8, 2), Tiles(128, 128, 8, 3)],
}
KERNEL, CUDNN = TritonExact(), Cudnn()


def blocks(tokens):
    """name -> (q rows, k rows, mask): the blocks zigzag computes at ``tokens`` per GPU."""
    half, every = slice(0, tokens // 2), slice(0, tokens)
    return {"SxS causal": (every, every, CAUSAL), "S/2xS": (half, every, NONE),
            "SxS/2": (every, half, NONE)}


def block_inputs(tokens, heads, kv_heads, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, dout = (torch.randn(1, heads, tokens, 128, generator=gen, device="cuda").bfloat16()
               for _ in range(2))
    k, v = (torch.randn(1, kv_heads, tokens, 128, generator=gen, device="cuda").bfloat16()
            for _ in range(2))
    return q, k, v, dout


def cases(args):
    """(label, q, k, v, dout, out, lse, mask) for every block and head count."""
    for kv_heads in args.kv_heads:
        q, k, v, dout = block_inputs(args.tokens, args.heads, kv_heads)
        for name, (rows, cols, mask) in blocks(args.tokens).items():
            qb, kb, vb, db = q[:, :, rows], k[:, :, cols], v[:, :, cols], dout[:, :, rows]
            out, lse = KERNEL.forward(qb, kb, vb, mask, 128 ** -0.5)
            yield f"{name} {args.heads}/{kv_heads}", qb, kb, vb, db, out, lse, mask


def timer(kernel_part, tiles, case):
    _, q, k, v, dout, out, lse, mask = case
    scale = 128 ** -0.5
    if kernel_part == "forward":
        return lambda: KERNEL.forward(q, k, v, mask, scale, tiles=tiles)
    return lambda: KERNEL.backward(dout, q, k, v, out, lse, mask, scale, tiles=tiles)


def sweep(part, chosen, all_cases, args, rows):
    """Times every candidate for ``part`` (the others at ``chosen``); returns the fastest."""
    best, best_total = None, float("inf")
    for cand in CANDIDATES[part]:
        tiles = {**chosen, part: cand}
        row = dict(sweep=part, tiles=cand._asdict(), ms={})
        try:
            for case in all_cases:
                row["ms"][case[0]] = local_median_ms(timer(part, tiles, case),
                                                     args.warmup, args.iters)
        except Exception as exc:  # noqa: BLE001 - an out-of-resources tile is skipped, reported
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        else:
            row["total_ms"] = sum(row["ms"].values())
            if row["total_ms"] < best_total:
                best, best_total = cand, row["total_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return best


def versus_cudnn(best, all_cases, args, rows):
    scale = 128 ** -0.5
    for label, q, k, v, dout, out, lse, mask in all_cases:
        out16, lse16 = CUDNN.forward(q, k, v, mask, scale)
        row = dict(compare=label)
        row["cudnn_fwd_ms"] = local_median_ms(lambda: CUDNN.forward(q, k, v, mask, scale),
                                              args.warmup, args.iters)
        row["cudnn_bwd_ms"] = local_median_ms(
            lambda: CUDNN.backward(dout, q, k, v, out16, lse16, mask, scale),
            args.warmup, args.iters)
        for name, tiles in (("best", best), ("tuned", TUNED)):
            case = (label, q, k, v, dout, out, lse, mask)
            row[f"{name}_fwd_ms"] = local_median_ms(timer("forward", tiles, case),
                                                    args.warmup, args.iters)
            row[f"{name}_bwd_ms"] = local_median_ms(timer("backward", tiles, case),
                                                    args.warmup, args.iters)
            fwd, bwd = row[f"{name}_fwd_ms"], row[f"{name}_bwd_ms"]
            row[f"{name}_vs_cudnn"] = dict(fwd=row["cudnn_fwd_ms"] / fwd,
                                           bwd=row["cudnn_bwd_ms"] / bwd,
                                           fwd_bwd=(row["cudnn_fwd_ms"] + row["cudnn_bwd_ms"])
                                           / (fwd + bwd))
        rows.append(row)
        print(json.dumps(row), flush=True)


def accuracy(best, args, rows):
    """Errors against float64 on the whole causal sequence, per seed: Triton (best and tuned
    tiles), cuDNN."""
    scale = 128 ** -0.5
    for seed in range(args.seeds):
        q64, k64, v64, d64 = (x.cuda() for x in make_inputs(1, 8, 8, args.accuracy_seq, 128,
                                                            seed=seed))
        q, k, v, dout = (x.bfloat16() for x in (q64, k64, v64, d64))
        ref = fwd_bwd(sdpa(True), q.double(), k.double(), v.double(), dout.double())
        out16, lse16 = CUDNN.forward(q, k, v, CAUSAL, scale)
        grads16 = CUDNN.backward(dout, q, k, v, out16, lse16, CAUSAL, scale)
        row = dict(accuracy_seed=seed, seq=args.accuracy_seq, cudnn=errors([out16, *grads16], ref),
                   sdpa=errors(fwd_bwd(sdpa(True), q, k, v, dout), ref))
        for name, tiles in (("best", best), ("tuned", TUNED)):
            out, lse = KERNEL.forward(q, k, v, CAUSAL, scale, tiles=tiles)
            grads = KERNEL.backward(dout, q, k, v, out, lse, CAUSAL, scale, tiles=tiles)
            # the user sees bf16: round as the schedules' final cast does
            row[name] = errors([x.bfloat16() for x in (out, *grads)], ref)
            row[f"{name}_over_cudnn"] = {
                n: {m: row[name][n][m] / row["cudnn"][n][m] for m in ("rel_rms", "max_abs")}
                for n in NAMES}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del ref


def _parts(text):
    parts = text.split(",")
    unknown = [p for p in parts if p not in CANDIDATES]
    if unknown:
        raise argparse.ArgumentTypeError(f"has {unknown[0]!r}; valid: {list(CANDIDATES)}")
    return parts


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=lambda s: [int(x) for x in s.split(",")],
                        default=[32, 8])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--seeds", type=int, default=0)
    parser.add_argument("--accuracy-seq", type=int, default=8192)
    parser.add_argument("--skip-sweep", action="store_true", help="compare TUNED only")
    parser.add_argument("--parts", type=_parts, default=list(CANDIDATES),
                        help="the kernels to sweep, comma-separated (default: all)")
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def main():
    args = parse_args()
    started, rows = time.time(), []
    all_cases = list(cases(args))
    chosen = dict(TUNED)
    if not args.skip_sweep:
        for part in args.parts:
            chosen[part] = sweep(part, chosen, all_cases, args, rows) or chosen[part]
    print("best:", {part: tiles._asdict() for part, tiles in chosen.items()}, flush=True)
    versus_cudnn(chosen, all_cases, args, rows)
    accuracy(chosen, args, rows)
    meta = dict(versions("cuda"), argv=sys.argv, seconds=time.time() - started,
                best={part: tiles._asdict() for part, tiles in chosen.items()})
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
