"""Argument checks shared by the public functions: each error names the argument, its value, and
what would be valid."""
import torch

PRECISIONS = ("fp32", "exact")  # see kernels/__init__.py and kernels/base.py


def check_int(value, arg: str, minimum: int, valid: str) -> None:
    """``value`` must be an int (not a bool) of at least ``minimum``; the error reads
    "{arg}={value!r} must be {valid}"."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{arg}={value!r} must be {valid}")


def check_tensor(x, arg: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor; got {type(x).__name__}")


def normalize_dim(x: torch.Tensor, dim: int, arg: str = "dim") -> int:
    """``dim`` of ``x`` as a non-negative index; ValueError if out of range."""
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{arg}={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def check_qkv(q, k, v) -> None:
    """q [B, Hq, S, D]; k, v [B, Hkv, S, D] with Hq % Hkv == 0, one float dtype and one device."""
    for name, x in (("query", q), ("key", k), ("value", v)):
        check_tensor(x, name)
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq, head_dim]; got shape "
                             f"{tuple(x.shape)}")
        if not x.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor; got dtype {x.dtype}")
    for name, x in (("key", k), ("value", v)):
        if x.dtype != q.dtype:
            raise ValueError(f"{name}.dtype={x.dtype} differs from query.dtype={q.dtype}; "
                             "all three must match")
        if x.device != q.device:
            raise ValueError(f"{name}.device={x.device} differs from query.device={q.device}; "
                             "all three must match")
        if x.shape[0] != q.shape[0]:
            raise ValueError(f"{name} has batch {x.shape[0]} but query has batch {q.shape[0]}; "
                             "they must match")
        if x.shape[2] != q.shape[2]:
            raise ValueError(f"{name} has local sequence length {x.shape[2]} but query has "
                             f"{q.shape[2]}; the ring needs them equal")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"key has head_dim {k.shape[3]} but query has {q.shape[3]}; they must "
                         "match")
    if v.shape != k.shape:
        raise ValueError(f"value has shape {tuple(v.shape)} but key has {tuple(k.shape)}; they "
                         "must be equal (K and V travel together)")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"key/value heads ({k.shape[1]}) must divide query heads ({q.shape[1]})")


def check_precision(precision) -> None:
    """``precision`` must be one of ``PRECISIONS`` (every entry point checks it through here)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not supported; valid: {list(PRECISIONS)}")


def check_options(*, is_causal, scale, precision, attn_mask, dropout_p) -> None:
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool; got {is_causal!r}")
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale={scale!r} must be None or a positive number")
    check_precision(precision)
    if attn_mask is not None:
        raise ValueError("attn_mask is not supported by the ring schedules (got a "
                         f"{type(attn_mask).__name__}); use is_causal=True or no mask")
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p={dropout_p!r} is not supported by the ring schedules; "
                         "valid: 0.0")
