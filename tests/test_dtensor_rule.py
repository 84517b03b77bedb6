"""The DTensor SDPA rule on real gloo groups: W = 2 and 4 on a 1-D mesh, and a (tp=2, cp=2) mesh.

Every case runs forward and backward of ``F.scaled_dot_product_attention`` on DTensors and every
rank checks its shard of out, dq, dk, dv against a float64 reference of the whole attention, with
the tolerances of ``dtensor_ring.tools.numerics`` (fp32 <= 1.15x, bf16 <= 1.25x the single-device
kernel's rel-RMS), plus a check that the same numbers in the wrong layout fail them. CommDebugMode
and a collective log show what moved: nothing gathered for the ring schedules, exactly K/V for
llama3, nothing at all for local attention. Bad inputs raise ValueError naming what is wrong.
"""
import itertools
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.attention import SDPBackend, sdpa_kernel

import dtensor_ring as dr
from dtensor_ring import dtensor as drt
from dtensor_ring.tools.numerics import (TOLERANCE, attention_and_grads, check_ratios, make_inputs,
                                         ratios, sdpa)
from dtensor_helpers import CollectiveLog, dtensor_sdpa, expect_error, local_shard
from dist_utils import run_on_ranks

SEQ = [Shard(2)]
RING_CASES = list(itertools.product(sorted(dr.SCHEDULES), (True, False),
                                    (torch.float32, torch.bfloat16)))
WRONG_LAYOUT = {"contiguous": "zigzag", "zigzag": "contiguous", "stripe": "contiguous"}


def _check_case(where, mesh, placements, layout, causal, dtype, inputs, kv_placements=None):
    """Run SDPA on DTensors; check every rank's shards; return (CommDebugMode, CollectiveLog)."""
    q, k, v, dout = inputs
    kv_placements = placements if kv_placements is None else kv_placements
    reference = attention_and_grads(sdpa(causal), q, k, v, dout, torch.float64)
    single = attention_and_grads(sdpa(causal), q, k, v, dout, dtype)

    def q_shard(x, lay=layout):
        return local_shard(x, mesh, placements, lay)

    def kv_shard(x, lay=layout):
        return local_shard(x, mesh, kv_placements, lay)

    comm, log = CommDebugMode(), CollectiveLog()
    with comm, log:
        got = attention_and_grads(dtensor_sdpa(mesh, placements, kv_placements, is_causal=causal),
                                  q_shard(q), kv_shard(k), kv_shard(v), q_shard(dout), dtype)
    shards = (q_shard, q_shard, kv_shard, kv_shard)
    check_ratios(ratios(got, [s(x) for s, x in zip(shards, single)],
                        [s(x) for s, x in zip(shards, reference)]), dtype, where)
    # The same numbers read in another layout must fail the tolerance by far.
    wrong = WRONG_LAYOUT[layout]
    bad = ratios(got, [s(x, wrong) for s, x in zip(shards, single)],
                 [s(x, wrong) for s, x in zip(shards, reference)])
    assert min(bad["out"], bad["dq"]) > 10 * TOLERANCE[dtype], f"{where}: wrong layout passed {bad}"
    return comm, log


def _gathers(comm: CommDebugMode):
    return {str(op): n for op, n in comm.get_comm_counts().items() if "gather" in str(op)}


def _ring_cases(mesh, failures, rank_label):
    world = mesh.size()
    for i, (schedule, causal, dtype) in enumerate(RING_CASES):
        kv_heads = 2 if i % 2 else 4
        where = f"{rank_label} {schedule} causal={causal} kv_heads={kv_heads} {dtype}"
        try:
            drt.set_sequence_schedule(mesh, schedule)
            inputs = make_inputs(2, 4, kv_heads, 64 * world, 64, seed=i)
            comm, log = _check_case(where, mesh, SEQ, dr.SCHEDULE_LAYOUT[schedule], causal,
                                    dtype, inputs)
            kv_local = 2 * inputs[1].numel() // world  # this rank's K and V
            if schedule == "llama3":  # K/V gathered once in forward, once in backward; never q
                assert log.gathered_elements() == 2 * kv_local, (where, log.calls)
            else:
                assert not _gathers(comm) and log.gathered_elements() == 0, (where, log.calls)
        except AssertionError as failure:
            failures.append(str(failure))
        finally:
            drt.clear_sequence_schedule(mesh)


