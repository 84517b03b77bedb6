"""Plain-PyTorch attention in fp32 (any device, any float dtype): the fallback where no fused kernel
fits, e.g. fp32 inputs on CUDA. Softmax statistics and products are fp32; outputs are cast back."""
import torch

from .base import CAUSAL, MASKS, NONE, BlockKernel, repeat_kv, sum_kv_groups


def _scores(q, k, mask, scale):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask != NONE:
        sq, sk = s.shape[-2:]
        diagonal = 0 if mask == CAUSAL else sk - sq
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril(diagonal)
        s = s.masked_fill(~allowed, float("-inf"))
    return s


class Math(BlockKernel):
    name = "math"
    masks = MASKS

    def available(self, device, dtype, head_dim):
        return dtype.is_floating_point

    def forward(self, q, k, v, mask, scale):
        groups = q.shape[1] // k.shape[1]
        s = _scores(q, repeat_kv(k, groups), mask, scale)
        lse = torch.logsumexp(s, dim=-1)
        out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), repeat_kv(v, groups).float())
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        groups = q.shape[1] // k.shape[1]
        kf, vf, dof = repeat_kv(k, groups).float(), repeat_kv(v, groups).float(), dout.float()
        p = torch.exp(_scores(q, kf, mask, scale) - lse.unsqueeze(-1))
        dv = torch.matmul(p.transpose(-1, -2), dof)
        dp = torch.matmul(dof, vf.transpose(-1, -2))
        delta = (dof * out.float()).sum(-1, keepdim=True)
        ds = p * (dp - delta) * scale
        dq = torch.matmul(ds, kf)
        dk = torch.matmul(ds.transpose(-1, -2), q.float())
        return (dq.to(q.dtype), sum_kv_groups(dk, groups).to(k.dtype),
                sum_kv_groups(dv, groups).to(v.dtype))
