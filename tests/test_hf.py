"""``dtensor_ring.hf.apply`` on a stock transformers ``LlamaForCausalLM`` (2 layers, hidden 64, 4 q /
2 kv heads, vocab 256, random weights from a local config) on 4 gloo processes, at W = 2 (the "cp"
dimension of a (dp=2, cp=2) mesh) and W = 4 (all of them): every rank passes the whole batch; the
mean of the ranks' losses and the cp-averaged gradients (``sync_gradients``) equal the unsharded
model's on one process, for zigzag and llama3 (and auto at W = 2), and each rank's logits equal its
shard of the unsharded logits. The labels have -100 runs placed so that the ranks count different
numbers of tokens, and the test checks that this matters: a mean of per-rank means would miss the
tolerance by 100x.

Reference: the stock model in float64 with the causal-LM loss computed in float64 outside it
(transformers computes RMSNorm, RoPE angles and its own loss in fp32 even then, so the reference
is good to ~1e-7), and the stock fp32 model with its own ``labels=`` loss. Tolerance, as in
test_context_parallel.py: fp32 rel-RMS <= 1e-5 for the loss and for every parameter's gradient
(the fp32 model on one process is itself ~3e-6 from float64 in its worst gradient). Two
deliberately wrong setups must miss it by 100x: each rank's tokens at local positions 0..L-1
(RoPE as a model without context parallelism sees them), and labels shifted inside each shard
(what transformers' own shift does to sharded labels). Every rank asserts.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

transformers = pytest.importorskip("transformers")

import dtensor_ring as dr  # noqa: E402
from dtensor_ring import hf  # noqa: E402
from dtensor_ring.comm import TRAFFIC  # noqa: E402
from dtensor_ring.tools.numerics import rel_rms  # noqa: E402
from dist_utils import run_on_ranks  # noqa: E402
from dtensor_helpers import expect_error  # noqa: E402

BATCH, SEQ, VOCAB = 2, 64, 256
FP32_LIMIT = 1e-5
WRONG_FACTOR = 100


def _config(**overrides):
    # initializer_range 0.2 (not 0.02): attention far from uniform, so positions matter.
    options = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                   attn_implementation="sdpa")
    return transformers.LlamaConfig(**{**options, **overrides})


def _model(**overrides):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(_config(**overrides))


def _batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = ids.clone()
    labels[0, :13] = -100   # the ranks count different numbers of tokens
    labels[1, 37:45] = -100
    return ids, labels


def _grads(model):
    return {name: p.grad.double() for name, p in model.named_parameters()}


def _reference(base, ids, labels, weights=None):
    """float64 stock model, causal-LM loss in float64 (token t's loss times ``weights[:, t]``,
    default 1 / the number of counted tokens): loss, grads, logits."""
    model = copy.deepcopy(base).double()
    logits = model(input_ids=ids).logits
    counted = F.pad(labels[:, 1:] != -100, (0, 1))
    if weights is None:
        weights = counted.double() / counted.sum()
    token_loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                 ignore_index=-100, reduction="none")
    loss = (F.pad(token_loss.view(BATCH, -1), (0, 1)) * weights).sum()
    loss.backward()
    return loss.detach(), _grads(model), logits.detach()


def _single(base, ids, labels):
    model = copy.deepcopy(base)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach().double(), _grads(model)


def _context_parallel(model, mesh, module=None, **inputs):
    """Mean of the ranks' losses, cp-averaged gradients, this rank's logits; ``module``: the one
    that holds the parameters (``model``, or what ``torch.compile`` wrapped)."""
    module = module or model
    module.zero_grad()
    out = model(**inputs)
    out.loss.backward()
    dr.dtensor.sync_gradients(module, mesh)
    loss = out.loss.detach().double()
    dist.all_reduce(loss, group=mesh.get_group())
    return loss / mesh.size(), _grads(module), out.logits.detach()


def _worst(result, reference):
    """(loss rel-RMS, worst parameter, its gradient rel-RMS)."""
    per_param = {n: rel_rms(result[1][n], g) for n, g in reference[1].items()}
    worst = max(per_param, key=per_param.get)
    return rel_rms(result[0], reference[0]), worst, per_param[worst]


def _parity(mesh, failures, label, schedules):
    base = _model()
    ids, labels = _batch()
    reference = _reference(base, ids, labels)
    single = _single(base, ids, labels)
    loss_err, worst, grad_err = _worst(single, reference)
    if not (loss_err <= FP32_LIMIT and grad_err <= FP32_LIMIT):
        failures.append(f"{label}: the fp32 model itself is {loss_err:.2e} / {worst} "
                        f"{grad_err:.2e} from float64")
    counts_check = _labels_matter(base, ids, labels, reference, mesh.size())
    if counts_check:
        failures.append(f"{label}: {counts_check}")
    for schedule in schedules:
        where = f"{label} {schedule}"
        model = hf.apply(copy.deepcopy(base), mesh, schedule=schedule)
        result = _context_parallel(model, mesh, input_ids=ids, labels=labels)
        for name, ref in (("float64", reference), ("fp32 single", single)):
            loss_err, worst, grad_err = _worst(result, ref)
            if not (loss_err <= FP32_LIMIT and grad_err <= FP32_LIMIT):
                failures.append(f"{where} vs {name}: loss {loss_err:.2e}, worst grad {worst} "
                                f"{grad_err:.2e} > {FP32_LIMIT}")
        layout = dr.SCHEDULE_LAYOUT[schedule]
        logits_ref = dr.shard_sequence(reference[2], mesh, dim=1, layout=layout)
        logits_err = rel_rms(result[2].double(), logits_ref)
        if not logits_err <= FP32_LIMIT:
            failures.append(f"{where}: this rank's logits {logits_err:.2e} from its shard")
    _wrong_setups(mesh, failures, label, base, ids, labels, reference)
    if mesh.size() == 2:
        _checkpointing(mesh, failures, label, base, ids, labels, reference)


def _checkpointing(mesh, failures, label, base, ids, labels, reference):
    """transformers' own gradient checkpointing (reentrant or not, and selective with
    ``dr.save_ring_attention_context``) gives the same loss and gradients; its recompute repeats
    the forward's ring traffic, or none with the policy (``dtensor_ring.comm.TRAFFIC``)."""
    def run(**options):
        model = hf.apply(copy.deepcopy(base), mesh, schedule="zigzag")
        if options:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
        TRAFFIC.clear()
        out = model(input_ids=ids, labels=labels)
        forward = TRAFFIC["bytes"]
        out.loss.backward()
        step = TRAFFIC["bytes"]
        dr.dtensor.sync_gradients(model, mesh)
        loss = out.loss.detach().double()
        dist.all_reduce(loss, group=mesh.get_group())
        return (loss / mesh.size(), _grads(model)), forward, step

    _, forward, plain_step = run()
    variants = {"non-reentrant": dict(use_reentrant=False), "reentrant": dict(use_reentrant=True),
                "selective": dict(use_reentrant=False,
                                  context_fn=dr.save_ring_attention_context)}
    for name, options in variants.items():
        result, _, step = run(**options)
        loss_err, worst, grad_err = _worst(result, reference)
        extra, want = step - plain_step, 0 if name == "selective" else forward
        if not (loss_err <= FP32_LIMIT and grad_err <= FP32_LIMIT and forward > 0
                and extra == want):
            failures.append(f"{label} gradient checkpointing {name}: loss {loss_err:.2e}, "
                            f"worst grad {worst} {grad_err:.2e}, recompute traffic {extra} B "
                            f"(want {want})")


