"""The ways of putting all-gathered zigzag shards in natural order (and back) that were timed for
llama3 (this folder's README); "(now)" is the package's to_natural / to_rank_major, which at the time
of the run (commit c68386d's tree) were the cat + flip + reshape versions. Each variant is checked
equal to it first. Run on one CUDA GPU with the package importable: ``python perm_bench.py``."""
import statistics

import torch

from dtensor_ring.schedules.llama3 import to_natural, to_rank_major

WIDE = {16: torch.complex128, 8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

def widen(x):
    nbytes = x.shape[-1] * x.element_size()
    for size, dt in WIDE.items():
        if nbytes % size == 0 and x.data_ptr() % size == 0:
            return x.view(dt)

def nat_index(g, wide=True):
    W, C = g.shape[0], g.shape[-2] // 2
    x = widen(g) if wide else g
    lead = x.shape[1:-2]
    perm = x.view(W, *lead, 2, C, x.shape[-1]).movedim(0, -4)
    w_idx = torch.cat([torch.arange(W), torch.arange(W).flip(0)]).to(g.device)
    j_idx = torch.tensor([0] * W + [1] * W, device=g.device)
    out = perm[..., w_idx, j_idx, :, :]
    return out.reshape(*lead, 2 * W * C, x.shape[-1]).view(g.dtype)

def nat_copies(g, wide=True):
    W, C = g.shape[0], g.shape[-2] // 2
    x = widen(g) if wide else g
    lead = x.shape[1:-2]
    perm = x.view(W, *lead, 2, C, x.shape[-1]).movedim(0, -4)
    out = x.new_empty(*lead, 2 * W, C, x.shape[-1])
    out[..., :W, :, :].copy_(perm[..., :, 0, :, :])
    for w in range(W):
        out[..., 2 * W - 1 - w, :, :].copy_(perm[..., w, 1, :, :])
    return out.view(*lead, 2 * W * C, x.shape[-1]).view(g.dtype)

def rm_copies(n, W, wide=True):
    x = widen(n) if wide else n
    lead, C = x.shape[:-2], x.shape[-2] // (2 * W)
    n6 = x.view(*lead, 2 * W, C, x.shape[-1])
    out = x.new_empty(W, *lead, 2, C, x.shape[-1])
    perm = out.movedim(0, -4)
    perm[..., :, 0, :, :].copy_(n6[..., :W, :, :])
    for w in range(W):
        perm[..., w, 1, :, :].copy_(n6[..., 2 * W - 1 - w, :, :])
    return out.view(W, *lead, 2 * C, x.shape[-1]).view(n.dtype)

def rm_index(n, W, wide=True):
    x = widen(n) if wide else n
    lead, C = x.shape[:-2], x.shape[-2] // (2 * W)
    n6 = x.view(*lead, 2 * W, C, x.shape[-1])
    idx = torch.tensor([[w, 2 * W - 1 - w] for w in range(W)], device=n.device)
    out = x.new_empty(W, *lead, 2, C, x.shape[-1])
    out.movedim(0, -4).copy_(n6[..., idx, :, :])
    return out.view(W, *lead, 2 * C, x.shape[-1]).view(n.dtype)

def t(fn, iters=20):
    for _ in range(3): fn()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)

for W, hg, s in ((2, 16, 16384), (4, 8, 16384), (2, 4, 16384)):
    g = torch.randn(W, 2, 1, hg, s, 128, device="cuda").bfloat16()
    ref = to_natural(g)
    n = torch.randn(2, 1, hg, W * s, 128, device="cuda")
    ref_rm = to_rank_major(n, W)
    mb = g.numel() * 2 / 1e6
    print(f"W={W} heads/group={hg} S_local={s}: gathered {mb:.0f} MB bf16, natural dkv {n.numel()*4/1e6:.0f} MB fp32")
    for name, fn in [("to_natural (now)", lambda: to_natural(g)), ("index bf16", lambda: nat_index(g, False)),
                     ("index wide", lambda: nat_index(g)), ("copies bf16", lambda: nat_copies(g, False)),
                     ("copies wide", lambda: nat_copies(g))]:
        assert torch.equal(fn(), ref), name
        ms = t(fn); print(f"  {name:20} {ms:7.3f} ms  {2*mb/ms/1e3:6.2f} TB/s")
    mb = n.numel() * 4 / 1e6
    for name, fn in [("to_rank_major (now)", lambda: to_rank_major(n, W)), ("rm copies fp32", lambda: rm_copies(n, W, False)),
                     ("rm copies wide", lambda: rm_copies(n, W)), ("rm index wide", lambda: rm_index(n, W))]:
        assert torch.equal(fn(), ref_rm), name
        ms = t(fn); print(f"  {name:20} {ms:7.3f} ms  {2*mb/ms/1e3:6.2f} TB/s")
    print("  plain contiguous copy bf16", f"{t(lambda: g.clone()):.3f} ms")
