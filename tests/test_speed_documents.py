"""bench/speed.py --documents' two single-device pieces, on the CPU: its float64 reference over
packed documents (each document alone) and its ideal (one block kernel over the whole row, the
documents as varlen segments). The ring's own rows are the library's, tested elsewhere.

The reference must equal SDPA run on each document alone in float64 (the definition of packed
documents) to float64 rounding; the ideal, in bf16, must lie within the usual tolerance of that
same SDPA's bf16 error (``dtensor_ring.numerics``). Both checks are shown to fail on the whole row
attended as one sequence."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dtensor_ring.tools.numerics import (attention_and_grads, check_ratios, document_sdpa, fwd_bwd,
                                   make_inputs, ratios, rel_rms, sdpa)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import speed  # noqa: E402

CU = [0, 24, 40, 104, 128]  # four documents over a row of 128 tokens


def _inputs():
    return make_inputs(1, 4, 2, CU[-1], 16)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_attends_each_document_alone(causal):
    q, k, v, dout = _inputs()
    want = attention_and_grads(document_sdpa(causal, CU), q, k, v, dout, torch.float64)
    got = speed.reference(q, k, v, dout, causal, 16 ** -0.5, cu_seqlens=CU)
    assert max(rel_rms(g, w) for g, w in zip(got, want)) < 1e-12
    whole = speed.reference(q, k, v, dout, causal, 16 ** -0.5)  # a wrong answer: one sequence
    assert max(rel_rms(g, w) for g, w in zip(whole, want)) > 1e-2


@pytest.mark.parametrize("causal", [True, False])
def test_ideal_is_one_varlen_call_over_the_row(causal):
    q, k, v, dout = _inputs()
    reference = attention_and_grads(document_sdpa(causal, CU), q, k, v, dout, torch.float64)
    single = attention_and_grads(document_sdpa(causal, CU), q, k, v, dout, torch.bfloat16)
    ctx = SimpleNamespace(window=None, causal=causal, max_seqlen=64,
                          cu_seqlens=torch.tensor(CU, dtype=torch.int32))
    got = fwd_bwd(lambda a, b, c: speed._block_kernel(None, a, b, c, ctx),
                  *(x.bfloat16() for x in (q, k, v, dout)))
    check_ratios(ratios(got, single, reference), torch.bfloat16, f"causal={causal}")
    whole = attention_and_grads(sdpa(causal), q, k, v, dout, torch.bfloat16)
    with pytest.raises(AssertionError):
        check_ratios(ratios(whole, single, reference), torch.bfloat16, "one sequence")