def _local_cases(mesh, failures, rank_label):
    """Query Shard(2), key/value Replicate: local attention, no communication in forward."""
    world = mesh.size()
    for i, (schedule, causal) in enumerate(itertools.product(("ring", "zigzag", "stripe"),
                                                             (True, False))):
        where = f"{rank_label} local {schedule} causal={causal}"
        try:
            drt.set_sequence_schedule(mesh, schedule)
            inputs = make_inputs(2, 4, 2, 64 * world, 64, seed=100 + i)
            q, k, v, dout = inputs
            layout = dr.SCHEDULE_LAYOUT[schedule]
            lq = local_shard(q, mesh, SEQ, layout).float().requires_grad_()
            with CollectiveLog() as log:
                dq = DTensor.from_local(lq, mesh, SEQ, run_check=False)
                dk, dv = (DTensor.from_local(x.float(), mesh, [Replicate()]) for x in (k, v))
                out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=causal,
                                                     enable_gqa=True)
            assert log.calls == [], f"{where}: forward communicated {log.calls}"
            assert out.placements == (Shard(2),), out.placements
            _check_case(where, mesh, SEQ, layout, causal, torch.float32, inputs,
                        kv_placements=[Replicate()])
        except AssertionError as failure:
            failures.append(str(failure))
        finally:
            drt.clear_sequence_schedule(mesh)


def _math_op_case(mesh, failures, rank_label):
    """Under inference_mode DTensor sees SDPA itself (not its decomposition): the ring too."""
    world = mesh.size()
    try:
        drt.set_sequence_schedule(mesh, "zigzag")
        q, k, v, _ = make_inputs(2, 4, 4, 64 * world, 64, seed=7)
        reference = sdpa(True)(q, k, v)
        single = sdpa(True)(q.float(), k.float(), v.float())
        with torch.inference_mode(), sdpa_kernel(SDPBackend.MATH):
            qkv = [drt.distribute_sequence(x.float(), mesh) for x in (q, k, v)]
            out = F.scaled_dot_product_attention(*qkv, is_causal=True)
        got = drt.sequence_full_tensor(out)
        ratio = ratios([got], [single], [reference])["out"]
        assert ratio <= TOLERANCE[torch.float32], f"{rank_label} math op: ratio {ratio}"
    except AssertionError as failure:
        failures.append(str(failure))
    finally:
        drt.clear_sequence_schedule(mesh)


def _dt(x, mesh, placements, shape=None):
    return DTensor.from_local(x, mesh, placements, run_check=False, shape=shape,
                              stride=None if shape is None else torch.empty(shape).stride())


