"""The exact kernel with fp16 products (this tree) against the one before (bf16 products, the
package at ebbdecf, importable as ``dtensor_ring_old``) and cuDNN, on one GPU.

    python probe.py --out probe.json [--tokens 16384 ...] [--seeds 8] [--skip-timing]

timing: zigzag's blocks at --tokens per GPU (S x S causal, S/2 x S, S x S/2), 32/32 and 32/8
  heads, d = 128, bf16; forward and backward of cuDNN, old and new in turn, 3 rotating rounds,
  each the median of 10 CUDA-event timed calls. Also the fp16 copy alone (``_fp16_copies``).
accuracy: the whole causal sequence (S = 8192, 8/8 heads), normal and outlier inputs (the numerics
  report's), per seed: rel-RMS and max-abs against float64 on the same bf16 inputs, of old, new and
  cuDNN, every result cast to bf16 first (as the ring's final cast does).
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/, for timing.py
from timing import local_median_ms  # noqa: E402

from dtensor_ring.kernels.base import CAUSAL, NONE  # noqa: E402
from dtensor_ring.kernels.cuda import Cudnn  # noqa: E402
from dtensor_ring.kernels.triton_exact import TritonExact, _fp16_copies  # noqa: E402
from dtensor_ring.numerics import errors, fwd_bwd, sdpa  # noqa: E402
from dtensor_ring.numerics_report import make_inputs  # noqa: E402
from dtensor_ring_old.kernels.triton_exact import TritonExact as OldExact  # noqa: E402

SCALE = 128 ** -0.5
KERNELS = dict(cudnn=Cudnn(), old=OldExact(), new=TritonExact())


def timing(args, rows):
    s = args.tokens
    half, every = slice(0, s // 2), slice(0, s)
    blocks = {"SxS causal": (every, every, CAUSAL), "S/2xS": (half, every, NONE),
              "SxS/2": (every, half, NONE)}
    for kv_heads in (32, 8):
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, dout = (torch.randn(1, 32, s, 128, generator=gen, device="cuda").bfloat16()
                   for _ in range(2))
        k, v = (torch.randn(1, kv_heads, s, 128, generator=gen, device="cuda").bfloat16()
                for _ in range(2))
        for name, (r, c, mask) in blocks.items():
            qb, kb, vb, db = q[:, :, r], k[:, :, c], v[:, :, c], dout[:, :, r]
            saved = {n: kern.forward(qb, kb, vb, mask, SCALE) for n, kern in KERNELS.items()}
            ms = {f"{n}_{part}": [] for n in KERNELS for part in ("fwd", "bwd")}
            for rnd in range(3):
                order = list(KERNELS)[rnd:] + list(KERNELS)[:rnd]
                for n in order:
                    kern, (out, lse) = KERNELS[n], saved[n]
                    ms[f"{n}_fwd"].append(local_median_ms(
                        lambda: kern.forward(qb, kb, vb, mask, SCALE), 3, 10))
                    ms[f"{n}_bwd"].append(local_median_ms(
                        lambda: kern.backward(db, qb, kb, vb, out, lse, mask, SCALE), 3, 10))
            row = dict(block=f"{name} 32/{kv_heads}", tokens=s,
                       ms={key: statistics.median(t) for key, t in ms.items()}, rounds=ms)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "rounds"}), flush=True)
    x = torch.randn(1, 32, s, 128, device="cuda").bfloat16()
    rows.append(dict(copy=f"[1, 32, {s}, 128] bf16",
                     ms=local_median_ms(lambda: _fp16_copies(x), 3, 20)))
    print(json.dumps(rows[-1]), flush=True)


def accuracy(args, rows):
    for kind, seeds in (("normal", args.seeds), ("outliers", args.seeds // 2)):
        for seed in range(seeds):
            q, k, v, dout = (x.cuda().bfloat16() for x in make_inputs(kind, 1, 8, 8, 8192, 128,
                                                                       seed))
            ref = fwd_bwd(sdpa(True), *(x.double() for x in (q, k, v, dout)))  # the bf16 inputs
            row = dict(inputs=kind, seed=seed)
            for n, kern in KERNELS.items():
                out, lse = kern.forward(q, k, v, CAUSAL, SCALE)
                grads = kern.backward(dout, q, k, v, out, lse, CAUSAL, SCALE)
                row[n] = errors([x.bfloat16() for x in (out, *grads)], ref)
            rows.append(row)
            print(json.dumps(row), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()
    rows = [dict(device=torch.cuda.get_device_name(), torch=torch.__version__)]
    if not args.skip_timing:
        for tokens in args.tokens:
            timing(argparse.Namespace(tokens=tokens), rows)
    accuracy(args, rows)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
