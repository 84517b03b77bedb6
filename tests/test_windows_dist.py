"""Sliding windows on 4 gloo ranks: ``ring_attention`` for every schedule against float64 with the
same window, on every rank (and the same bits as ``simulate_ring``); the bytes the windowed
exchange moves per layer against the full ring (``dtensor_ring.comm.TRAFFIC``), and its
``send_recv`` alone; ranks that pass different windows; the DTensor SDPA rule with a registered
window (ring and replicated key/value); ``ContextParallel(window=...)`` on the repository's Llama
against the same model with a windowed mask on one process; and layers compiled one by one
recompiling only for a new window.

Tolerances: ``tools/numerics.TOLERANCE`` (the single-device kernel's own error, SDPA with the window
as a mask), stripe in fp32 as in test_windows.py; models: fp32 rel-RMS <= 1e-5 of float64, as in
test_context_parallel.py. Every rank asserts.
"""
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.overrides import TorchFunctionMode

import dtensor_ring as dr
from dtensor_ring import dtensor as drt
from dtensor_ring.comm import TRAFFIC
from dtensor_ring.comm.process_group import ProcessGroupComm
from dtensor_ring.layouts import LAYOUTS
from dtensor_ring.layouts.windows import Window
from dtensor_ring.models import Llama, LlamaConfig
from dtensor_ring.schedules.windowed import dense_plan
from dtensor_ring.tools.numerics import attention_and_grads, make_inputs, ratios, rel_rms
from dist_utils import run_on_ranks
from dtensor_helpers import expect_error
from test_windows import _check, window_mask, windowed_sdpa

LOCAL = 32
# (is_causal, window): smaller than a rank's share, equal, larger; two-sided
CASES = [(True, (5, 0)), (True, (LOCAL - 1, 0)), (True, (70, 0)), (False, (6, 3))]


def _attention(mesh, failures):
    world, rank = mesh.size(), mesh.get_local_rank()
    q, k, v, dout = make_inputs(2, 4, 2, world * LOCAL, 16, seed=11)
    for schedule in sorted(dr.SCHEDULES):
        layout = dr.SCHEDULE_LAYOUT[schedule]

        def shard(x):
            return dr.shard_sequence(x, mesh, layout=layout)

        for (is_causal, window), (dtype, precision) in zip(
                CASES * 2, [(torch.float32, "fp32")] * 4 + [(torch.bfloat16, "exact")] * 4):
            where = f"rank {rank} {schedule} {precision} causal={is_causal} window={window}"
            options = dict(schedule=schedule, is_causal=is_causal, window=window,
                           precision=precision)
            sdpa = windowed_sdpa(is_causal, window)
            reference = attention_and_grads(sdpa, q, k, v, dout, torch.float64)
            single = attention_and_grads(sdpa, q, k, v, dout, dtype)
            got = attention_and_grads(
                lambda a, b, c: dr.ring_attention(a, b, c, mesh=mesh, **options),
                *map(shard, (q, k, v, dout)), dtype)
            try:
                _check(ratios(got, list(map(shard, single)), list(map(shard, reference))),
                       schedule, dtype, where)
            except AssertionError as failure:
                failures.append(str(failure))
            sim = attention_and_grads(lambda a, b, c: dr.simulate_ring(
                a, b, c, world_size=world, **options), q, k, v, dout, dtype)
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, sim):
                if not torch.equal(a, shard(b)):
                    failures.append(f"{where}: {name} differs from simulate_ring")


def _documents(mesh, failures):
    rank = mesh.get_local_rank()
    cu = [0, 32, 48, 128]
    q, k, v, dout = make_inputs(1, 4, 2, 128, 16, seed=12)
    sdpa = windowed_sdpa(True, (6, 0), cu)
    reference = attention_and_grads(sdpa, q, k, v, dout, torch.float64)
    single = attention_and_grads(sdpa, q, k, v, dout, torch.float32)
    for schedule in sorted(dr.SCHEDULES):
        layout = dr.SCHEDULE_LAYOUT[schedule]

        def shard(x):
            return dr.shard_sequence(x, mesh, layout=layout, cu_seqlens=torch.tensor(cu))

        got = attention_and_grads(lambda a, b, c: dr.ring_attention(
            a, b, c, mesh=mesh, schedule=schedule, is_causal=True, window=(6, 0),
            cu_seqlens=torch.tensor(cu)), *map(shard, (q, k, v, dout)), torch.float32)
        try:
            _check(ratios(got, list(map(shard, single)), list(map(shard, reference))),
                   schedule, torch.float32, f"rank {rank} {schedule} documents")
        except AssertionError as failure:
            failures.append(str(failure))


