"""The fp32 merge against float64, including the extreme LSE gaps where naive forms overflow; the
fp32 gradient accumulators (copy first, add later, zero what nothing reached; the held sums give
their bits)."""
import pytest
import torch

from dtensor_ring.merge import init_, merge_
from dtensor_ring.schedules.base import ForwardMerge, HeldSums, RowSums


def _partial(scores, values):
    lse = torch.logsumexp(scores, -1)
    return torch.softmax(scores, -1) @ values, lse


def test_merge_of_two_key_blocks_equals_softmax_over_all_keys():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 5, 12, generator=gen, dtype=torch.float64) * 4
    values = torch.randn(2, 3, 12, 8, generator=gen, dtype=torch.float64)
    whole_out, whole_lse = _partial(scores, values)
    out, lse = torch.empty(2, 3, 5, 8), torch.empty(2, 3, 5)
    init_(out, lse, *(x.float() for x in _partial(scores[..., :7], values[..., :7, :])))
    merge_(out, lse, *(x.float() for x in _partial(scores[..., 7:], values[..., 7:, :])))
    # fp32 state: a few fp32 roundings of values of order 1.
    assert (out.double() - whole_out).abs().max() < 1e-6
    assert (lse.double() - whole_lse).abs().max() < 1e-5
    # Merging the same block twice is wrong and must show.
    merge_(out, lse, *(x.float() for x in _partial(scores[..., 7:], values[..., 7:, :])))
    assert (out.double() - whole_out).abs().max() > 1e-3


def test_merge_is_stable_when_one_block_dominates_by_hundreds():
    out, lse = torch.tensor([[[[1.0, 2.0]]]]), torch.tensor([[[-500.0]]])
    merge_(out, lse, torch.tensor([[[[3.0, 4.0]]]], dtype=torch.bfloat16), torch.tensor([[[400.0]]]))
    assert torch.equal(out, torch.tensor([[[[3.0, 4.0]]]])) and lse.item() == 400.0
    merge_(out, lse, torch.tensor([[[[9.0, 9.0]]]]), torch.tensor([[[-1e4]]]))
    assert torch.equal(out, torch.tensor([[[[3.0, 4.0]]]])) and lse.item() == 400.0


def test_row_sums_copy_first_add_later_and_zero_the_rest():
    gen = torch.Generator().manual_seed(0)
    parts = [(slice(2, 5), torch.randn(1, 2, 3, 4, generator=gen).bfloat16()),
             (slice(0, 3), torch.randn(1, 2, 3, 4, generator=gen)),    # overlaps rows 2..3
             (slice(8, 10), torch.randn(1, 2, 2, 4, generator=gen)),
             (slice(2, 10), torch.randn(1, 2, 8, 4, generator=gen))]   # spans a gap 5..8
    expected = torch.zeros(1, 2, 12, 4, dtype=torch.float64)
    sums = RowSums(torch.full((1, 2, 12, 4), float("nan")))  # uninitialised: must not leak
    for rows, x in parts:
        expected[:, :, rows] += x.double()
        sums.add_(rows, x)
    assert sums.value.dtype == torch.float32
    assert torch.allclose(sums.result().double(), expected, atol=1e-6)  # rows 10, 11: zero
    done = RowSums(torch.ones(1, 1, 3, 2), written=True)
    done.add_(slice(1, 2), torch.ones(1, 1, 1, 2))
    assert done.result()[0, 0, :, 0].tolist() == [1.0, 2.0, 1.0]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # cuda: the Triton passes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("count", [1, 2, 3, 6])
def test_held_sums_give_the_bits_of_row_sums(device, dtype, count):
    # bf16 results as a kernel returns them, over rows that overlap and leave gaps (10, 11)
    gen = torch.Generator().manual_seed(count)
    spans = [slice(2, 5), slice(0, 3), slice(8, 10), slice(2, 10), slice(0, 10), slice(5, 8)]
    parts = [(rows, (torch.randn(1, 2, rows.stop - rows.start, 4, generator=gen) * 100)
              .bfloat16().to(device)) for rows in spans[:count]]
    like = torch.empty(1, 2, 12, 4, dtype=torch.bfloat16, device=device)
    row_sums, held = RowSums(torch.full((1, 2, 12, 4), float("nan"), device=device)), \
        HeldSums(like)
    for rows, x in parts:
        row_sums.add_(rows, x)
        assert held.claim(rows) is None
        held.hold(rows, x)
        assert len(held.held) < held.per_pass  # summed as soon as a pass is full
    got, want = held.result_in(dtype), row_sums.result_in(dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    # and both are the float64 sum, to within the output dtype's rounding (values up to ~1e3)
    exact = torch.zeros(1, 2, 12, 4, dtype=torch.float64)
    for rows, x in parts:
        exact[:, :, rows] += x.double().cpu()
    assert (got.double().cpu() - exact).abs().max() <= torch.finfo(dtype).eps * 2**10
    # a result held twice must show
    twice = HeldSums(like)
    for rows, x in parts + parts[-1:]:
        twice.hold(rows, x)
    assert not torch.equal(twice.result_in(dtype), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("blocks", [1, 3, 6])  # alone; held and merged in one pass; as they come
def test_forward_merge_of_blocks_in_a_models_layout_is_contiguous_and_the_same(device, blocks):
    # The first block's out with q's strides ([B, S, H, D] memory, as cuDNN returns it for a
    # model's q): the result is contiguous (the custom op's fake) and bit for bit the result of
    # merging from a contiguous copy.
    shape = (1, 2, 8, 4)

    def result(first_layout):
        q = torch.empty(shape, dtype=torch.bfloat16, device=device)
        merged = ForwardMerge(q, blocks)
        g = torch.Generator().manual_seed(blocks)
        for i in range(blocks):
            rows = slice(0, 8) if i == 0 else slice(i % 2 * 4, 8)
            n = rows.stop - rows.start
            out = torch.randn(1, 2, n, 4, generator=g).bfloat16().to(device)
            lse = torch.randn(1, 2, n, generator=g).to(device)
            if i == 0:
                out = first_layout(out)
            merged.add(out, lse, rows)
        return merged.result()

    def bshd(x):
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    out, lse = result(bshd)
    want_out, want_lse = result(lambda x: x)
    assert not bshd(torch.empty(shape)).is_contiguous()
    assert out.is_contiguous() and torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert out.dtype == torch.bfloat16
