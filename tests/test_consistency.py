"""Ranks that call ring attention differently get a ValueError on every rank, never a hang, an abort
or a silent wrong result (``dtensor_ring/consistency.py``).

On 2 gloo ranks whose process group times out after ``TIMEOUT_S`` (a rank left waiting in a
collective fails the test instead of stalling CI): a different local length, query or key/value
head count, head dim, batch, dtype, schedule, causality or precision on one rank, through
``ring_attention``, through ``ContextParallel`` (different schedules per rank), through the DTensor
rule (different registered schedules per rank) and under ``torch.compile`` (caught while Dynamo
traces). Each error names the differing field, the ranks and their values, and every rank raises
the same one. After the errors, consistent calls still run and match a float64 reference (fp32
tolerance of ``dtensor_ring.tools.numerics``), and a checked signature costs no collective: a rank
that checks it again alone returns at once (a collective would time out). ``set_mode("every")``
catches the change the cache cannot (one rank switching to a new signature while the other repeats a
checked one). Compiled, the check adds no graph break and no recompile.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

import dtensor_ring as dr
from dtensor_ring import consistency
from dtensor_ring import dtensor as drt
from dtensor_ring.models import Llama, LlamaConfig
from dtensor_ring.tools.numerics import attention_and_grads, check_ratios, make_inputs, ratios, sdpa
from dist_utils import run_on_ranks
from dtensor_helpers import expect_error

TIMEOUT_S = 60
B, HQ, HKV, D = 1, 4, 2, 8


def _qkv(local_len, q_heads=HQ, kv_heads=HKV, head_dim=D, batch=B, dtype=torch.float32):
    gen = torch.Generator().manual_seed(local_len)
    q = torch.randn(batch, q_heads, local_len, head_dim, generator=gen, dtype=dtype)
    k = torch.randn(batch, kv_heads, local_len, head_dim, generator=gen, dtype=dtype)
    return q, k, k.clone()


def _mismatches(rank):
    """(what, ring_attention kwargs for this rank, fragments of the message). Each case uses a
    local length no other case uses, so the signature is new on both ranks."""
    other = rank == 1
    return [
        ("local length", dict(local_len=24 if other else 32),
         ["local_len", "32 on rank 0", "24 on rank 1"]),
        ("query heads", dict(local_len=40, q_heads=2 if other else 4),
         ["q_heads", "4 on rank 0", "2 on rank 1"]),
        ("key/value heads", dict(local_len=48, kv_heads=1 if other else 2),
         ["kv_heads", "2 on rank 0", "1 on rank 1"]),
        ("head dim", dict(local_len=56, head_dim=16 if other else 8),
         ["head_dim", "8 on rank 0", "16 on rank 1"]),
        ("batch", dict(local_len=64, batch=2 if other else 1), ["batch", "1 on rank 0"]),
        ("dtype", dict(local_len=72, dtype=torch.bfloat16 if other else torch.float32),
         ["dtype", "'torch.float32' on rank 0", "'torch.bfloat16' on rank 1"]),
        ("schedule", dict(local_len=80, schedule="stripe" if other else "zigzag"),
         ["schedule", "'zigzag' on rank 0", "'stripe' on rank 1", "layout"]),
        ("causality", dict(local_len=88, is_causal=not other), ["is_causal", "True on rank 0"]),
        ("precision", dict(local_len=96, precision="exact" if other else "fp32"),
         ["precision", "'fp32' on rank 0", "'exact' on rank 1"]),
    ]


def _call(mesh, local_len, schedule="zigzag", is_causal=True, precision="fp32", **shape):
    q, k, v = _qkv(local_len, **shape)
    return dr.ring_attention(q, k, v, mesh=mesh, schedule=schedule, is_causal=is_causal,
                             precision=precision)


def _eager_mismatches(mesh, failures, rank):
    for what, kwargs, fragments in _mismatches(rank):
        expect_error(failures, f"rank {rank}: {what}", ValueError, lambda: _call(mesh, **kwargs),
                     "ring attention is called differently", *fragments)
    # Still usable, and right: a consistent call after the errors matches float64.
    q, k, v, dout = make_inputs(2, HQ, HKV, 64 * mesh.size(), 64, seed=3)
    reference = attention_and_grads(sdpa(True), q, k, v, dout, torch.float64)
    single = attention_and_grads(sdpa(True), q, k, v, dout, torch.float32)

    def shard(x):
        return dr.shard_sequence(x, mesh, layout="zigzag")

    got = attention_and_grads(
        lambda a, b, c: dr.ring_attention(a, b, c, mesh=mesh, schedule="zigzag", is_causal=True),
        *map(shard, (q, k, v, dout)), torch.float32)
    try:
        check_ratios(ratios(got, list(map(shard, single)), list(map(shard, reference))),
                     torch.float32, f"rank {rank} after the errors")
    except AssertionError as failure:
        failures.append(str(failure))


def _cache_and_every_mode(mesh, failures, rank):
    group = mesh.get_group()
    _call(mesh, 104)  # checked on both ranks
    if rank == 1:  # alone: a collective here would wait for rank 0 until the group times out
        q, k, _ = _qkv(104)
        consistency.check(group, q, k, schedule="zigzag", is_causal=True, precision="fp32",
                          scale=1.0 / math.sqrt(D))  # ring_attention's default, exactly
    torch.distributed.barrier(group=group)
    # The limit of the cache, and the switch that lifts it: rank 1 moves to a new length while
    # rank 0 repeats its checked one. With "every", both all-gather and both raise.
    consistency.set_mode("every")
    try:
        expect_error(failures, f"rank {rank}: every-call mode", ValueError,
                     lambda: _call(mesh, 112 if rank == 1 else 104), "local_len",
                     "104 on rank 0", "112 on rank 1")
    finally:
        consistency.set_mode("new")


def _style_and_rule_mismatches(mesh, failures, rank):
    torch.manual_seed(0)
    model = parallelize_module(Llama(LlamaConfig(n_layers=1)), mesh,
                               dr.ContextParallel("stripe" if rank == 1 else "zigzag"))
    ids = torch.randint(0, 512, (1, 16 * mesh.size()))
    expect_error(failures, f"rank {rank}: ContextParallel schedules", ValueError,
                 lambda: model(ids), "schedule", "'zigzag' on rank 0", "'stripe' on rank 1")
    drt.set_sequence_schedule(mesh, "stripe" if rank == 1 else "zigzag")
    try:
        q, k, v = (DTensor.from_local(x, mesh, [Shard(2)]) for x in _qkv(12))
        expect_error(failures, f"rank {rank}: DTensor rule schedules", ValueError,
                     lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                            enable_gqa=True),
                     "schedule", "'zigzag' on rank 0", "'stripe' on rank 1")
    finally:
        drt.clear_sequence_schedule(mesh)


def _compiled(mesh, failures, rank):
    """A mismatch is found while Dynamo traces (its TorchRuntimeError carries the message); a
    consistent compiled function checks once: no graph break, no recompile."""
    schedule = "stripe" if rank == 1 else "zigzag"
    mismatched = torch.compile(lambda a, b, c: dr.ring_attention(
        a, b, c, mesh=mesh, schedule=schedule, is_causal=True), backend="aot_eager")
    expect_error(failures, f"rank {rank}: compiled schedules", RuntimeError,
                 lambda: mismatched(*_qkv(20)), "ValueError", "'zigzag' on rank 0",
                 "'stripe' on rank 1")
    seen = len(consistency._checked[mesh.get_group()])
    counters.clear()
    consistent = torch.compile(lambda a, b, c: dr.ring_attention(
        a, b, c, mesh=mesh, schedule="zigzag", is_causal=True), backend="aot_eager",
        fullgraph=True)
    for _ in range(3):
        consistent(*_qkv(28))
    checked = len(consistency._checked[mesh.get_group()]) - seen
    graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
    if graphs != 1 or breaks or checked != 1:
        failures.append(f"rank {rank}: compiled: {graphs} graphs (want 1), breaks {breaks}, "
                        f"{checked} signatures checked (want 1)")


def _two_ranks(mesh):
    rank, failures = mesh.get_local_rank(), []
    _eager_mismatches(mesh, failures, rank)
    _cache_and_every_mode(mesh, failures, rank)
    _style_and_rule_mismatches(mesh, failures, rank)
    _compiled(mesh, failures, rank)
    assert not failures, "\n".join(failures)


def test_ranks_that_disagree_raise_value_error_on_every_rank():
    run_on_ranks(2, _two_ranks, timeout_s=TIMEOUT_S)


def test_set_mode_rejects_unknown_modes():
    with pytest.raises(ValueError, match=r"mode='sometimes'.*\['new', 'every', 'off'\]"):
        consistency.set_mode("sometimes")
    assert consistency.get_mode() == "new"