def _labels_matter(base, ids, labels, reference, world):
    """The test data must catch a per-rank mean (each rank dividing by its own count of labels):
    '' if that misses the tolerance by 100x, else why not."""
    counted = F.pad(labels[:, 1:] != -100, (0, 1))
    weights, counts = torch.zeros(counted.shape, dtype=torch.float64), []
    for rank in range(world):
        index = dr.LAYOUTS["zigzag"].positions(SEQ // world, rank, world)
        counts.append(int(counted[:, index].sum()))
        weights[:, index] = counted[:, index].double() / (world * counts[-1])
    loss_err, worst, grad_err = _worst(_reference(base, ids, labels, weights), reference)
    if not max(loss_err, grad_err) > WRONG_FACTOR * FP32_LIMIT:
        return (f"per-rank counts {counts}: a per-rank mean is only {loss_err:.2e} / {worst} "
                f"{grad_err:.2e} off")
    return ""


def _wrong_setups(mesh, failures, label, base, ids, labels, reference):
    """The adapter's two fixes undone, through its inputs: both must miss the tolerance."""
    layout, local = "zigzag", SEQ // mesh.size()
    local_positions = torch.arange(local).expand(BATCH, local)
    shifted_locally = F.pad(dr.shard_sequence(labels, mesh, dim=1, layout=layout)[:, 1:], (0, 1),
                            value=-100)
    cases = {
        "local positions": dict(position_ids=dr.unshard_sequence(
            local_positions, mesh, dim=1, layout=layout)),
        "labels shifted per shard": dict(shift_labels=dr.unshard_sequence(
            shifted_locally, mesh, dim=1, layout=layout)),
    }
    for name, extra in cases.items():
        model = hf.apply(copy.deepcopy(base), mesh, schedule="zigzag")
        result = _context_parallel(model, mesh, input_ids=ids, labels=labels, **extra)
        loss_err, worst, grad_err = _worst(result, reference)
        if not max(loss_err, grad_err) > WRONG_FACTOR * FP32_LIMIT:
            failures.append(f"{label} wrong setup '{name}' passed: loss {loss_err:.2e}, worst "
                            f"grad {worst} {grad_err:.2e}")


def _call_errors(mesh, mesh2d, failures):
    ids, labels = _batch()
    model = hf.apply(_model(), mesh, schedule="zigzag")
    padding = torch.ones_like(ids)
    padding[1, -5:] = 0
    expect_error(failures, "padding mask", ValueError,
                 lambda: model(input_ids=ids, labels=labels, attention_mask=padding),
                 "attention_mask", "padding", "valid: None or all ones")
    same = model(input_ids=ids, labels=labels, attention_mask=torch.ones_like(ids)).loss
    if not torch.equal(same, model(input_ids=ids, labels=labels).loss):
        failures.append("an all-ones attention_mask changed the loss")
    expect_error(failures, "length not divisible", ValueError,
                 lambda: model(input_ids=ids[:, :SEQ - 2], labels=labels[:, :SEQ - 2]),
                 f"input_ids.shape[1]={SEQ - 2}", "zigzag")
    expect_error(failures, "use_cache", ValueError,
                 lambda: model(input_ids=ids, use_cache=True), "use_cache", "False")
    expect_error(failures, "logits_to_keep", ValueError,
                 lambda: model(input_ids=ids, logits_to_keep=1), "logits_to_keep=1", "valid: 0")
    expect_error(failures, "non-causal", ValueError,
                 lambda: model(input_ids=ids, is_causal=False), "is_causal=False", "True")
    dropout = hf.apply(_model(attention_dropout=0.1), mesh).train()
    expect_error(failures, "dropout in training", ValueError,
                 lambda: dropout(input_ids=ids, labels=labels), "dropout=0.1",
                 "attention_dropout", "0.0")
    dropout.eval()(input_ids=ids)  # no dropout in eval: runs
    expect_error(failures, "applied twice", ValueError, lambda: hf.apply(model, mesh),
                 "_attn_implementation='dtensor_ring'", "'sdpa'")
    expect_error(failures, "unknown schedule", ValueError,
                 lambda: hf.apply(_model(), mesh, schedule="ringg"), "schedule='ringg'", "llama3")
    expect_error(failures, "unknown precision", ValueError,
                 lambda: hf.apply(_model(), mesh, precision="fp64"), "precision='fp64'", "exact")
    expect_error(failures, "2-D mesh", ValueError, lambda: hf.apply(_model(), mesh2d),
                 "mesh=", "1-D DeviceMesh")
    expect_error(failures, "process group", ValueError,
                 lambda: hf.apply(_model(), mesh.get_group()), "mesh=", "1-D DeviceMesh")
    # parallelize_module with the plain style would shift the labels inside each shard: refused,
    # the model as it is and inside a module of the user's
    plain = dr.ContextParallel("zigzag")
    expect_error(failures, "plain ContextParallel", ValueError,
                 lambda: parallelize_module(_model(), mesh, plain), "LlamaForCausalLM is a "
                 "Hugging Face transformers model", "dtensor_ring.hf.apply(model, mesh")
    expect_error(failures, "plain ContextParallel, wrapped", ValueError,
                 lambda: parallelize_module(torch.nn.Sequential(_model()), mesh, plain),
                 "Sequential holds a Hugging Face transformers model (LlamaForCausalLM)",
                 "dtensor_ring.hf.apply")


PACKED = [0, 32, 96, 128]  # documents of 32, 64 and 32 tokens


def _flattened(cu=PACKED):
    """A ``DataCollatorWithFlattening``-style batch: one row of documents back to back,
    position ids restarting at 0, each document's first label -100 (its separator)."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (1, cu[-1]), generator=gen)
    labels = ids.clone()
    labels[0, cu[:-1]] = -100
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])
    return ids, labels, positions.unsqueeze(0)


def _per_document_reference(base, ids, labels, separate=True, cu=PACKED):
    """float64: each document through the model alone (``separate``; else the packed row as one
    sequence), the causal-LM loss over all counted tokens of the row."""
    model = copy.deepcopy(base).double()
    spans = list(zip(cu, cu[1:])) if separate else [(0, cu[-1])]
    token_losses = []
    for a, b in spans:
        logits = model(input_ids=ids[:, a:b], use_cache=False).logits
        shifted = F.pad(labels[:, a + 1:b], (0, 1), value=-100)
        token_losses.append(F.cross_entropy(logits.flatten(0, 1), shifted.flatten(),
                                            ignore_index=-100, reduction="sum"))
    count = (F.pad(labels[:, 1:], (0, 1), value=-100) != -100).sum()
    loss = sum(token_losses) / count
    loss.backward()
    return loss.detach(), _grads(model)


def _packed(mesh, failures, label):
    """A flattened batch: the adapter finds the documents in the position ids and attends
    within them; the test data must tell attention across documents apart."""
    base = _model()
    ids, labels, positions = _flattened()
    reference = _per_document_reference(base, ids, labels)
    across = _per_document_reference(base, ids, labels, separate=False)
    loss_err, worst, grad_err = _worst(across, reference)
    if not max(loss_err, grad_err) > WRONG_FACTOR * FP32_LIMIT:
        failures.append(f"{label}: attending across documents is only {grad_err:.2e} off")
    for schedule in ("zigzag", "llama3", "stripe"):
        model = hf.apply(copy.deepcopy(base), mesh, schedule=schedule)
        result = _context_parallel(model, mesh, input_ids=ids, labels=labels,
                                   position_ids=positions)
        loss_err, worst, grad_err = _worst(result, reference)
        if not (loss_err <= FP32_LIMIT and grad_err <= FP32_LIMIT):
            failures.append(f"{label} packed {schedule}: loss {loss_err:.2e}, worst grad "
                            f"{worst} {grad_err:.2e} > {FP32_LIMIT}")
    # The collator's own batch, with flash-attn's keywords: model(**batch) as transformers runs it.
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    batch = collator([{"input_ids": ids[0, a:b].tolist()} for a, b in zip(PACKED, PACKED[1:])])
    if not (torch.equal(batch["labels"], labels) and "cu_seq_lens_q" in batch):
        failures.append(f"{label}: the collator's batch is not the test's: {sorted(batch)}")
    model = hf.apply(copy.deepcopy(base), mesh, schedule="zigzag")
    loss_err, worst, grad_err = _worst(_context_parallel(model, mesh, **batch), reference)
    if not (loss_err <= FP32_LIMIT and grad_err <= FP32_LIMIT):
        failures.append(f"{label} DataCollatorWithFlattening(return_flash_attn_kwargs=True): "
                        f"loss {loss_err:.2e}, worst grad {worst} {grad_err:.2e} > {FP32_LIMIT}")


def _sliding_windows(mesh, failures, label):
    """A sliding window at least as long as the sequence is full causal attention: equal to the
    model on one process (shorter windows: test_hf_windows.py)."""
    ids, labels = _batch()
    base = _mistral(4096)
    reference = _single(base, ids, labels)
    result = _context_parallel(hf.apply(copy.deepcopy(base), mesh), mesh, input_ids=ids,
                               labels=labels)
    loss_err, worst, grad_err = _worst(result, reference)
    if not (loss_err <= FP32_LIMIT and grad_err <= FP32_LIMIT):
        failures.append(f"{label} sliding_window=4096: loss {loss_err:.2e}, worst grad {worst} "
                        f"{grad_err:.2e}")


def _ranks(mesh2d):
    """W = 2 on mesh2d["cp"] (a named dimension of a (dp, cp) mesh), W = 4 on all ranks."""
    failures = []
    whole = init_device_mesh("cpu", (mesh2d.size(),))
    for mesh, schedules in ((mesh2d["cp"], ("zigzag", "llama3", "auto")),
                            (whole, ("zigzag", "llama3"))):
        label = f"rank {dist.get_rank()}: cp rank {mesh.get_local_rank()}/{mesh.size()}"
        _parity(mesh, failures, label, schedules)
    _packed(whole, failures, f"rank {dist.get_rank()}/4")
    _sliding_windows(mesh2d["cp"], failures, f"rank {dist.get_rank()}")
    _call_errors(mesh2d["cp"], mesh2d, failures)
    assert not failures, "\n".join(failures)


def test_hf_llama_matches_single_process():
    run_on_ranks(4, _ranks, mesh_shape=(2, 2), mesh_dim_names=("dp", "cp"))


def _compiled_window(mesh):
    """Under ``torch.compile`` a windowed model (Mistral, ``sliding_window=4096``, covering every
    document) trains on flattened batches whose longest document changes within its power-of-two
    bucket (48, 64, 60 tokens: bucket 64) with no new graph, each step within the tolerance of
    float64 (Dynamo's count of graphs)."""
    from torch._dynamo.utils import counters  # noqa: PLC0415

    failures, label = [], f"rank {dist.get_rank()}"
    base = _mistral(4096)
    model = hf.apply(copy.deepcopy(base), mesh, schedule="zigzag")
    compiled = torch.compile(model)
    for step, cu in enumerate(([0, 48, 88, 128], [0, 64, 96, 128], [0, 36, 96, 128])):
        ids, labels, positions = _flattened(cu)
        if step == 1:
            graphs_before = counters["stats"]["unique_graphs"]
        reference = _per_document_reference(base, ids, labels, cu=cu)
        result = _context_parallel(compiled, mesh, model, input_ids=ids, labels=labels,
                                   position_ids=positions)
        loss_err, worst, grad_err = _worst(result, reference)
        if not (loss_err <= FP32_LIMIT and grad_err <= FP32_LIMIT):
            failures.append(f"{label} compiled, documents {cu}: loss {loss_err:.2e}, worst grad "
                            f"{worst} {grad_err:.2e} > {FP32_LIMIT}")
    recompiles = counters["stats"]["unique_graphs"] - graphs_before
    if recompiles:
        failures.append(f"{label}: {recompiles} graphs compiled again for a longest document "
                        "in the same bucket")
    assert not failures, "\n".join(failures)


def test_hf_windowed_model_compiled_matches_and_keeps_its_graph():
    run_on_ranks(2, _compiled_window)


def _mistral(sliding_window):
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, sliding_window=sliding_window,
                                        initializer_range=0.2, attn_implementation="sdpa")
    return transformers.MistralForCausalLM(config)


@pytest.mark.parametrize("make, fragments", [
    (lambda: transformers.LlamaModel(_config()), ("model must be", "LlamaModel")),
    (lambda: torch.nn.Linear(4, 4), ("model must be", "Linear")),
    (lambda: _model(attn_implementation="eager"), ("_attn_implementation='eager'", "'sdpa'")),
], ids=["base model", "not transformers", "eager attention"])
def test_hf_apply_refuses_models(make, fragments):
    with pytest.raises(ValueError) as error:
        hf.apply(make(), mesh=None)
    assert all(f in str(error.value) for f in fragments), str(error.value)


def test_hf_attention_needs_apply():
    model = _model()
    model.set_attn_implementation(hf.NAME)
    with pytest.raises(ValueError, match=r"dtensor_ring\.hf\.apply"):
        model(input_ids=_batch()[0])