def _traffic(mesh, failures):
    """Bytes this rank sends for one layer's forward and backward: the full ring's W - 1 K/V
    messages each way (and the travelling fp32 dK/dV), against the windowed exchange's rows
    within reach (and their dK/dV coming back, which the receiver sends)."""
    world, rank = mesh.size(), mesh.get_local_rank()
    q, k, v, dout = make_inputs(1, 4, 2, world * LOCAL, 16, seed=13)
    row = 2 * k.shape[1] * k.shape[3]  # K and V elements per token

    def sent(schedule, window):
        shards = [dr.shard_sequence(x, mesh, layout=dr.SCHEDULE_LAYOUT[schedule])
                  for x in (q, k, v, dout)]
        TRAFFIC.clear()
        attention_and_grads(lambda a, b, c: dr.ring_attention(
            a, b, c, mesh=mesh, schedule=schedule, is_causal=True, window=window), *shards,
            torch.bfloat16)
        return TRAFFIC["bytes"]

    full = sent("ring", None)
    if full != (world - 1) * LOCAL * row * (2 + 2 + 4):  # K/V bf16 twice, fp32 dK/dV once
        failures.append(f"rank {rank}: the full ring sent {full} bytes")
    for schedule, window in [("ring", (5, 0)), ("ring", (40, 0)), ("zigzag", (5, 0))]:
        plans = [dense_plan(LAYOUTS[dr.SCHEDULE_LAYOUT[schedule]], r, world, LOCAL, True,
                            Window(*window), ("none", "causal")) for r in range(world)]
        mine = plans[rank]
        rows_out = sum(s.send_rows.stop - s.send_rows.start for s in mine.steps)
        rows_back = sum(s.recv_rows.stop - s.recv_rows.start for s in mine.steps)
        want = rows_out * row * (2 + 2) + rows_back * row * 4
        got = sent(schedule, window)
        if got != want or not got < full / 2:
            failures.append(f"rank {rank} {schedule} window={window}: sent {got} bytes, want "
                            f"{want} (the full ring: {full})")
    last = sent("ring", (5, 0))  # every rank: a collective
    if rank == world - 1 and last != 5 * row * 4:
        failures.append(f"rank {rank}: the last rank sent {last} bytes; it sends no K/V to rank "
                        "0 (no wrap-around), only the dK/dV of rank W-2's rows back")


def _messages(mesh, failures):
    """The windowed exchange's ``ProcessGroupComm.send_recv`` on its own: tensors of three
    dtypes, one of them a strided slice, arrive as they were sent, on every rank; the last rank
    sends nothing and rank 0 receives nothing; the bytes counted are the tensors' own. A bound
    below a message's rows is refused, on every rank, before anything is sent."""
    world, rank = mesh.size(), mesh.get_local_rank()

    def sent_by(r):  # rank r to rank r + 1: n rows (dim 2) of each
        n = 0 if r == world - 1 else r + 1
        g = torch.Generator().manual_seed(r)
        strided = torch.randn(2, 3, n + 2, 5, generator=g).bfloat16()[:, :, 1:n + 1]
        return [strided, torch.randn(1, 2, n, 3, generator=g),
                torch.arange(7 * n).view(1, 1, n, 7) * (r + 1)]

    mine, want = sent_by(rank), sent_by((rank - 1) % world)
    comm = ProcessGroupComm(mesh.get_group())
    TRAFFIC.clear()
    got = comm.send_recv(1, mine, [t.shape for t in want], world - 1).wait()
    if not all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
               for a, b in zip(got, want)):
        failures.append(f"rank {rank}: send_recv received {got}, rank {rank - 1} sent {want}")
    if TRAFFIC["bytes"] != sum(t.numel() * t.element_size() for t in mine):
        failures.append(f"rank {rank}: send_recv counted {TRAFFIC['bytes']} bytes")
    # rank W - 2 sends W - 1 rows, and rank W - 1 receives them: both refuse a bound of W - 2
    # (the others, whose messages fit it, would then wait for them: they are not asked)
    if rank >= world - 2:
        expect_error(failures, f"rank {rank} most_rows too small", ValueError,
                     lambda: comm.send_recv(1, mine, [t.shape for t in want], world - 2),
                     f"has {world - 1} rows", f"most_rows={world - 2}")


