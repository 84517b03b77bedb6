"""The forward merge of traced code (``merge/online.TracedFp32``), traced as the compile pass
traces a schedule (``make_fx`` over ``functionalize``, inductor's decompositions): on a GPU each
merge is eager's Triton kernel, one node of the graph, which inductor launches itself; on CPU the
torch ops. Either way the traced graph gives eager's bits, and both are the float64 merge to
within fp32 rounding (2e-6 on values of order 1..10; the merge's own error is a few fp32 ulps),
where a block left out is far off."""
import pytest
import torch
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from dtensor_ring.merge import merge_, merge_many_

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SEQ, DIM = 24, 8
SPANS = (slice(0, 24), slice(6, 18), slice(12, 24))  # rows of each block, overlapping as steps do


def _inputs(gen):
    """(first, first_lse, then per block its out (bf16, as a kernel gives it) and lse)."""
    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE)

    first, first_lse = randn(1, 2, SEQ, DIM), randn(1, 2, SEQ) * 3
    blocks = []
    for rows in SPANS:
        n = rows.stop - rows.start
        blocks += [randn(1, 2, n, DIM).to(torch.bfloat16), randn(1, 2, n) * 3]
    return first, first_lse, *blocks


def _merges(first, first_lse, *blocks):
    """A schedule's merges: all blocks in one pass into a fresh target, then the second block
    again merged in place into its rows' slice (as ``attend_`` merges into its block's rows)."""
    parts = [(blocks[2 * i], blocks[2 * i + 1], rows) for i, rows in enumerate(SPANS)]
    out, lse = torch.empty_like(first), torch.empty_like(first_lse)
    merge_many_(out, lse, first, first_lse, parts)
    merge_(out[:, :, 6:18], lse[:, :, 6:18], *blocks[2:4])
    return out, lse


def _float64(first, first_lse, *blocks):
    """The same merges in float64 from their definition: out = sum of exp(lse) out / sum of
    exp(lse) over the results each row holds."""
    out, lse = first.double(), first_lse.double()
    for i, rows in enumerate([*SPANS, SPANS[1]]):  # the last: the second block again
        j = 1 if i == 3 else i
        block_out, block_lse = blocks[2 * j].double(), blocks[2 * j + 1].double()
        a, b = lse[:, :, rows], block_lse
        total = torch.logaddexp(a, b)
        out[:, :, rows] = ((a - total).exp().unsqueeze(-1) * out[:, :, rows]
                           + (b - total).exp().unsqueeze(-1) * block_out)
        lse[:, :, rows] = total
    return out, lse


def _traced(inputs):
    """``_merges`` traced as the compile pass traces a schedule."""
    return make_fx(torch.func.functionalize(_merges), select_decomp_table())(*inputs)


def _targets(graph):
    return [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]


def test_traced_merges_give_the_eager_bits_and_the_float64_merge():
    """On CPU the traced merges are the torch ops (inductor fuses them); on CUDA each is one
    node, eager's Triton kernel, with none of the torch form's exp, log or sigmoid."""
    inputs = _inputs(torch.Generator().manual_seed(0))
    graph = _traced(inputs)
    if DEVICE.type == "cuda":
        targets = _targets(graph)
        assert sum("triton_kernel_wrapper" in t for t in targets) == 2, targets
        assert not any(name in t for t in targets for name in ("exp", "log", "sigmoid")), targets
    traced, eager = graph(*inputs), _merges(*inputs)
    for got, expected in zip(traced, eager):
        assert torch.equal(got, expected)
    for got, expected in zip(eager, _float64(*inputs)):
        torch.testing.assert_close(got.double(), expected, rtol=2e-6, atol=2e-6)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="inductor launches the Triton kernel on CUDA")
def test_inductor_launches_the_traced_kernel_and_gives_the_eager_bits():
    from torch._inductor.compile_fx import compile_fx  # noqa: PLC0415

    inputs = _inputs(torch.Generator().manual_seed(2))
    compiled = compile_fx(_traced(inputs), list(inputs))
    for got, expected in zip(compiled(*inputs), _merges(*inputs)):
        assert torch.equal(got, expected)


def test_a_block_left_out_of_the_traced_merge_shows():
    inputs = list(_inputs(torch.Generator().manual_seed(1)))
    expected = _float64(*inputs)
    inputs[7] = torch.full_like(inputs[7], float("-inf"))  # the third block: no key seen
    got = _traced(inputs)(*inputs)
    assert (got[0].double() - expected[0]).abs().max() > 1e-2
