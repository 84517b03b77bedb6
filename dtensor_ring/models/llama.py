"""A small Llama-style decoder: RMSNorm, RoPE from ``position_ids``, GQA attention through
``F.scaled_dot_product_attention(..., is_causal=True)``, SwiGLU MLP, tied or untied LM head.

The default config has about 1M parameters at 2 layers. Attention reshapes with ``-1`` heads, so a
tensor-parallel plan that shards the q/k/v projections column-wise (heads) works unchanged.

``forward(input_ids, position_ids=None, labels=None, num_items_in_batch=None)``:
``position_ids`` default to 0..S-1; ``labels`` are aligned with ``input_ids`` (already shifted:
``labels[t]`` is the token after ``input_ids[t]``; -100 is ignored) and give the cross-entropy
summed over the counted tokens and divided by ``num_items_in_batch`` (default: their count, the
mean). Under ``ContextParallel`` the style passes the whole batch's count / W, so the mean of the
ranks' losses is the batch's mean however the -100 labels fall (``dtensor_ring/loss.py``).
"""
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    vocab_size: int = 512
    dim: int = 192
    n_layers: int = 2
    n_heads: int = 6
    n_kv_heads: int = 2
    hidden_dim: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class LlamaOutput(NamedTuple):
    logits: torch.Tensor
    loss: torch.Tensor | None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype):
    """cos, sin of shape [B, 1, S, head_dim] for integer positions [B, S] (or [S])."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64,
                                            device=position_ids.device) / head_dim)
    angles = position_ids.to(torch.float64).unsqueeze(-1) * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    if angles.dim() == 2:
        angles = angles.unsqueeze(0)
    return angles.cos().to(dtype).unsqueeze(1), angles.sin().to(dtype).unsqueeze(1)


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or LlamaConfig()
        if cfg.dim % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
            raise ValueError(f"dim={cfg.dim}, n_heads={cfg.n_heads}, n_kv_heads="
                             f"{cfg.n_kv_heads}: n_heads must divide dim and n_kv_heads n_heads")
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=1.0)

    def forward(self, input_ids, position_ids=None, labels=None,
                num_items_in_batch=None) -> LlamaOutput:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device)
        h = self.tok_embeddings(input_ids)
        cos, sin = rope_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(),
                                   ignore_index=-100, reduction="sum")
            loss = loss / ((labels != -100).sum() if num_items_in_batch is None
                           else num_items_in_batch)
        return LlamaOutput(logits, loss)
