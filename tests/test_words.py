"""kernels/words.py: strided copies, fills and row reversals in machine words give torch's
results, bit for bit."""
import pytest
import torch

from dtensor_ring.kernels.words import as_words, copied, flipped_rows, gathered_rows, stacked, zero_


def _rows(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype,head_dim,word", [
    (torch.bfloat16, 128, torch.complex128),  # 256-byte rows: 16-byte words
    (torch.float32, 6, torch.int64),          # 24-byte rows: 8-byte words
    (torch.float16, 3, torch.int16),          # 6-byte rows: 2-byte words
])
def test_stacked_is_torch_stack_of_permuted_heads(dtype, head_dim, word):
    # llama3's message: K and V heads [B, Hg, S, D] permuted to [S, B, Hg, D], stacked on dim 1
    k, v = (_rows(2, 8, 5, head_dim, dtype=dtype, seed=s)[:, 2:6] for s in (0, 1))
    parts = [x.permute(2, 0, 1, 3) for x in (k, v)]
    assert as_words(*parts)[0].dtype == word
    got = stacked(parts, 1)
    assert torch.equal(got, torch.stack(parts, 1))
    assert not torch.equal(got, torch.stack(parts[::-1], 1))  # the check can fail


def test_words_fit_every_offset_and_stride():
    # rows of 8 bf16 (16 bytes): one 16-byte word each, unless an offset or a stride is odd
    x = _rows(4, 10, dtype=torch.bfloat16)
    assert as_words(x[:, :8].contiguous())[0].dtype == torch.complex128
    assert as_words(x[:, :8])[0].dtype == torch.int32  # rows 20 bytes apart
    assert as_words(x[:, :8].contiguous(), x[:, 1:9])[0].dtype == torch.int16  # offset 2 bytes


def test_copied_is_the_reshape():
    gathered = _rows(4, 6, 2, 1, 3, 16, dtype=torch.bfloat16)  # [W, S, 2, B, Hg, D]
    got = copied(gathered, lambda x: x[:3, :3].flatten(0, 1))
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, gathered[:3, :3].flatten(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_rows_is_index_select(dtype):
    # llama3's natural order: gathered [W * R, 2, B, Hg, D] rows in a permuted order
    x = _rows(12, 2, 1, 3, 16, dtype=dtype)
    index = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    assert torch.equal(gathered_rows(x, index), x.index_select(0, index))
    assert not torch.equal(gathered_rows(x, index), x.index_select(0, index.flip(0)))  # can fail
    strided = x.transpose(0, 1)[0]  # not dense: copied first, the same rows
    assert torch.equal(gathered_rows(strided, index), strided.index_select(0, index))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_fills_exactly_the_view(dtype):
    x = _rows(2, 3, 10, 8, dtype=dtype)
    expected = x.clone()
    expected[:, :, 4:7] = 0
    zero_(x[:, :, 4:7])
    assert torch.equal(x, expected)
    transposed = _rows(2, 8, 3, dtype=dtype).transpose(1, 2)  # last dim strided: torch's fill
    zero_(transposed[:, 1:])
    assert torch.count_nonzero(transposed[:, 1:]) == 0 and torch.count_nonzero(transposed[:, 0])


@pytest.mark.parametrize("dtype,head_dim,word", [
    (torch.bfloat16, 128, torch.complex128),  # 256-byte rows: 16-byte words
    (torch.float32, 6, torch.int64),          # 24-byte rows: 8-byte words
    (torch.float16, 3, torch.int16),          # 6-byte rows: 2-byte words
])
def test_flipped_rows_is_flip(dtype, head_dim, word):
    # a reversed edge block's operands: a row slice of q [B, H, S, D], the same in a model's
    # [B, S, H, D] memory (transposed), and the kernel's results
    q = _rows(2, 4, 9, head_dim, dtype=dtype)[:, :, 2:7]
    model = _rows(2, 9, 4, head_dim, dtype=dtype).transpose(1, 2)[:, :, 2:7]
    assert as_words(q)[0].dtype == word
    for x in (q, model, q.contiguous()):
        got = flipped_rows(x)
        assert got.dtype == x.dtype and torch.equal(got, x.flip(2))
        assert not torch.equal(got, x.flip(1))  # the check can fail


def test_flipped_rows_without_words_is_flip():
    # an expanded gradient (last stride 0), an LSE [B, H, S], a non-contiguous last dim
    dout = torch.ones(1, 1, 1, 1).expand(2, 4, 5, 8)
    lse = _rows(2, 4, 5, dtype=torch.float32)
    strided = _rows(2, 4, 5, 16, dtype=torch.float32)[..., ::2]
    for x in (dout, lse, strided):
        assert torch.equal(flipped_rows(x), x.flip(2))
    assert not torch.equal(flipped_rows(lse), lse)


def test_flipped_rows_traced_is_flip():
    # the compile pass traces the schedules with make_fx over functionalize (fake tensors in
    # plain-tensor wrappers): the traced graph keeps flip in the tensor's own dtype, for
    # inductor to write (it generates no code for complex dtypes)
    from torch.fx.experimental.proxy_tensor import make_fx
    with torch._subclasses.FakeTensorMode() as mode:
        fake = mode.from_tensor(_rows(1, 2, 8, 128, dtype=torch.bfloat16))
        graph = make_fx(torch.func.functionalize(flipped_rows))(fake)
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.aten.flip.default], targets
