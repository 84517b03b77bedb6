"""A small RoPE transformer written for the tests, not by the package: a fused QKV projection, GQA,
rotary embeddings computed inside each attention module from ``position_ids``, pre-LayerNorm
blocks with a GELU MLP and ``F.scaled_dot_product_attention(..., is_causal=True)`` -- the shape of
a model a user brings, unlike ``dtensor_ring.models.Llama``.

``forward(input_ids, position_ids=None, labels=None, num_items_in_batch=None)`` returns
``(logits, loss)``; ``loss`` is the cross-entropy summed over this call's counted tokens (labels
already shifted, -100 ignored) / ``num_items_in_batch`` (default: their count, the mean), None
without labels -- the convention of transformers' models, which ``ContextParallel`` fills in.
"""
import torch
import torch.nn.functional as F
from torch import nn


class RotaryAttention(nn.Module):
    def __init__(self, dim, heads, kv_heads, base=500.0):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim)
        self.proj = nn.Linear(heads * self.head_dim, dim)
        self.register_buffer("inv_freq", base ** -(torch.arange(0, self.head_dim, 2) /
                                                   self.head_dim), persistent=False)

    def _rotate(self, x, position_ids):
        angles = position_ids[:, None, :, None].to(x.dtype) * self.inv_freq.to(x.dtype)
        cos, sin = angles.cos(), angles.sin()
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2)

    def forward(self, x, position_ids):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, -1, self.head_dim).transpose(1, 2).split(
            [self.heads, self.kv_heads, self.kv_heads], dim=1)
        q, k = self._rotate(q, position_ids), self._rotate(k, position_ids)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = RotaryAttention(dim, heads, kv_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, position_ids):
        x = x + self.attn(self.norm1(x), position_ids)
        return x + self.mlp(self.norm2(x))


class RopeTransformer(nn.Module):
    def __init__(self, vocab=128, dim=64, heads=4, kv_heads=2, layers=2):
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, position_ids=None, labels=None, num_items_in_batch=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(
                input_ids)
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h, position_ids)
        logits = self.head(self.norm(h))
        if labels is None:
            return logits, None
        total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        return logits, total / ((labels != -100).sum() if num_items_in_batch is None
                                else num_items_in_batch)