def _different_windows(mesh, failures):
    rank = mesh.get_local_rank()
    q = torch.randn(1, 2, LOCAL, 16)
    expect_error(failures, f"rank {rank} windows differ", ValueError,
                 lambda: dr.ring_attention(q, q, q, mesh=mesh, schedule="ring", is_causal=True,
                                           window=(5 + (rank == 1), 0)),
                 "called differently", "window_left", "5 on ranks 0, 2, 3; 6 on rank 1")
    expect_error(failures, f"rank {rank} bad window", ValueError,
                 lambda: dr.ring_attention(q, q, q, mesh=mesh, is_causal=True, window=(-2, 0)),
                 "window=(-2, 0) must be None or (left, right)")


def _dtensor_rule(mesh, failures):
    """SDPA on sequence-sharded DTensors with a registered window; key/value replicated too."""
    world, rank = mesh.size(), mesh.get_local_rank()
    q, k, v, dout = make_inputs(2, 4, 2, world * LOCAL, 16, seed=14)
    sdpa = windowed_sdpa(True, (9, 0))
    reference = attention_and_grads(sdpa, q, k, v, dout, torch.float64)
    single = attention_and_grads(sdpa, q, k, v, dout, torch.float32)
    for schedule, replicated in [("zigzag", False), ("ring", False), ("stripe", True)]:
        where = f"rank {rank} DTensor {schedule}" + (" replicated k/v" if replicated else "")
        layout = dr.SCHEDULE_LAYOUT[schedule]
        drt.set_sequence_schedule(mesh, schedule, window=(9, 0))
        try:
            def fn(a, b, c):
                a = DTensor.from_local(a, mesh, [Shard(2)], run_check=False)
                b, c = (DTensor.from_local(x, mesh, [Replicate()] if replicated else [Shard(2)],
                                           run_check=False) for x in (b, c))
                return F.scaled_dot_product_attention(a, b, c, is_causal=True,
                                                      enable_gqa=True).to_local()

            def shard(x):
                return dr.shard_sequence(x, mesh, layout=layout)

            kv = (lambda x: x) if replicated else shard  # replicated: whole dK/dV come back
            got = attention_and_grads(fn, shard(q), kv(k), kv(v), shard(dout), torch.float32)
            shards = (shard, shard, kv, kv)
            _check(ratios(got, [f(x) for f, x in zip(shards, single)],
                          [f(x) for f, x in zip(shards, reference)]), schedule, torch.float32,
                   where)
        except AssertionError as failure:
            failures.append(str(failure))
        finally:
            drt.clear_sequence_schedule(mesh)


class _WindowedSdpa(TorchFunctionMode):
    """On one process: the model's causal SDPA with the window as a mask (the reference)."""

    def __init__(self, window):
        super().__init__()
        self.window = window

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention and kwargs.pop("is_causal", False):
            positions = torch.arange(args[0].shape[2])
            kwargs["attn_mask"] = window_mask(positions, positions, self.window, True)
        return func(*args, **kwargs)


