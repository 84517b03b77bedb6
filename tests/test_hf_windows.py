"""``dtensor_ring.hf`` with sliding windows on 2 gloo ranks, eager and compiled, step by step
against the model on one process: a tiny ``MistralForCausalLM`` (window 16 on 256 tokens, every
layer) and a Gemma-style ``Gemma3ForCausalLM`` (sliding and full-attention layers alternating,
``config.layer_types``), both well below their windows' reach of a rank's 128 tokens.

Each step, every rank runs the context-parallel model on the whole batch; rank-averaged loss and
gradients (``sync_gradients``) must be within fp32 rel-RMS 1e-5 of the same weights on one process
in float64 (transformers' own masks: its sliding-window mask on the sliding layers), as in
test_hf.py; then both take the same SGD step. The same model without its window must miss by 100x.
Under ``torch.compile`` the window is a constant of each layer's ring-attention node.
"""
import copy

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

import dtensor_ring as dr  # noqa: E402
from dtensor_ring import hf  # noqa: E402
from dtensor_ring.comm import TRAFFIC  # noqa: E402
from dtensor_ring.tools.numerics import rel_rms  # noqa: E402
from dist_utils import run_on_ranks  # noqa: E402

BATCH, SEQ, VOCAB, WINDOW = 1, 256, 256, 16
FP32_LIMIT = 1e-5
WRONG_FACTOR = 100
STEPS = 2


def mistral(sliding_window=WINDOW):
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=sliding_window,
        initializer_range=0.2, max_position_embeddings=SEQ, attn_implementation="sdpa"))


def gemma(sliding_window=WINDOW):
    torch.manual_seed(0)
    layer_types = ["sliding_attention", "full_attention"] * 2
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        sliding_window=sliding_window, layer_types=layer_types, initializer_range=0.2,
        max_position_embeddings=SEQ, attn_implementation="sdpa"))


def _batch(step):
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return ids, ids.clone()


def _flat_grads(model):
    return torch.cat([p.grad.double().flatten() for p in model.parameters()])


def _one_process(model, ids, labels):
    """float64 loss and gradients of ``model``'s weights on one process (transformers' masks)."""
    model = copy.deepcopy(model).double()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), _flat_grads(model)


def _steps(mesh, failures, label, make, schedule, compiled):
    """STEPS training steps of the context-parallel model, each against one process."""
    base = make()
    unwindowed = make(sliding_window=SEQ)  # covers the sequence: full causal attention
    unwindowed.load_state_dict(base.state_dict())
    model = hf.apply(copy.deepcopy(base), mesh, schedule=schedule)
    run = torch.compile(model) if compiled else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        ids, labels = _batch(step)
        reference = _one_process(base, ids, labels)
        optimizer.zero_grad()
        TRAFFIC.clear()
        loss = run(input_ids=ids, labels=labels).loss
        loss.backward()
        dr.dtensor.sync_gradients(model, mesh)
        loss = loss.detach().double()
        dist.all_reduce(loss, group=mesh.get_group())
        loss_err = rel_rms(loss / mesh.size(), reference[0])
        grad_err = rel_rms(_flat_grads(model), reference[1])
        where = f"{label} {schedule}{' compiled' if compiled else ''} step {step}"
        if not (loss_err <= FP32_LIMIT and grad_err <= FP32_LIMIT):
            failures.append(f"{where}: loss {loss_err:.2e}, gradients {grad_err:.2e} > "
                            f"{FP32_LIMIT}")
        if step == 0 and not compiled:
            unwindowed.load_state_dict(base.state_dict())
            wrong = _one_process(unwindowed, ids, labels)
            if not rel_rms(wrong[1], reference[1]) > WRONG_FACTOR * FP32_LIMIT:
                failures.append(f"{where}: the window changes the gradients too little")
        optimizer.step()
        with torch.no_grad():  # the one-process model takes the same step
            for p, q in zip(base.parameters(), model.parameters()):
                p.copy_(q)


def _ranks(mesh):
    failures = []
    label = f"rank {mesh.get_local_rank()}/{mesh.size()}"
    for make, schedule, compiled in ((mistral, "zigzag", False), (mistral, "ring", False),
                                     (gemma, "auto", False), (gemma, "zigzag", True)):
        _steps(mesh, failures, f"{label} {make.__name__}", make, schedule, compiled)
    assert not failures, "\n".join(failures)


def test_hf_sliding_windows_match_one_process_step_by_step():
    run_on_ranks(2, _ranks)


@pytest.mark.parametrize("kwargs, fragments", [
    (dict(s_aux=torch.zeros(4)), ("s_aux", "not supported", "valid: None")),
    (dict(softcap=50.0), ("softcap", "not supported", "valid: None")),
    (dict(sliding_window=0), ("sliding_window=0", "positive int")),
], ids=["attention sinks", "soft-capping", "window of 0"])
def test_what_the_ring_does_not_compute_is_refused(kwargs, fragments):
    """GPT-OSS's attention sinks and Gemma 2's logit soft-capping change the softmax, which the
    ring does not; a window must hold at least the query itself."""
    q = torch.randn(1, 4, 8, 16)
    with pytest.raises(ValueError) as error:
        hf._attention(torch.nn.Module(), q, q, q, None, **{hf.SETTINGS: object()}, **kwargs)
    assert all(f in str(error.value) for f in fragments), str(error.value)


def test_window_is_left_w_minus_1():
    assert hf._window(None) is None and hf._window(16) == (15, 0) and hf._window(1) == (0, 0)
