"""Activation checkpointing with ring attention, on 2 gloo ranks: ``ContextParallel`` (the
repository's Llama and a RoPE transformer written in ``tests/rope_model.py``) and SDPA on
sequence-sharded DTensors (the rule), with ``torch.utils.checkpoint`` non-reentrant and reentrant,
``checkpoint_wrapper`` of both kinds and selective checkpointing with
``dr.save_ring_attention_context``; eagerly and under ``torch.compile`` (whole model, checkpointed
blocks inside the compiled region).

Every variant's loss and gradients (labels with -100 runs spread unevenly over the ranks) must
match the float64 model on one process within the fp32 bound of ``test_context_parallel.py`` (rel-RMS <= 1e-5: the fp32 model on one process is ~1e-7 from
float64, a model on local RoPE positions ~1e-2), and the un-checkpointed context-parallel model
within 1e-6 (the recompute repeats the forward's arithmetic). The recompute's ring traffic is
counted: eagerly by ``dtensor_ring.comm.TRAFFIC`` (the exchanges the ring posts), compiled by the
ring forwards the compile pass finds in backward graphs
(``passes.COUNTERS["recomputed_ring_attention_fwd"]``). Plain checkpointing repeats the forward's
traffic, selective checkpointing with the policy adds none. Every rank asserts.

Before the fix, non-reentrant checkpointing failed in the backward with "Recomputed values ... have
different metadata" and reentrant checkpointing silently gave the gradients of local attention,
eagerly; compiled, Dynamo traced the checkpointed body without the routing (a silent wrong result).
"""
import copy

import pytest
import torch
import torch._functorch.config
import torch._inductor.config
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                          checkpoint_wrapper)
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.checkpoint import checkpoint

import dtensor_ring as dr
from dtensor_ring import dtensor as drt
from dtensor_ring import passes
from dtensor_ring.comm import TRAFFIC
from dtensor_ring.models import Llama, LlamaConfig
from dtensor_ring.tools.numerics import (attention_and_grads, check_ratios, make_inputs, ratios,
                                         rel_rms, sdpa)
from dist_utils import run_on_ranks
from dtensor_helpers import dtensor_sdpa
from rope_model import RopeTransformer

FP32_LIMIT = 1e-5  # against float64, as in test_context_parallel.py
SAME_LIMIT = 1e-6  # against the un-checkpointed model
SEQ = 64


class _Checkpointed(nn.Module):
    """``torch.utils.checkpoint.checkpoint`` around a block, as a training script writes it."""

    def __init__(self, block, **options):
        super().__init__()
        self.block, self.options = block, options

    def forward(self, *args):
        return checkpoint(self.block, *args, **self.options)


VARIANTS = {
    "checkpoint": lambda b: _Checkpointed(b, use_reentrant=False),
    "checkpoint reentrant": lambda b: _Checkpointed(b, use_reentrant=True),
    "checkpoint_wrapper": checkpoint_wrapper,
    "checkpoint_wrapper reentrant": lambda b: checkpoint_wrapper(
        b, checkpoint_impl=CheckpointImpl.REENTRANT),
    "selective": lambda b: _Checkpointed(b, use_reentrant=False,
                                         context_fn=dr.save_ring_attention_context),
    "selective checkpoint_wrapper": lambda b: checkpoint_wrapper(
        b, context_fn=dr.save_ring_attention_context),
}


def _blocks(model):
    return model.layers if isinstance(model, Llama) else model.blocks


def _checkpoint_blocks(model, wrap):
    blocks = _blocks(model)
    for i, block in enumerate(list(blocks)):
        blocks[i] = wrap(block)
    return model


def _batch(vocab, seed=1):
    """Random tokens and labels, with -100 runs (a masked prompt, a masked span) that fall
    unevenly on the ranks: the loss is the whole batch's mean only if normalised globally."""
    gen = torch.Generator().manual_seed(seed)
    ids, labels = (torch.randint(0, vocab, (2, SEQ), generator=gen) for _ in range(2))
    labels[0, :13] = -100
    labels[1, 40:52] = -100
    return ids, labels


def _loss(output):
    return output.loss if hasattr(output, "loss") else output[1]


