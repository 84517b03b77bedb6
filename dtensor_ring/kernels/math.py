"""Plain-PyTorch attention in fp32 (any device, any float dtype): the fallback where no fused kernel
fits, e.g. fp32 inputs on CUDA. Softmax statistics and products are fp32; outputs are cast back.
Packed documents and sliding windows go in as a dense mask (``segments.py``, ``windows.py``)."""
import torch

from .base import CAUSAL, MASKS, NONE, BlockKernel, repeat_kv, sum_kv_groups
from .segments import visible
from .windows import BAND, POSITIONS
from .windows import visible as window_visible


def _seen(sq, sk, mask, segments, window, device):
    """[Sq, Sk] booleans of which q row sees which key, or None for "all"."""
    if window is not None:
        seen = _seen(sq, sk, mask, segments, None, device)
        in_window = window_visible(window, sq, sk, device)
        return in_window if seen is None else seen & in_window
    if segments is not None:
        return visible(segments, sq, sk, mask)
    if mask == NONE:
        return None
    diagonal = 0 if mask == CAUSAL else sk - sq
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(diagonal)


def _scores(q, k, mask, scale, segments, window):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    seen = _seen(s.shape[-2], s.shape[-1], mask, segments, window, s.device)
    return s if seen is None else s.masked_fill(~seen, float("-inf"))


def _probabilities(s, lse):
    """exp(s - lse), 0 in rows that see no key (s and lse both -inf there)."""
    return torch.exp(s - lse.unsqueeze(-1)).nan_to_num(nan=0.0)


class Math(BlockKernel):
    name = "math"
    masks = MASKS
    documents = True
    windows = (BAND, POSITIONS)

    def available(self, device, dtype, head_dim):
        return dtype.is_floating_point

    def forward(self, q, k, v, mask, scale, segments=None, window=None):
        groups = q.shape[1] // k.shape[1]
        s = _scores(q, repeat_kv(k, groups), mask, scale, segments, window)
        lse = torch.logsumexp(s, dim=-1)
        out = torch.matmul(_probabilities(s, lse), repeat_kv(v, groups).float())
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, mask, scale, segments=None, window=None):
        groups = q.shape[1] // k.shape[1]
        kf, vf, dof = repeat_kv(k, groups).float(), repeat_kv(v, groups).float(), dout.float()
        p = _probabilities(_scores(q, kf, mask, scale, segments, window), lse)
        dv = torch.matmul(p.transpose(-1, -2), dof)
        dp = torch.matmul(dof, vf.transpose(-1, -2))
        delta = (dof * out.float()).sum(-1, keepdim=True)
        ds = p * (dp - delta) * scale
        dq = torch.matmul(ds, kf)
        dk = torch.matmul(ds.transpose(-1, -2), q.float())
        return (dq.to(q.dtype), sum_kv_groups(dk, groups).to(k.dtype),
                sum_kv_groups(dv, groups).to(v.dtype))