def _error_cases(mesh, failures):
    world = mesh.size()
    q, k, v, _ = (x.float() for x in make_inputs(1, 4, 4, 8 * world, 16, seed=3))

    def attend(*qkv, **kwargs):
        return F.scaled_dot_product_attention(*qkv, **kwargs)

    # q/k/v in different layouts: q sharded under zigzag, k and v after re-registering stripe.
    drt.set_sequence_schedule(mesh, "zigzag")
    dq = drt.distribute_sequence(q, mesh)
    drt.set_sequence_schedule(mesh, "stripe")
    dk, dv = drt.distribute_sequence(k, mesh), drt.distribute_sequence(v, mesh)
    expect_error(failures, "different layouts", ValueError, lambda: attend(dq, dk, dv),
            "query", "'zigzag'", "'stripe'")
    drt.clear_sequence_schedule(mesh)

    seq = [_dt(local_shard(x, mesh, SEQ, "contiguous"), mesh, SEQ) for x in (q, k, v)]
    # key Shard(1) where the sequence (Shard(2)) is expected.
    heads_k = _dt(k.chunk(world, 1)[mesh.get_local_rank()], mesh, [Shard(1)])
    expect_error(failures, "key Shard(1) on the sequence dim", ValueError,
            lambda: attend(seq[0], heads_k, seq[2]), "key", "Shard(dim=1)", "Shard(2)")
    # A Shard of another dim on a mesh dimension registered for sequences.
    drt.set_sequence_schedule(mesh, "ring")
    dims3 = [_dt(x.chunk(world, 3)[mesh.get_local_rank()], mesh, [Shard(3)]) for x in (q, k, v)]
    expect_error(failures, "Shard(3) on a registered sequence dim", ValueError,
            lambda: attend(*dims3), "query", "Shard(3)", "Shard(2)")
    drt.clear_sequence_schedule(mesh)
    # key/value sharded, query not.
    rep_q = _dt(q, mesh, [Replicate()])
    expect_error(failures, "query not sequence-sharded", ValueError,
            lambda: attend(rep_q, seq[1], seq[2]), "query is not")
    expect_error(failures, "key Shard(2) but value Replicate", ValueError,
            lambda: attend(seq[0], seq[1], _dt(v, mesh, [Replicate()])), "key", "value")
    # Global length not divisible by the mesh size (uneven Shard(2)).
    uneven_len = 8 * world + 1
    qq, kk, vv, _ = (x.float() for x in make_inputs(1, 4, 4, uneven_len, 16, seed=4))
    uneven = [_dt(x.tensor_split(world, 2)[mesh.get_local_rank()], mesh, SEQ, x.shape)
              for x in (qq, kk, vv)]
    expect_error(failures, "length not divisible by W", ValueError, lambda: attend(*uneven),
            f"query.shape[2] (global sequence length)={uneven_len}", f"size {world}")
    # zigzag needs an even local length: 3 tokens per rank.
    drt.set_sequence_schedule(mesh, "zigzag")
    odd = [_dt(x[:, :, :3].contiguous(), mesh, SEQ) for x in (q, k, v)]
    expect_error(failures, "zigzag with an odd local length", ValueError, lambda: attend(*odd),
            "'zigzag'", f"={3 * world}")
    drt.clear_sequence_schedule(mesh)
    # attn_mask with sequence sharding: refused, not all-gathered.
    mask = _dt(torch.ones(8 * world, 8 * world, dtype=torch.bool).tril(), mesh, [Replicate()])
    with CollectiveLog() as log:
        expect_error(failures, "attn_mask", ValueError, lambda: attend(*seq, attn_mask=mask),
                "attn_mask", "is_causal=True")
    if log.gathered_elements():
        failures.append(f"attn_mask: something was all-gathered before the error: {log.calls}")
    # Inputs with no sequence sharding keep DTensor's own behaviour.
    rep = [_dt(x, mesh, [Replicate()]) for x in (q, k, v)]
    with_rule = _outcome(lambda: attend(*rep, is_causal=True))
    handlers = DTensor._op_dispatcher._custom_op_handlers
    saved = {op: handlers.pop(op) for op in list(handlers) if handlers[op] is drt.sdpa_handler}
    try:
        without_rule = _outcome(lambda: attend(*rep, is_causal=True))
    finally:
        handlers.update(saved)
    if with_rule != without_rule:
        failures.append(f"replicated SDPA changed: {with_rule} with the rule, {without_rule} "
                        "without")


def _outcome(fn):
    try:
        out = fn()
    except Exception as error:  # noqa: BLE001
        return type(error).__name__
    return ("ok", tuple(out.placements), out.to_local().sum().item())


def _one_d_world(mesh):
    failures = []
    label = f"rank {mesh.get_local_rank()}/{mesh.size()}"
    _ring_cases(mesh, failures, label)
    _local_cases(mesh, failures, label)
    _math_op_case(mesh, failures, label)
    _error_cases(mesh, failures)
    assert not failures, "\n".join(failures)


MESH2D_CASES = [(s, True, torch.float32, [Shard(1), Shard(2)]) for s in sorted(dr.SCHEDULES)] + [
    ("zigzag", True, torch.bfloat16, [Shard(1), Shard(2)]),
    ("llama3", False, torch.float32, [Shard(1), Shard(2)]),
    ("zigzag", True, torch.float32, [Shard(0), Shard(2)]),
    ("stripe", True, torch.float32, [Replicate(), Shard(2)]),
]


def _two_d_world(mesh_1d):
    """W = 4: the (tp=2, cp=2) mesh (heads or batch on tp, sequence on cp), and its errors."""
    failures = []
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "cp"))
    label = f"rank {mesh_1d.get_local_rank()} (tp={mesh.get_local_rank(0)}, " \
            f"cp={mesh.get_local_rank(1)})"
    for i, (schedule, causal, dtype, placements) in enumerate(MESH2D_CASES):
        where = f"{label} {schedule} causal={causal} {dtype} {placements}"
        try:
            drt.set_sequence_schedule(mesh, schedule, mesh_dim="cp")
            inputs = make_inputs(2, 4, 2, 128, 64, seed=200 + i)
            comm, log = _check_case(where, mesh, placements, dr.SCHEDULE_LAYOUT[schedule],
                                    causal, dtype, inputs)
            if schedule != "llama3":
                assert log.gathered_elements() == 0, (where, log.calls)
        except AssertionError as failure:
            failures.append(str(failure))
    drt.clear_sequence_schedule(mesh, mesh_dim="cp")
    q, k, v, _ = (x.float() for x in make_inputs(2, 4, 2, 32, 32, seed=9))

    def on(x, placements):
        return _dt(local_shard(x, mesh, placements, "contiguous"), mesh, placements, x.shape)

    expect_error(failures, "q/k/v on different mesh dims", ValueError,
            lambda: F.scaled_dot_product_attention(
                on(q, [Replicate(), Shard(2)]), on(k, [Shard(2), Replicate()]),
                on(v, [Shard(2), Replicate()]), enable_gqa=True),
            "key", "'tp'", "'cp'", "same mesh dimension")
    expect_error(failures, "Partial on the tp dim", ValueError,
            lambda: F.scaled_dot_product_attention(
                _dt(local_shard(q, mesh, [Replicate(), Shard(2)], "contiguous"), mesh,
                    [Partial(), Shard(2)]),
                *(on(x, [Replicate(), Shard(2)]) for x in (k, v)), enable_gqa=True),
            "Partial", "'tp'")
    # A layout registered for a "cp" dimension of size 4, used on this mesh's "cp" of size 2.
    cp4 = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    drt.set_sequence_schedule(cp4, "zigzag")
    expect_error(failures, "layout registered for another size", ValueError,
            lambda: F.scaled_dot_product_attention(
                *(on(x, [Shard(1), Shard(2)]) for x in (q, k, v)), enable_gqa=True),
            "size 2", "size 4", "'zigzag'")
    drt.clear_sequence_schedule(cp4)
    assert not failures, "\n".join(failures)


