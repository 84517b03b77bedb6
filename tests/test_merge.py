"""The fp32 merge against float64, including the extreme LSE gaps where naive forms overflow."""
import torch

from dtensor_ring.merge import init_, merge_


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
