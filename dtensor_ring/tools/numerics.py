"""Float64 references and error ratios, shared by the tests, the accuracy check job and the benchmarks.

Tolerances are relative to the single-device kernel's own error on the same inputs (rel-RMS against
float64): splitting the sequence may add little error on top of what the kernel already makes.
  * fp32 inputs: <= 1.15x the kernel's rel-RMS (the fp32 merge and the sums of per-block dk/dv add
    rounding of the same order as the kernel's own: measured up to 1.12x on dv over 64 simulated
    W = 3 cases on an AVX-512 CPU (torch 2.11), where the CPU kernel's own error is smaller,
    and <= 1.03x on an AVX2 one (torch 2.13); a wrong schedule is 10x to 1000x off).
  * bf16 inputs with fp32 merge: <= 1.25x (each block's output and gradients come back rounded to
    bf16 before the fp32 merge/sum; that is the growth ``precision="exact"`` removes).
A deliberately wrong schedule lands far outside these (tests/test_simulate.py).
"""
import torch
import torch.nn.functional as F

TOLERANCE = {torch.float32: 1.15, torch.bfloat16: 1.25, torch.float16: 1.25}
NAMES = ("out", "dq", "dk", "dv")


def make_inputs(batch, q_heads, kv_heads, seq, head_dim, seed=0):
    """Whole-sequence q, k, v and an upstream gradient, float64, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, q_heads, seq, head_dim), (batch, kv_heads, seq, head_dim),
              (batch, kv_heads, seq, head_dim), (batch, q_heads, seq, head_dim)]
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


def fwd_bwd(fn, q, k, v, dout):
    """out, dq, dk, dv of ``fn(q, k, v)`` backpropagating ``dout``, on fresh leaves."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def attention_and_grads(fn, q, k, v, dout, dtype):
    """``fwd_bwd`` on inputs cast to ``dtype``."""
    return fwd_bwd(fn, *(x.to(dtype) for x in (q, k, v)), dout.to(dtype))


def errors(results, reference):
    """rel-RMS and max-abs error of out, dq, dk, dv against ``reference``."""
    return {n: {"rel_rms": rel_rms(r, ref), "max_abs": (r.double() - ref).abs().max().item()}
            for n, r, ref in zip(NAMES, results, reference)}


def sdpa(is_causal):
    """The single-device kernel (PyTorch's SDPA, which on CPU runs the same flash kernel)."""
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=is_causal,
                                                          enable_gqa=True)


def document_sdpa(is_causal, cu_seqlens):
    """The single-device kernel on packed documents: SDPA on each document alone (what a
    block-diagonal mask means), the results concatenated along the sequence."""
    bounds = [int(b) for b in cu_seqlens]

    def fn(q, k, v):
        return torch.cat([sdpa(is_causal)(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])
                          for a, b in zip(bounds, bounds[1:])], dim=2)
    return fn


def rel_rms(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def ratios(results, kernel_results, reference):
    """rel-RMS of ``results`` over rel-RMS of ``kernel_results``, each against ``reference``."""
    return {name: rel_rms(r, ref) / rel_rms(s, ref)
            for name, r, s, ref in zip(NAMES, results, kernel_results, reference)}


def check_ratios(ratio_by_name, dtype, where=""):
    limit = TOLERANCE[dtype]
    bad = {n: round(r, 3) for n, r in ratio_by_name.items() if not r <= limit}
    assert not bad, f"{where}: error ratio to the single-device kernel above {limit}: {bad}"
