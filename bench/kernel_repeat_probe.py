"""Does each exact-mode Triton kernel give the same bits on every launch? One GPU, no ring.

    python bench/kernel_repeat_probe.py --launches 3000 --out kernel_repeat.json

For zigzag's W = 2 blocks (q 2048 x k 4096 and q 4096 x k 2048 full, 4096 x 4096 causal; 8 heads,
d = 128, bf16) and each launch shape in ``FORWARD_TILES`` / ``BACKWARD_TILES``, the kernel runs
``--launches`` times on the same inputs; every result is compared bit for bit with the first, on
the GPU (no host sync per launch). Reported per kernel: launches whose result differed, rows that
differed in total, and for the forward whether ``lse`` differed too. With ``--noise on`` a second
stream copies 512 MiB back and forth meanwhile, as NCCL's transfers load the memory system in a ring.
The merge kernel (``triton_merge.merge_``) is checked the same way. ``--kernels`` picks among
forward, merge and backward.
"""
import argparse
import json
import time

import torch
from repeat_probe import bits

from dtensor_ring import triton_merge
from dtensor_ring.kernels.triton_exact import TUNED, Tiles, TritonExact

FORWARD_TILES = [TUNED["forward"], Tiles(128, 128, 8, 2), Tiles(128, 64, 4, 3),
                 Tiles(128, 128, 4, 3), Tiles(64, 128, 4, 3), Tiles(128, 128, 8, 1)]
BACKWARD_TILES = [(TUNED["dkdv"], TUNED["dq"]), (Tiles(64, 128, 8, 2), Tiles(128, 64, 8, 2)),
                  (Tiles(32, 64, 4, 2), Tiles(64, 32, 4, 2))]
BLOCKS = [(2048, 4096, "none"), (4096, 2048, "none"), (4096, 4096, "causal")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a TRITON_INTERPRET=1 dry run


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class Count:
    """On-GPU counts of launches and rows whose bits differ from a reference."""

    def __init__(self, reference):
        self.reference = bits(reference)
        self.rows = torch.zeros((), dtype=torch.int64, device=reference.device)
        self.launches = torch.zeros_like(self.rows)

    def add(self, result):
        differ = bits(result) != self.reference
        rows = differ.any(-1).sum() if differ.dim() == 4 else differ.sum()
        self.rows += rows
        self.launches += rows > 0

    def result(self):
        return dict(launches=int(self.launches), rows=int(self.rows))


class Noise:
    """A second stream copying 512 MiB back and forth, one copy per ``tick``."""

    def __init__(self, enabled):
        self.stream = torch.cuda.Stream() if enabled else None
        if enabled:
            self.a = torch.empty(1 << 28, dtype=torch.bfloat16, device="cuda")
            self.b = torch.empty_like(self.a)

    def tick(self):
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                self.b.copy_(self.a)
                self.a, self.b = self.b, self.a


def repeat(launch, names, launches, noise):
    first = launch()
    counts = [Count(x) for x in first]
    sync()
    start = time.perf_counter()
    for _ in range(launches):
        noise.tick()
        for count, x in zip(counts, launch()):
            count.add(x)
    sync()
    return dict({n: c.result() for n, c in zip(names, counts)},
                seconds=round(time.perf_counter() - start, 3))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", type=int, default=3000)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--scale-down", type=int, default=1, help="divide the block lengths (dry runs)")
    p.add_argument("--noise", default="off,on")
    p.add_argument("--kernels", default="forward,merge,backward")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    kernel = TritonExact()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rows = []

    def emit(row):
        print(json.dumps(row), flush=True)
        rows.append(row)

    for seq_q, seq_k, mask in BLOCKS:
        seq_q, seq_k = seq_q // args.scale_down, seq_k // args.scale_down
        def randn(seq):
            return torch.randn((1, args.heads, seq, 128), generator=gen, device=DEVICE,
                               dtype=torch.bfloat16)
        q, dout, k, v = randn(seq_q), randn(seq_q), randn(seq_k), randn(seq_k)
        scale = 128 ** -0.5
        block = dict(seq_q=seq_q, seq_k=seq_k, mask=mask)
        kernels = args.kernels.split(",")
        for noisy in args.noise.split(","):
            noise = Noise(noisy == "on")
            for tiles in FORWARD_TILES if "forward" in kernels else ():
                emit(dict(block, kernel="forward", noise=noisy, tiles=tiles._asdict(), **repeat(
                    lambda t=tiles: kernel.forward(q, k, v, mask, scale, tiles={"forward": t}),
                    ("out", "lse"), args.launches, noise)))
            out, lse = kernel.forward(q, k, v, mask, scale)
            lse_other = lse - torch.rand(lse.shape, generator=gen, device=DEVICE)
            out_other = torch.randn(out.shape, generator=gen, device=DEVICE)

            def merge():
                acc, acc_lse = out.clone(), lse.clone()
                triton_merge.merge_(acc, acc_lse, out_other, lse_other)
                return acc, acc_lse
            if "merge" in kernels:
                emit(dict(block, kernel="merge", noise=noisy,
                          **repeat(merge, ("out", "lse"), args.launches, noise)))
            for dkdv, dq in BACKWARD_TILES if "backward" in kernels else ():
                emit(dict(block, kernel="backward", noise=noisy,
                          tiles=dict(dkdv=dkdv._asdict(), dq=dq._asdict()), **repeat(
                              lambda a=dkdv, b=dq: kernel.backward(
                                  dout, q, k, v, out, lse, mask, scale, tiles={"dkdv": a, "dq": b}),
                              ("dq", "dk", "dv"), args.launches // 3, noise)))
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", torch=torch.__version__,
                       rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
