"""Host time and back-to-back GPU time per call of the fp16 copy and the old and new exact kernels
at 2K tokens, 32 heads, on one GPU (needs ``dtensor_ring_old`` importable, as probe.py does)."""
import cProfile
import pstats
import time

import torch

from dtensor_ring.kernels import triton_attention as ta
from dtensor_ring.kernels.triton_exact import _fp16_copies

def host_us(fn, n=200):
    for _ in range(20): fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / n * 1e6
    return round(host, 1), round(wall, 1)

x = torch.randn(1, 32, 2048, 128, device="cuda").bfloat16()
xs = [torch.randn(1, 32, 2048, 128, device="cuda").bfloat16() for _ in range(4)]
amax = torch.empty(4 * 32, device="cuda")
flat = torch.empty(4 * x.numel(), dtype=torch.float16, device="cuda")
out = amax[:32].view(1, 32)
print("host/wall us per call (no sync inside)")
INF = float("inf")
print("vector_norm plain", host_us(lambda: torch.linalg.vector_norm(x, INF, dim=(2, 3))))
print("vector_norm dtype+out", host_us(lambda: torch.linalg.vector_norm(
    x, INF, dim=(2, 3), dtype=torch.float32, out=out)))
print("amax()", host_us(lambda: x.abs().amax(dim=(2, 3))))
args = (x, x, x, x, amax, flat, 1, 32, *([*x.stride(), 32, 2048, 0] * 4))
grid = (32, 32, 1)
print("_to_fp16 launch", host_us(lambda: ta._to_fp16[grid](*args, ROWS=64, HEAD_DIM=128,
                                                           BLOCK_D=128)))
print("_fp16_copies(x)", host_us(lambda: _fp16_copies(x)))
print("_fp16_copies(4)", host_us(lambda: _fp16_copies(*xs)))
print("torch.empty", host_us(lambda: torch.empty(4 * 32, device="cuda")))
q = x; k = x; v = x
from dtensor_ring_old.kernels.triton_exact import TritonExact as Old
from dtensor_ring.kernels.triton_exact import TritonExact as New
from dtensor_ring.kernels.base import CAUSAL
for name, K in (("old", Old()), ("new", New())):
    o, l = K.forward(q, k, v, CAUSAL, 0.088)
    print(name, "forward", host_us(lambda: K.forward(q, k, v, CAUSAL, 0.088)))
    print(name, "backward", host_us(lambda: K.backward(x, q, k, v, o, l, CAUSAL, 0.088)))
pr = cProfile.Profile(); pr.enable()
for _ in range(200): _fp16_copies(*xs)
pr.disable(); torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(12)
