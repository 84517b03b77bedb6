"""Experiment: does rounding P and dS to fp16 (instead of bf16) for the tensor-core products cut
the exact kernel's error? The Triton kernels round P/dS to the dtype of their inputs, so feeding
them fp16 copies of the bf16 inputs (exact for these magnitudes) answers it without kernel changes.
Also times the kernels both ways and a scaled bf16->fp16 conversion pass."""
import json, sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from dtensor_ring.kernels.triton_exact import TritonExact
from dtensor_ring.numerics import NAMES

dev = "cuda"
kern = TritonExact()


def inputs(seed, s, h, d, outliers):
    g = torch.Generator(device=dev).manual_seed(seed)
    xs = []
    for _ in range(4):
        x = torch.randn(1, h, s, d, generator=g, device=dev)
        if outliers:
            x = x + torch.randn(1, h, s, d, generator=g, device=dev) * 10 * (
                torch.rand(1, h, s, d, generator=g, device=dev) < 0.001)
        xs.append(x.bfloat16())
    return xs


def cudnn(q, k, v, do):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    o.backward(do)
    return [o, q.grad, k.grad, v.grad]


def ref64(q, k, v, do):
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    o.backward(do.double())
    return [o.detach(), q.grad, k.grad, v.grad]


def triton(q, k, v, do, dtype):
    q, k, v, do = (x.to(dtype) for x in (q, k, v, do))
    scale = q.shape[-1] ** -0.5
    o, lse = kern.forward(q, k, v, "causal", scale)
    dq, dk, dv = kern.backward(do, q, k, v, o, lse, "causal", scale)
    return [x.to(torch.bfloat16) for x in (o, dq, dk, dv)]


def err(r, ref):
    e = r.double() - ref
    return e.norm().item() / ref.norm().item(), e.abs().max().item()


def accuracy(s, h, d, seeds):
    rows = []
    for outliers in (False, True):
        for seed in range(seeds):
            q, k, v, do = inputs(seed, s, h, d, outliers)
            ref = ref64(q, k, v, do)
            base = [err(r, x) for r, x in zip(cudnn(q, k, v, do), ref)]
            row = {"inputs": "outliers" if outliers else "normal", "seed": seed}
            for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
                es = [err(r, x) for r, x in zip(triton(q, k, v, do, dt), ref)]
                row[name] = {n: [round(e[0] / b[0], 3), round(e[1] / b[1], 3)]
                             for n, e, b in zip(NAMES, es, base)}
            print(json.dumps(row), flush=True)
            rows.append(row)
            del ref
            torch.cuda.empty_cache()
    return rows


def ms(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = []
    for _ in range(iters):
        st.record(); fn(); en.record(); torch.cuda.synchronize(); t.append(st.elapsed_time(en))
    return sorted(t)[len(t) // 2]


def speed(s, h, d):
    q, k, v, do = inputs(0, s, h, d, False)
    scale = d ** -0.5
    out = {}
    for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        qq, kk, vv, dd = (x.to(dt) for x in (q, k, v, do))
        o, lse = kern.forward(qq, kk, vv, "causal", scale)
        out[name] = {"fwd": ms(lambda: kern.forward(qq, kk, vv, "causal", scale)),
                     "bwd": ms(lambda: kern.backward(dd, qq, kk, vv, o, lse, "causal", scale))}
    def convert():
        lo, hi = torch.aminmax(q)
        amax = torch.maximum(-lo, hi).float()
        e = torch.frexp(amax)[1]
        sc = torch.ldexp(torch.ones_like(amax), 15 - e)
        return (q * sc).half()
    out["convert_ms"] = ms(convert)
    out["aminmax_ms"] = ms(lambda: torch.aminmax(q))
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    res = {"accuracy": accuracy(8192, 8, 128, int(sys.argv[2])), "speed": speed(16384, 32, 128)}
    json.dump(res, open(sys.argv[1], "w"), indent=1)
