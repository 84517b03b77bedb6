"""``ContextParallel`` end to end on 4 gloo ranks: the Llama-style model (2 layers, ~1M parameters)
under ``parallelize_module`` gives the loss and parameter gradients of the unsharded model on one
process, for every schedule; 20 optimizer steps track the single-process loss curve; it composes
with a tensor-parallel plan on a (tp=2, cp=2) mesh; bad inputs raise errors naming them.

Tolerances: fp32, rel-RMS <= 1e-5 against the float64 model (and against the fp32 model on one
process); bf16, <= 1.25x the single-process bf16 model's own rel-RMS against float64 (the issue's
figures). Every rank checks. Each rank's loss is over its own tokens; the global loss is their mean
and gradients are averaged over the cp ranks (``sync_gradients``), as a data-parallel dim would.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

import dtensor_ring as dr
from dtensor_ring import dtensor as drt
from dtensor_ring.models import Llama, LlamaConfig
from dtensor_ring.tools.numerics import rel_rms
from dist_utils import run_on_ranks
from dtensor_helpers import expect_error

BATCH, SEQ = 2, 64
FP32_LIMIT = 1e-5
BF16_FACTOR = 1.25


def _batch(seed, vocab):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    return ids, labels


def _base_model():
    torch.manual_seed(0)
    return Llama(LlamaConfig())


def _grads(model):
    """Full (unsharded) parameter gradients in float64, by name."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out[name] = g.double()
    return out


def _single(model, ids, labels):
    model.zero_grad()
    loss = model(ids, labels=labels).loss
    loss.backward()
    return loss.detach().double(), _grads(model)


def _context_parallel(model, mesh, ids, labels):
    """Loss (mean over ranks) and cp-averaged gradients of a ContextParallel model."""
    model.zero_grad()
    loss = model(ids, labels=labels).loss
    loss.backward()
    drt.sync_gradients(model, mesh)
    total = loss.detach().double().clone()
    dist.all_reduce(total, group=mesh.get_group())
    return total / mesh.size(), _grads(model)


def _errors(result, reference):
    loss, grads = result
    ref_loss, ref_grads = reference
    per_param = {n: rel_rms(grads[n], ref_grads[n]) for n in ref_grads}
    flat = rel_rms(torch.cat([grads[n].flatten() for n in ref_grads]),
                   torch.cat([ref_grads[n].flatten() for n in ref_grads]))
    return rel_rms(loss, ref_loss), flat, per_param


def _parity_cases(mesh, failures, label):
    base = _base_model()
    ids, labels = _batch(1, base.cfg.vocab_size)
    reference = _single(copy.deepcopy(base).double(), ids, labels)
    single32 = _single(copy.deepcopy(base), ids, labels)
    single16 = _single(copy.deepcopy(base).bfloat16(), ids, labels)
    _, single16_flat, _ = _errors(single16, reference)
    single16_loss = _errors(single16, reference)[0]
    for schedule in sorted(dr.SCHEDULES):
        where = f"{label} {schedule}"
        try:
            model = parallelize_module(copy.deepcopy(base), mesh, dr.ContextParallel(schedule))
            result = _context_parallel(model, mesh, ids, labels)
            for name, ref in (("float64", reference), ("fp32 single", single32)):
                loss_err, flat, per_param = _errors(result, ref)
                worst = max(per_param, key=per_param.get)
                assert loss_err <= FP32_LIMIT and per_param[worst] <= FP32_LIMIT, (
                    f"{where} fp32 vs {name}: loss {loss_err:.2e}, worst grad {worst} "
                    f"{per_param[worst]:.2e} > {FP32_LIMIT}")
            # A wrong answer (the model without positions: RoPE sees local positions) fails.
            wrong = copy.deepcopy(base)
            wrong = parallelize_module(wrong, mesh, dr.ContextParallel(schedule,
                                                                       position_ids=None))
            wrong_err = _errors(_context_parallel(wrong, mesh, ids, labels), reference)[1]
            assert wrong_err > 100 * FP32_LIMIT, f"{where}: local positions passed ({wrong_err})"

            model16 = parallelize_module(copy.deepcopy(base).bfloat16(), mesh,
                                         dr.ContextParallel(schedule))
            loss16, flat16, _ = _errors(_context_parallel(model16, mesh, ids, labels), reference)
            assert flat16 <= BF16_FACTOR * single16_flat, (
                f"{where} bf16 grads: {flat16:.3e} > {BF16_FACTOR} x {single16_flat:.3e}")
            assert loss16 <= BF16_FACTOR * single16_loss + 1e-6, (
                f"{where} bf16 loss: {loss16:.3e} > {BF16_FACTOR} x {single16_loss:.3e}")
        except AssertionError as failure:
            failures.append(str(failure))


def _training_case(mesh, failures, label, schedule="zigzag", steps=20):
    base = _base_model()
    single = copy.deepcopy(base)
    sharded = parallelize_module(copy.deepcopy(base), mesh, dr.ContextParallel(schedule))
    opt_single = torch.optim.AdamW(single.parameters(), lr=3e-3)
    opt_sharded = torch.optim.AdamW(sharded.parameters(), lr=3e-3)
    curves = ([], [])
    ids, labels = _batch(100, base.cfg.vocab_size)  # one batch, memorised: the loss must fall
    for _ in range(steps):
        loss, _ = _single(single, ids, labels)
        cp_loss, _ = _context_parallel(sharded, mesh, ids, labels)
        opt_single.step()
        opt_sharded.step()
        curves[0].append(loss.item())
        curves[1].append(cp_loss.item())
    gap = max(abs(a - b) / a for a, b in zip(*curves))
    if not gap <= 1e-4 or not curves[0][-1] < curves[0][0] - 0.5:
        failures.append(f"{label} training {schedule}: relative gap {gap:.2e}, curves {curves}")


