"""Strided copies, gathers, fills and reversals of whole rows, done in machine words.

A tensor whose last dim (a row of D elements: a head's vector) is contiguous but whose other dims
are strided (llama3's reorders of gathered K/V, a row slice of an accumulator) is copied or filled
element by element by PyTorch's strided kernels. Viewed in the widest word that divides a row's
bytes (16 bytes for D = 128 in bf16: 8x fewer elements), the same copies ran faster than the
cat + flip + reshape they replaced in llama3's ``to_natural`` (measured: docs/design.md,
"Measurements behind design choices").
"""
import torch
from torch._subclasses.fake_tensor import is_fake

# Machine words to move a row of D elements in: the widest that divides the row's bytes.
_WORDS = ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16),
          (1, torch.uint8))


def as_words(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``xs`` (same last dim and dtype, last dim contiguous) with their last dim viewed in the
    widest word that divides its bytes and every one's offset and strides (one word for all, so
    that they can be copied into each other).
    """
    size = xs[0].element_size()
    spans = [xs[0].shape[-1] * size] + [n * size for x in xs
                                        for n in (x.storage_offset(), *x.stride()[:-1])]
    # Traced (the compile pass) the copies go to inductor, which generates no code for complex
    # dtypes (it warns and falls back): 8-byte words there.
    words = _WORDS[1:] if is_fake(xs[0]) else _WORDS
    word = next(dtype for bytes_, dtype in words if all(n % bytes_ == 0 for n in spans))
    return tuple(x.view(word) for x in xs)


def stacked(tensors, dim: int) -> torch.Tensor:
    """``torch.stack(tensors, dim)`` (same shape and dtype, last dim contiguous; dim not the
    last) as one copy per tensor in words: a message of permuted K/V heads is a strided copy,
    which ``torch.stack`` moved element by element (a visible share of llama3's forward:
    docs/design.md, "Measurements behind design choices"). Traced (the compile pass),
    ``torch.stack``: inductor writes the copy kernel itself."""
    first = tensors[0]
    if is_fake(first):
        return torch.stack(tensors, dim)
    out = first.new_empty(*first.shape[:dim], len(tensors), *first.shape[dim:])
    for i, x in enumerate(tensors):
        target, source = as_words(out.select(dim, i), x)
        target.copy_(source)
    return out


def copied(x: torch.Tensor, reorder) -> torch.Tensor:
    """``reorder(x)`` (a reshape of a strided view: a copy), copied in words."""
    (words,) = as_words(x)
    return reorder(words).view(x.dtype)


def gathered_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x.index_select(0, index)``, each slice along dim 0 moved in words (llama3's reorders of
    gathered sequence-major K/V and their gradients); traced, as it is (inductor writes the gather
    itself)."""
    if is_fake(x):
        return x.index_select(0, index)
    (words,) = as_words(x.reshape(x.shape[0], -1))  # a view for a dense x (the gathered buffers)
    return words.index_select(0, index).view(x.dtype).view(-1, *x.shape[1:])


def zero_(x: torch.Tensor) -> None:
    """``x.zero_()``, in words where its last dim is contiguous (all-zero bits are 0 in every
    float dtype); traced, as it is (inductor writes the fill itself)."""
    (x if is_fake(x) or x.stride(-1) != 1 else as_words(x)[0]).zero_()


def flipped_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.flip(2)``: [B, H, S, D] with its rows (dim 2) in reverse order, moved in words where
    its last dim is contiguous. PyTorch's flip computes a source index per element; a row of D =
    128 bf16 moves as 8 words of 16 bytes (the reversed edge blocks of a sliding window flip
    q, k, v, dO, O and their results: ``kernels/windows.reversed_forward``). Traced (the compile
    pass), and where the last dim is not contiguous (an expanded gradient) or there is none (an
    LSE [B, H, S]), ``flip`` as it is: inductor writes the traced copy itself. (``is_fake``, not
    a test of the tensor's type: the pass traces through ``torch.func.functionalize``, whose
    wrappers are plain tensors.)"""
    if x.dim() != 4 or x.stride(-1) != 1 or is_fake(x):
        return x.flip(2)
    (words,) = as_words(x)
    return words.flip(2).view(x.dtype)