def _schedule_changes_after_compiling(mesh):
    """A function compiled under one registered schedule, called again after the entry changed
    (zigzag -> stripe -> zigzag -> cleared: contiguous ring), follows the new entry: the graph holds
    the schedule, so the change must recompile it (zigzag's graph is reused when zigzag comes
    back), and inductor's caches must not hand it out again (without either, stripe's out was off
    by up to 1.96, in this process or, from the cache on disk, in a new one). A compiled function
    that does not use the rule is not recompiled by any of it (inductor, the default backend)."""
    from torch._dynamo.utils import counters
    from dtensor_ring.passes import RingExpandPass

    q, k, v, _ = (x.float() for x in make_inputs(1, 4, 4, 64, 16, seed=0))
    reference = sdpa(True)(q, k, v)
    unrelated = torch.compile(lambda x: torch.sin(x) * 2)
    unrelated(q)
    attend = torch.compile(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True))
    cache_keys = set()  # the ring pass's uuid, in inductor's cache keys (in memory and on disk)
    compiled = []  # frames Dynamo compiled for each call of attend
    try:
        for schedule in ("zigzag", "stripe", "zigzag", None):
            if schedule is None:
                drt.clear_sequence_schedule(mesh)
            else:
                drt.set_sequence_schedule(mesh, schedule)
            cache_keys.add(RingExpandPass().uuid())
            frames = counters["frames"]["ok"]
            out = attend(*(drt.distribute_sequence(x, mesh) for x in (q, k, v)))
            compiled.append(counters["frames"]["ok"] - frames)
            error = (drt.sequence_full_tensor(out).double() - reference).abs().max().item()
            assert error < 1e-5, f"rank {mesh.get_local_rank()} {schedule}: max error {error}"
    finally:
        drt.clear_sequence_schedule(mesh)
    assert len(cache_keys) == 3, cache_keys
    assert compiled == [1, 1, 0, 1], compiled
    frames = counters["frames"]["ok"]
    unrelated(q)
    assert counters["frames"]["ok"] == frames, "a registration recompiled an unrelated function"


def test_changing_the_schedule_recompiles_only_what_used_it():
    run_on_ranks(2, _schedule_changes_after_compiling)


@pytest.mark.parametrize("world_size", [2, 4])
def test_sdpa_rule_on_sequence_sharded_dtensors(world_size):
    run_on_ranks(world_size, _one_d_world)


def test_sdpa_rule_on_tp_cp_mesh():
    run_on_ranks(4, _two_d_world)


def test_import_registers_only_sdpa_handlers():
    """Importing dtensor_ring adds handlers for the SDPA ops and touches no other DTensor op."""
    code = (
        "import torch\n"
        "from torch.distributed.tensor import DTensor\n"
        "before = dict(DTensor._op_dispatcher._custom_op_handlers)\n"
        "import dtensor_ring\n"
        "from dtensor_ring.dtensor.sdpa_ops import SDPA_OPS\n"
        "after = DTensor._op_dispatcher._custom_op_handlers\n"
        "changed = {op for op in set(before) | set(after) if before.get(op) is not after.get(op)}\n"
        "assert changed == set(SDPA_OPS), changed\n"
        "assert all('scaled_dot_product' in str(op) for op in changed)\n")
    subprocess.run([sys.executable, "-c", code], check=True)