TP_PLAN = {f"layers.{i}.{name}": style for i in range(2) for name, style in (
    ("attention.wq", ColwiseParallel()), ("attention.wk", ColwiseParallel()),
    ("attention.wv", ColwiseParallel()), ("attention.wo", RowwiseParallel()),
    ("feed_forward.w1", ColwiseParallel()), ("feed_forward.w3", ColwiseParallel()),
    ("feed_forward.w2", RowwiseParallel()))}


def _tp_cp_case(failures, label):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "cp"))
    base = _base_model()
    ids, labels = _batch(2, base.cfg.vocab_size)
    single32 = _single(copy.deepcopy(base), ids, labels)
    for schedule in ("zigzag", "llama3"):
        model = parallelize_module(copy.deepcopy(base), mesh["tp"], TP_PLAN)
        model = parallelize_module(model, mesh["cp"], {"": dr.ContextParallel(schedule)})
        loss_err, _, per_param = _errors(_context_parallel(model, mesh["cp"], ids, labels),
                                         single32)
        worst = max(per_param, key=per_param.get)
        if not (loss_err <= FP32_LIMIT and per_param[worst] <= FP32_LIMIT):
            failures.append(f"{label} tp x cp {schedule}: loss {loss_err:.2e}, worst grad "
                            f"{worst} {per_param[worst]:.2e}")
        if not isinstance(model.layers[0].attention.wq.weight, DTensor):
            failures.append(f"{label} tp x cp: the TP plan did not apply")


class _MaskedAttention(torch.nn.Module):
    def forward(self, x):
        q = x.unsqueeze(1)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


class _ReplicatedAttention(torch.nn.Module):
    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh

    def forward(self, x):
        q = DTensor.from_local(x.unsqueeze(1), self.mesh, [Replicate()])
        return F.scaled_dot_product_attention(q, q, q)


def _style_errors(mesh, failures):
    model = parallelize_module(_base_model(), mesh, dr.ContextParallel("zigzag"))
    ids, labels = _batch(3, 512)
    expect_error(failures, "attention_mask input", ValueError,
            lambda: model(ids, labels=labels, attention_mask=torch.ones_like(ids)),
            "attention_mask")
    short = ids[:, :SEQ - 4]
    expect_error(failures, "length not divisible", ValueError, lambda: model(short),
            f"input_ids.shape[1]={SEQ - 4}", "zigzag")
    expect_error(failures, "inputs of different lengths", ValueError,
            lambda: model(ids, labels=labels[:, :8]), "'labels'", "8", str(SEQ))
    named = parallelize_module(_base_model(), mesh,
                               dr.ContextParallel("ring", seq_inputs=("input_ids", "targets")))
    expect_error(failures, "seq_inputs names a missing input", ValueError, lambda: named(ids),
            "targets")
    x = torch.randn(2, SEQ, 8)
    masked = parallelize_module(_MaskedAttention(), mesh, dr.ContextParallel("ring"))
    expect_error(failures, "attn_mask inside the module", ValueError, lambda: masked(x),
                 "attn_mask")
    replicated = parallelize_module(_ReplicatedAttention(mesh), mesh, dr.ContextParallel("ring"))
    expect_error(failures, "replicated DTensor SDPA inside the module", ValueError,
            lambda: replicated(x), "Shard(2)")
    # 2-D meshes are (ring, all-to-all) ones (test_hybrid_gloo.py); a 3-D one is refused
    mesh3d = init_device_mesh("cpu", (1, 2, mesh.size() // 2), mesh_dim_names=("tp", "cp", "x"))
    expect_error(failures, "a 3-D mesh", ValueError,
            lambda: parallelize_module(_base_model(), mesh3d, dr.ContextParallel()), "1-D",
            "2-D one (ring, all-to-all")
    # A failed forward leaves no SDPA mode behind: plain SDPA still runs locally.
    q = torch.randn(1, 1, 4, 8)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, q, q),
                               F.scaled_dot_product_attention(q.double(), q.double(),
                                                              q.double()).float())


def _four_ranks(mesh):
    failures = []
    label = f"rank {mesh.get_local_rank()}/{mesh.size()}"
    _parity_cases(mesh, failures, label)
    _training_case(mesh, failures, label)
    _style_errors(mesh, failures)
    _tp_cp_case(failures, label)
    assert not failures, "\n".join(failures)


def test_context_parallel_llama_matches_single_process():
    run_on_ranks(4, _four_ranks)


@pytest.mark.parametrize("kwargs, exc, fragment", [
    (dict(schedule="ringg"), ValueError, "schedule='ringg'"),
    (dict(seq_dim=-1), ValueError, "seq_dim=-1"),
    (dict(seq_inputs="input_ids"), TypeError, "seq_inputs"),
])
def test_context_parallel_rejects_bad_options(kwargs, exc, fragment):
    with pytest.raises(exc, match=fragment.replace("(", r"\(")):
        dr.ContextParallel(**kwargs)