def _context_parallel(mesh, failures):
    world, rank = mesh.size(), mesh.get_local_rank()
    torch.manual_seed(0)
    config = LlamaConfig()
    base = Llama(config)
    gen = torch.Generator().manual_seed(15)
    ids = torch.randint(0, config.vocab_size, (2, world * LOCAL), generator=gen)
    labels = torch.randint(0, config.vocab_size, (2, world * LOCAL), generator=gen)
    window = (11, 0)

    def run(model, mode=None):
        model.zero_grad()
        if mode is None:
            loss = model(ids, labels=labels).loss
        else:
            with mode:
                loss = model(ids, labels=labels).loss
        loss.backward()
        return loss.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()}

    reference = run(copy.deepcopy(base).double(), _WindowedSdpa(window))
    unwindowed = run(copy.deepcopy(base).double())
    for schedule in ("zigzag", "ring"):
        cp = parallelize_module(copy.deepcopy(base), mesh,
                                dr.ContextParallel(schedule, window=window))
        loss, _ = run(cp)
        drt.sync_gradients(cp, mesh)
        grads = {n: p.grad.double() for n, p in cp.named_parameters()}
        dist.all_reduce(loss, group=mesh.get_group())
        loss = loss / world
        flat = rel_rms(torch.cat([grads[n].flatten() for n in grads]),
                       torch.cat([reference[1][n].flatten() for n in grads]))
        if not (rel_rms(loss, reference[0]) <= 1e-5 and flat <= 1e-5):
            failures.append(f"rank {rank} ContextParallel({schedule!r}, window={window}): loss "
                            f"{rel_rms(loss, reference[0]):.2e}, grads {flat:.2e}")
    changed = rel_rms(torch.cat([unwindowed[1][n].flatten() for n in unwindowed[1]]),
                      torch.cat([reference[1][n].flatten() for n in unwindowed[1]]))
    if not changed > 100 * 1e-5:  # the unwindowed model must miss the tolerance by far
        failures.append(f"rank {rank}: the window changes the gradients by only {changed:.2e}")


def _ranks(mesh):
    failures = []
    for part in (_attention, _documents, _traffic, _messages, _different_windows, _dtensor_rule,
                 _context_parallel, _no_recompile_for_the_same_window):
        part(mesh, failures)
    assert not failures, "\n".join(failures)


def test_windows_on_4_gloo_ranks():
    run_on_ranks(4, _ranks)


class _Layer(torch.nn.Module):
    """An attention layer whose window is an attribute, as transformers' layers hold theirs."""

    def __init__(self, mesh, window):
        super().__init__()
        self.mesh, self.window = mesh, window

    def forward(self, q, k, v):
        return dr.ring_attention(q, k, v, mesh=self.mesh, schedule="zigzag", is_causal=True,
                                 window=self.window)


def _no_recompile_for_the_same_window(mesh, failures):
    """Layers compiled one by one share their compiled code where the window is the same: the
    window is a constant of the op (guarded by value), so windows [A, B, A, B, A] compile twice."""
    from torch._dynamo.testing import CompileCounter  # noqa: PLC0415

    torch._dynamo.reset()
    counter = CompileCounter()
    q = dr.shard_sequence(make_inputs(1, 4, 2, mesh.size() * LOCAL, 16, seed=16)[0], mesh)
    for window in [(5, 0), (9, 0), (5, 0), (9, 0), (5, 0)]:
        torch.compile(_Layer(mesh, window), backend=counter, fullgraph=True)(q, q[:, :2], q[:, :2])
    if counter.frame_count != 2:
        failures.append(f"rank {mesh.get_local_rank()}: {counter.frame_count} compiles for two "
                        "distinct windows")
    # A window held by a closure that changes between calls: dynamo's automatic dynamic makes it
    # symbolic at the second compile unless the op specializes it (the window is static).
    torch._dynamo.reset()
    counter = CompileCounter()
    for window in [(5, 0), (9, 0), (13, 0)]:
        def layer(a, b, c):
            return dr.ring_attention(a, b, c, mesh=mesh, schedule="zigzag", is_causal=True,
                                     window=window)
        got = torch.compile(layer, backend=counter, fullgraph=True)(q, q[:, :2], q[:, :2])
        if not torch.equal(got, layer(q, q[:, :2], q[:, :2])):
            failures.append(f"rank {mesh.get_local_rank()}: window {window} from a closure, "
                            "compiled, differs from eager")
    if counter.frame_count != 3:
        failures.append(f"rank {mesh.get_local_rank()}: {counter.frame_count} compiles for three "
                        "windows from a closure")