def _run(model, ids, labels, mesh=None):
    """Loss and gradients (float64, by name); with ``mesh``, averaged over its ranks (each rank's
    loss is over its own tokens); and the ring traffic of the forward and of the whole step."""
    model.zero_grad()
    TRAFFIC.clear()
    loss = _loss(model(ids, labels=labels))
    forward = TRAFFIC["bytes"]
    loss.backward()
    step = TRAFFIC["bytes"]
    flat = torch.cat([loss.detach().double().view(1)] +
                     [p.grad.double().flatten() for p in model.parameters()])
    if mesh is not None:
        torch.distributed.all_reduce(flat, group=mesh.get_group())
        flat /= mesh.size()
    return flat, forward, step


def _models(make, mesh, schedule, ids, labels, failures, where):
    base = make()
    reference, _, _ = _run(copy.deepcopy(base).double(), ids, labels)
    plain, forward, step = _run(parallelize_module(copy.deepcopy(base), mesh,
                                                   dr.ContextParallel(schedule)),
                                ids, labels, mesh)
    if not (forward > 0 and rel_rms(plain, reference) <= FP32_LIMIT):
        failures.append(f"{where}: un-checkpointed {rel_rms(plain, reference):.2e}, {forward} B")
    return base, reference, plain, forward, step


def _eager_context_parallel(mesh, failures, rank):
    cases = [("llama", lambda: _seeded(Llama, LlamaConfig()), s, VARIANTS)
             for s in ("zigzag", "llama3")]
    cases.append(("rope", lambda: _seeded(RopeTransformer), "stripe",
                  {k: VARIANTS[k] for k in ("checkpoint", "selective checkpoint_wrapper")}))
    for name, make, schedule, variants in cases:
        ids, labels = _batch(512 if name == "llama" else 128)
        where = f"rank {rank} {name} {schedule}"
        base, reference, plain, forward, step = _models(make, mesh, schedule, ids, labels,
                                                        failures, where)
        for variant, wrap in variants.items():
            model = _checkpoint_blocks(parallelize_module(copy.deepcopy(base), mesh,
                                                          dr.ContextParallel(schedule)), wrap)
            got, _, got_step = _run(model, ids, labels, mesh)
            extra = got_step - step
            want_extra = 0 if variant.startswith("selective") else forward
            errors = (rel_rms(got, reference), rel_rms(got, plain))
            if not (errors[0] <= FP32_LIMIT and errors[1] <= SAME_LIMIT and extra == want_extra):
                failures.append(f"{where} {variant}: vs float64 {errors[0]:.2e}, vs "
                                f"un-checkpointed {errors[1]:.2e}, recompute traffic {extra} B "
                                f"(want {want_extra})")
    # The bound catches a wrong model: RoPE on local positions, checkpointed.
    model = _checkpoint_blocks(parallelize_module(copy.deepcopy(base), mesh, dr.ContextParallel(
        "stripe", position_ids=None)), VARIANTS["checkpoint"])
    wrong = rel_rms(_run(model, ids, labels, mesh)[0], reference)
    if not wrong > 100 * FP32_LIMIT:
        failures.append(f"rank {rank}: a model on local positions passed ({wrong:.2e})")
    # A submodule called on its own (this rank's tokens) runs its SDPA as the ring too.
    attn = model.blocks[0].block.attn
    TRAFFIC.clear()
    with torch.no_grad():
        attn(torch.randn(1, 8, 64), torch.arange(8)[None])
    if not TRAFFIC["bytes"] > 0:
        failures.append(f"rank {rank}: a direct submodule call was not routed to the ring")


def _seeded(cls, *args):
    torch.manual_seed(0)
    return cls(*args)


