"""The split-keys test of tests/test_kernels.py for the efficient kernel, varied."""
import torch
import torch.nn.functional as F
from dtensor_ring.kernels.efficient import Efficient
from dtensor_ring.kernels.base import NONE
from dtensor_ring.merge import init_, merge_

K = Efficient()
SCALE = 64 ** -0.5


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def case(dtype, sq, kvh, seed=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(2, 4, sq, 64), (2, kvh, 128, 64), (2, kvh, 128, 64), (2, 4, sq, 64)]
    q64, k64, v64, d64 = [torch.randn(s, generator=gen, device="cuda", dtype=torch.float64)
                          for s in shapes]
    qq, kk, vv = (x.clone().requires_grad_() for x in (q64, k64, v64))
    o = F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True)
    o.backward(d64)
    ref = [o.detach(), qq.grad, kk.grad, vv.grad]
    q, k, v, dout = (x.to(dtype) for x in (q64, k64, v64, d64))
    halves = (slice(0, 64), slice(64, 128))
    out = torch.empty(q.shape, dtype=torch.float32, device="cuda")
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device="cuda")
    for i, cols in enumerate(halves):
        (init_ if i == 0 else merge_)(out, lse, *K.forward(q, k[:, :, cols], v[:, :, cols], NONE, SCALE))
    res = {}
    for out_kind in ("bf16 merged", "fp32 merged->dtype"):
        o_in = out.to(dtype)
        dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device="cuda") for x in (q, k, v))
        for cols in halves:
            a, b, c = K.backward(dout, q, k[:, :, cols], v[:, :, cols], o_in, lse, NONE, SCALE)
            dq += a
            dk[:, :, cols] += b
            dv[:, :, cols] += c
        res[out_kind] = [rel(x, r) for x, r in zip((o_in, dq, dk, dv), ref)]
        break
    # the same, keys whole (no split): merged lse equals own lse up to rounding
    o1, l1 = K.forward(q, k, v, NONE, SCALE)
    g = K.backward(dout, q, k, v, o1.to(dtype), l1, NONE, SCALE)
    res["whole"] = [rel(x, r) for x, r in zip((o1, *g), ref)]
    # whole keys, but lse from the merge
    g = K.backward(dout, q, k, v, out.to(dtype), lse, NONE, SCALE)
    res["whole, merged lse"] = [rel(x, r) for x, r in zip((out, *g), ref)]
    # one half only, with that half's own out and lse (a complete attention over those keys)
    oh, lh = K.forward(q, k[:, :, :64], v[:, :, :64], NONE, SCALE)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q64, k64[:, :, :64], v64[:, :, :64]))
    o = F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True)
    o.backward(d64)
    g = K.backward(dout, q, k[:, :, :64], v[:, :, :64], oh.to(dtype), lh, NONE, SCALE)
    res["half keys, own"] = [rel(x, r) for x, r in zip((oh, *g), (o, qq.grad, kk.grad, vv.grad))]
    # the half's own lse but as a strided view vs contiguous: k half contiguous copy
    g = K.backward(dout, q, k[:, :, :64].contiguous(), v[:, :, :64].contiguous(), oh.to(dtype), lh, NONE, SCALE)
    res["half keys, own, contiguous kv"] = [rel(x, r) for x, r in zip((oh, *g), (o, qq.grad, kk.grad, vv.grad))]
    for name, r in res.items():
        print(f"{str(dtype):15} sq={sq:3} kvh={kvh} {name:32} " + " ".join(f"{x:.2e}" for x in r))


for dtype in (torch.bfloat16, torch.float32):
    for sq in (40, 64):
        for kvh in (2, 4):
            case(dtype, sq, kvh)
