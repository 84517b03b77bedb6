"""CPU float64 emulation of the backward's tensor-core products (S = 2048, 4 heads, d = 128, causal):
dq = dS K, dk = dS^T Q, dv = P^T dO with P / dS rounded to bf16 (what the kernels do), to fp16, or not
at all, then the gradients cast to bf16. Prints each variant's rel-RMS and max-abs error against float64
as a ratio to the bf16 variant's, three seeds, normal and outlier inputs (outliers N(0,10) here).

    python cpu_emulation.py > cpu_emulation.txt
"""
import torch, math
S, H, D = 2048, 4, 128
def run(seed, outliers=False):
    g = torch.Generator().manual_seed(seed)
    def mk():
        x = torch.randn(H, S, D, generator=g, dtype=torch.float64)
        if outliers:
            x = x + torch.randn(H, S, D, generator=g, dtype=torch.float64) * 10 * (torch.rand(H, S, D, generator=g) < 0.001)
        return x.to(torch.bfloat16).double()
    q, k, v, do = mk(), mk(), mk(), mk()
    scale = D ** -0.5
    s = q @ k.transpose(-1, -2) * scale
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    s = s.masked_fill(~mask, -math.inf)
    p = torch.softmax(s, -1)
    o = p @ v
    delta = (do * o).sum(-1, keepdim=True)
    dp = do @ v.transpose(-1, -2)
    ds = p * (dp - delta)
    ref = dict(dq=ds @ k * scale, dk=ds.transpose(-1, -2) @ q * scale, dv=p.transpose(-1, -2) @ do)
    res = {}
    for name, r in [("bf16", torch.bfloat16), ("fp16", torch.float16), ("none", None)]:
        rd = (lambda x: x.to(r).double()) if r else (lambda x: x)
        out = dict(dq=rd(ds) @ k * scale, dk=rd(ds).transpose(-1, -2) @ q * scale, dv=rd(p).transpose(-1, -2) @ do)
        res[name] = {t: out[t].to(torch.bfloat16).double() - ref[t] for t in out}
    return ref, res
for outl in (False, True):
    for seed in range(3):
        ref, res = run(seed, outl)
        line = []
        for t in ("dq", "dk", "dv"):
            base = res["bf16"][t]
            for name in ("fp16", "none"):
                e = res[name][t]
                line.append(f"{t} {name}: rms {e.norm()/base.norm():.3f} max {e.abs().max()/base.abs().max():.3f}")
        print("outliers" if outl else "normal", seed, " | ".join(line))