def _dtensor_rule(mesh, failures, rank):
    """SDPA on sequence-sharded DTensors inside a checkpointed function: every rank's shards of
    out, dq, dk, dv right (the tolerances of ``dtensor_ring.tools.numerics``), and the recompute's
    ring traffic as with ContextParallel."""
    drt.set_sequence_schedule(mesh, "zigzag")
    q, k, v, dout = make_inputs(2, 4, 2, 32 * mesh.size(), 16, seed=5)
    reference = attention_and_grads(sdpa(True), q, k, v, dout, torch.float64)
    single = attention_and_grads(sdpa(True), q, k, v, dout, torch.float32)

    def shard(x):
        return dr.shard_sequence(x, mesh, layout="zigzag")

    block = dtensor_sdpa(mesh, [Shard(2)], is_causal=True)  # local shards in and out

    def run(fn):
        TRAFFIC.clear()
        got = attention_and_grads(fn, *map(shard, (q, k, v, dout)), torch.float32)
        return got, TRAFFIC["bytes"]

    try:
        _, plain_bytes = run(block)
        TRAFFIC.clear()
        with torch.no_grad():
            block(*(shard(x).float() for x in (q, k, v)))
        forward = TRAFFIC["bytes"]
        for name, options in (("plain", {}),
                              ("selective", {"context_fn": dr.save_ring_attention_context})):
            got, got_bytes = run(lambda a, b, c, options=options: checkpoint(
                block, a, b, c, use_reentrant=False, **options))
            check_ratios(ratios(got, list(map(shard, single)), list(map(shard, reference))),
                         torch.float32, f"rank {rank} DTensor rule {name}")
            extra, want = got_bytes - plain_bytes, 0 if name == "selective" else forward
            if not (forward > 0 and extra == want):
                failures.append(f"rank {rank} DTensor rule {name}: recompute traffic {extra} B "
                                f"(want {want})")
    except AssertionError as failure:
        failures.append(str(failure))
    finally:
        drt.clear_sequence_schedule(mesh)


def _eager(mesh):
    rank, failures = mesh.get_local_rank(), []
    _eager_context_parallel(mesh, failures, rank)
    _dtensor_rule(mesh, failures, rank)
    assert not failures, "\n".join(failures)


def test_activation_checkpointing_eager():
    run_on_ranks(2, _eager)


def _compiled(mesh):
    """The whole model compiled, each block checkpointed inside it, plain and selective (inductor,
    so the pass runs and counts); and a compiled block checkpointed eagerly (aot_eager: what
    matters there is Dynamo's view of the routing when the recompute calls the compiled block)."""
    torch._inductor.config.fx_graph_cache = False  # compile afresh: the pass must run and count
    torch._functorch.config.enable_autograd_cache = False
    rank, failures = mesh.get_local_rank(), []
    ids, labels = _batch(512)
    base, reference, plain, _, _ = _models(lambda: _seeded(Llama, LlamaConfig(n_layers=1)), mesh,
                                           "zigzag", ids, labels, failures, f"rank {rank}")
    for variant in ("checkpoint_wrapper", "selective checkpoint_wrapper", "compiled block"):
        model = parallelize_module(copy.deepcopy(base), mesh, dr.ContextParallel("zigzag"))
        if variant == "compiled block":
            run = _checkpoint_blocks(model, lambda b: _Checkpointed(
                torch.compile(b, backend="aot_eager", fullgraph=True), use_reentrant=False))
        else:
            run = torch.compile(_checkpoint_blocks(model, VARIANTS[variant]), fullgraph=True)
        before = passes.COUNTERS["recomputed_ring_attention_fwd"]
        expanded = passes.COUNTERS["expanded_ring_attention_fwd"]
        got, _, _ = _run(run, ids, labels, mesh)
        recomputed = passes.COUNTERS["recomputed_ring_attention_fwd"] - before
        expanded = passes.COUNTERS["expanded_ring_attention_fwd"] - expanded
        want = {"checkpoint_wrapper": (1, 2), "selective checkpoint_wrapper": (0, 1),
                "compiled block": (0, 0)}[variant]  # (recomputed, expanded) ring forwards
        errors = (rel_rms(got, reference), rel_rms(got, plain))
        if not (errors[0] <= FP32_LIMIT and errors[1] <= FP32_LIMIT
                and (recomputed, expanded) == want):
            failures.append(f"rank {rank} compiled, {variant}: vs float64 {errors[0]:.2e}, vs "
                            f"eager {errors[1]:.2e}, ring forwards (recomputed, expanded) "
                            f"{(recomputed, expanded)} (want {want})")
    breaks = dict(counters["graph_break"])
    assert not breaks, f"graph breaks: {breaks}"
    assert not failures, "\n".join(failures)


def test_activation_checkpointing_compiled():
    run_on_ranks(2, _compiled)


def test_selective_context_rejects_bad_ops():
    with pytest.raises(TypeError, match=r"also_save.*'mm'"):
        dr.save_ring_attention_context(also_save=["mm"])
    contexts = dr.save_ring_attention_context(also_save=[torch.ops.aten.mm.default])
    assert len(contexts) == 2
