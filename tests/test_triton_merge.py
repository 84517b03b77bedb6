"""The Triton merge and accumulation (``merge/fused.py``, the CUDA entry of
``merge/online.FP32_OPS``) against the torch ops and float64: on a GPU compiled, on CPU under
TRITON_INTERPRET=1 (set by conftest.py; skipped where triton is not installed).

Tolerance: the torch and Triton forms round differently (exp/log approximations, operation order),
so they agree to a few fp32 ulps, not bit for bit: 2e-6 relative on out and lse of order 1..10.
"""
import pytest
import torch

pytest.importorskip("triton")

from dtensor_ring.merge.online import FP32_OPS, TorchFp32, TritonFp32, init_, merge_  # noqa: E402

torch_merge_, triton_merge_ = TorchFp32.merge_, TritonFp32.merge_

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _buffers(gen, batch, heads, seq, head_dim):
    """fp32 (out, lse) buffers of twice the rows; the merges go into their middle rows."""
    return (torch.randn(batch, heads, 2 * seq, head_dim, generator=gen).to(DEVICE),
            (torch.randn(batch, heads, 2 * seq, generator=gen) * 3).to(DEVICE))


def _rows(buffers, seq):
    """Row-slice views, as the schedules merge them."""
    return [x[:, :, seq // 2:seq // 2 + seq] for x in buffers]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [16, 80])
def test_triton_merge_is_the_torch_merge(dtype, head_dim):
    gen = torch.Generator().manual_seed(0)
    buffers = _buffers(gen, 2, 3, 40, head_dim)
    out, lse = _rows(buffers, 40)
    block_out = torch.randn(2, 3, 40, head_dim, generator=gen).to(dtype).to(DEVICE)
    block_lse = (torch.randn(2, 3, 40, generator=gen) * 3).to(DEVICE)
    block_lse[0, 0, :4] = torch.tensor([400.0, -400.0, float("-inf"), 0.0])  # dominant, negligible
    block_lse = block_lse.unsqueeze(-1)[..., 0]  # a strided view, as cuDNN's LSE is
    expected = [out.clone(), lse.clone()]
    torch_merge_(*expected, block_out, block_lse)
    merged = [x.clone() for x in buffers]
    got = _rows(merged, 40)
    triton_merge_(*got, block_out, block_lse)
    for name, g, e in zip(("out", "lse"), got, expected):
        assert torch.allclose(g, e, rtol=2e-6, atol=2e-6), f"{name}: {(g - e).abs().max()}"
    # block_lse = -inf leaves the row as it was.
    assert torch.equal(got[0][0, 0, 2], out[0, 0, 2]) and got[1][0, 0, 2] == lse[0, 0, 2]
    # Rows outside the views are untouched (the kernel writes through the strides).
    for m, b in zip(merged, buffers):
        assert torch.equal(m[:, :, :20], b[:, :, :20]) and torch.equal(m[:, :, 60:], b[:, :, 60:])


@pytest.mark.parametrize("target_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("blocks", [1, 2, 3])
@pytest.mark.parametrize("in_place", [False, True])
def test_triton_merge_many_is_the_torch_one(target_dtype, blocks, in_place):
    """Every row written once: the rows of each block merged in turn, the others first's as they
    are (in the target's dtype), the lse too; against the torch form, rows outside every block
    exactly first's. In place: written over first (as the forward does, in q's dtype)."""
    gen = torch.Generator().manual_seed(3)
    first = torch.randn(2, 3, 40, 16, generator=gen).to(target_dtype).to(DEVICE)
    first_lse = (torch.randn(2, 3, 40, generator=gen) * 3).to(DEVICE)
    spans = [slice(12, 32), slice(0, 40), slice(20, 30)][:blocks]  # overlapping, as steps do
    parts = []
    for rows in spans:
        n = rows.stop - rows.start
        block_lse = (torch.randn(2, 3, n, generator=gen) * 3).to(DEVICE)
        block_lse[0, 0, :2] = float("-inf")  # rows that saw no key in the block: unchanged
        parts.append((torch.randn(2, 3, n, 16, generator=gen).to(torch.bfloat16).to(DEVICE),
                      block_lse, rows))
    results = []
    for impl in (TorchFp32, TritonFp32):
        target = first.clone() if in_place else torch.empty_like(first)
        lse = first_lse.clone()
        impl.merge_many_(target, lse, target if in_place else first, lse, parts)
        results.append((target, lse))
    (t_torch, l_torch), (t_triton, l_triton) = results
    torch.testing.assert_close(t_triton.float(), t_torch.float(), rtol=2e-6 if target_dtype ==
                               torch.float32 else 1e-2, atol=1e-6)
    torch.testing.assert_close(l_triton, l_torch, rtol=2e-6, atol=1e-6)
    outside = torch.ones(40, dtype=torch.bool)
    for rows in spans:
        outside[rows] = False
    assert torch.equal(t_triton[:, :, outside], first[:, :, outside])
    assert torch.equal(l_triton[:, :, outside], first_lse[:, :, outside])
    if blocks == 1:  # rows 12, 13 saw no key in the only block
        assert torch.equal(t_triton[0, 0, 12:14], first[0, 0, 12:14])


def test_triton_merge_many_gives_the_bits_of_merging_one_block_at_a_time():
    """The forward holds W <= 4 results and merges them in one pass: the same fp32 arithmetic,
    in the same order, as merging each into an fp32 accumulator as it came."""
    gen = torch.Generator().manual_seed(4)
    first = torch.randn(1, 2, 64, 32, generator=gen).to(torch.bfloat16).to(DEVICE)
    first_lse = (torch.randn(1, 2, 64, generator=gen) * 3).to(DEVICE)
    parts = [(torch.randn(1, 2, rows.stop - rows.start, 32, generator=gen).to(torch.bfloat16)
              .to(DEVICE), (torch.randn(1, 2, rows.stop - rows.start, generator=gen) * 3)
              .to(DEVICE), rows) for rows in (slice(0, 64), slice(32, 64), slice(0, 64))]
    out, lse = first.float(), first_lse.clone()
    for block_out, block_lse, rows in parts[:-1]:
        triton_merge_(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
    expected = torch.empty_like(first)  # the last merge writes q's dtype, as the forward's did
    TritonFp32.merge_many_(expected, lse, out, lse, parts[-1:])
    once, once_lse = first.clone(), first_lse.clone()
    TritonFp32.merge_many_(once, once_lse, once, once_lse, parts)
    assert torch.equal(once, expected) and torch.equal(once_lse, lse)
    TritonFp32.merge_many_(once, once_lse, first, first_lse, parts[:2])  # a block left out shows
    assert not torch.equal(once, expected)


def test_triton_merge_of_split_keys_is_softmax_over_all_keys_in_float64():
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(2, 3, 33, 20, generator=gen, dtype=torch.float64) * 4
    values = torch.randn(2, 3, 20, 16, generator=gen, dtype=torch.float64)

    def partial(cols):
        s, v = scores[..., cols], values[..., cols, :]
        return (torch.softmax(s, -1) @ v).float().to(DEVICE), torch.logsumexp(s, -1).float().to(
            DEVICE)

    out = torch.empty(2, 3, 33, 16, device=DEVICE)
    lse = torch.empty(2, 3, 33, device=DEVICE)
    init_(out, lse, *partial(slice(0, 7)))
    triton_merge_(out, lse, *partial(slice(7, 15)))
    triton_merge_(out, lse, *partial(slice(15, 20)))
    assert (out.cpu().double() - torch.softmax(scores, -1) @ values).abs().max() < 1e-6
    assert (lse.cpu().double() - torch.logsumexp(scores, -1)).abs().max() < 4e-6
    triton_merge_(out, lse, *partial(slice(15, 20)))  # a block twice is wrong and must show
    assert (out.cpu().double() - torch.softmax(scores, -1) @ values).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("add", [False, True])
def test_triton_accumulate_is_the_torch_accumulate(dtype, add):
    gen = torch.Generator().manual_seed(2)
    buffers = _buffers(gen, 2, 3, 40, 80)
    x = torch.randn(2, 3, 40, 80, generator=gen).to(dtype).to(DEVICE)
    expected, got = buffers[0].clone(), buffers[0].clone()
    TorchFp32.accumulate_(_rows([expected], 40)[0], x, add)
    TritonFp32.accumulate_(_rows([got], 40)[0], x, add)
    assert torch.equal(got, expected)  # one fp32 rounding (add) or none (copy) either way


@pytest.mark.parametrize("target_dtype", [torch.bfloat16, torch.float32])
def test_triton_sum_many_is_the_torch_one(target_dtype):
    """The ring backward's own dK/dV: parts over some rows (16-bit) and the accumulator that came
    home (fp32, every row) summed in one pass, rows no part covers 0; the fp32 sum is the one of
    adding the parts one at a time (bit for bit), and a part left out shows."""
    gen = torch.Generator().manual_seed(5)
    parts = [(torch.randn(2, 3, 20, 16, generator=gen).to(torch.bfloat16).to(DEVICE), slice(4, 24)),
             (torch.randn(2, 3, 16, 16, generator=gen).to(torch.bfloat16).to(DEVICE),
              slice(24, 40)),
             (torch.randn(2, 3, 44, 16, generator=gen).to(DEVICE), slice(0, 44))]
    one_at_a_time = torch.zeros(2, 3, 48, 16, device=DEVICE)
    for x, rows in parts:
        one_at_a_time[:, :, rows] += x.float()
    for impl in (TorchFp32, TritonFp32):
        target = torch.full((2, 3, 48, 16), float("nan"), dtype=target_dtype, device=DEVICE)
        impl.sum_many_(target, parts)
        if target_dtype == torch.float32:
            assert torch.equal(target, one_at_a_time), impl.__name__
        else:  # one rounding of the fp32 sum: within an ulp (the CPU interpreter truncates)
            torch.testing.assert_close(target.float(), one_at_a_time, rtol=2 ** -7, atol=0)
        assert torch.equal(target[:, :, 44:].float(), torch.zeros(2, 3, 4, 16, device=DEVICE))
        impl.sum_many_(target, parts[:2])
        assert not torch.allclose(target.float(), one_at_a_time, rtol=2 ** -7, atol=0)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="a race between GPU threads; the CPU interpreter "
                    "runs a program's threads as one")
def test_triton_merge_gives_the_same_bits_every_time_while_memory_is_busy():
    """The merge updates out and lse in place. Without a barrier between its loads and stores, a
    thread could store a row's new lse before another thread had read the old one. On an H200,
    with another stream copying 512 MiB per merge, 16 of 10000 merges of this shape (zigzag's
    2048-row half block, 8 heads) gave different rows of out; other shapes showed it less or
    not. Every merge is compared with the first, so a wrong first
    merge fails too."""
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    out = torch.randn(1, 8, 2048, 128, generator=gen, device=DEVICE)
    lse = torch.randn(1, 8, 2048, generator=gen, device=DEVICE) * 3
    block_out, block_lse = torch.randn_like(out), lse - torch.rand_like(lse)
    side, a = torch.cuda.Stream(), torch.empty(1 << 28, dtype=torch.bfloat16, device=DEVICE)
    b = torch.empty_like(a)
    differ = torch.zeros((), dtype=torch.int64, device=DEVICE)  # summed on the GPU: no syncs
    first = None
    for _ in range(10000):
        with torch.cuda.stream(side):  # another stream loads memory meanwhile, as NCCL does
            b.copy_(a)
            a, b = b, a
        merged = [out.clone(), lse.clone()]
        triton_merge_(*merged, block_out, block_lse)
        if first is None:
            first = merged
        else:
            differ += (merged[0] != first[0]).any(-1).sum() + (merged[1] != first[1]).sum()
    assert int(differ) == 0, f"{int(differ)} rows differed from the first merge's"


def test_the_registry_runs_triton_on_cuda_and_torch_elsewhere():
    assert FP32_OPS["other"] is TorchFp32 and FP32_OPS["cuda"] is TritonFp32
    out, lse = torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2)
    merge_(out, lse, torch.ones(1, 1, 2, 4), torch.zeros(1, 1, 2))  # CPU: the torch form
    assert torch.equal(out, torch.full_like(out, 0.5))
