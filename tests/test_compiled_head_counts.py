"""Compiled ring attention keeps its sizes constant.

A second compile with another kv head count or sequence length (a benchmark's next row, a batch
of another length) makes those sizes symbolic (automatic dynamic shapes). On GPUs, torch 2.11,
compiled llama3 then computed wrong gradients, its output right: dq/dk/dv 200-280x the
single-GPU kernel's error after another head count (2 H100s), 28-37x after another length (4
H100s), where static compiles, aot_eager and CPU inductor were right; a third length recompiled
on some ranks only, and their exchanges met the wrong collectives. The ops' fake implementation
now specialises every size of q, k and v while Dynamo traces (``dtensor_ring.ops.static_sizes``):
each head count and length gets its own graph, on every rank.

* On the CPU: the forward op's fake implementation, on fake tensors whose sizes are symbolic,
  makes q/k/v's sizes constant and leaves the documents' boundaries symbolic.
* On 2-4 GPUs: compiled llama3 at 32 then 8 kv heads, then at two other lengths, against
  float64 within the usual tolerance of the single-GPU kernel's error.
"""
import pytest
import torch
import torch.distributed as dist
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch._dynamo.testing import CompileCounter
from torch.fx.experimental.symbolic_shapes import ConstraintViolationError, DimDynamic, ShapeEnv

import dtensor_ring as dr
from dtensor_ring import ops
from dtensor_ring.tools.numerics import attention_and_grads, check_ratios, make_inputs, ratios, sdpa
from dist_utils import run_on_gpus


def _size(shape_env, name, value):
    return shape_env.create_unspecified_symint_and_symbol(value, ConstantSource(name),
                                                           DimDynamic.DYNAMIC)


def test_the_fake_forward_makes_symbolic_sizes_constant():
    shape_env = ShapeEnv()
    sizes = {name: _size(shape_env, name, value) for name, value in
             (("batch", 1), ("heads", 8), ("kv_heads", 2), ("seq", 64), ("dim", 16),
              ("boundaries", 4))}
    with FakeTensorMode(shape_env=shape_env):
        q = torch.empty(sizes["batch"], sizes["heads"], sizes["seq"], sizes["dim"])
        k = torch.empty(sizes["batch"], sizes["kv_heads"], sizes["seq"], sizes["dim"])
        cu_seqlens = torch.empty(sizes["boundaries"], dtype=torch.int32)
    symbols = {name: x.node.expr for name, x in sizes.items()}
    assert not any(shape_env.replace(x).is_number for x in symbols.values())
    store = FakeStore()
    dist.init_process_group("fake", store=store, rank=1, world_size=4)
    try:
        options = ("llama3", True, 0.25, "cpu_flash", "fp32", cu_seqlens, 64, -1, -1)
        with shape_env.ignore_fresh_unbacked_symbols():
            ops.fake_forward(q, k, k, (dist.group.WORLD.group_name,), options)
    finally:
        dist.destroy_process_group()
    now = {name: shape_env.replace(x) for name, x in symbols.items()}
    assert [now[n] for n in ("batch", "heads", "kv_heads", "seq", "dim")] == [1, 8, 2, 64, 16], now
    assert not now["boundaries"].is_number, now  # new documents, no new graph


def test_compiled_lengths_each_get_a_graph_and_a_length_marked_dynamic_is_refused():
    """End to end through Dynamo, on a fake world of 4 ranks (its exchanges move no data): a
    second length compiles a second graph (without ``static_sizes`` it would reuse one graph with
    a symbolic length), ``maybe_mark_dynamic`` included; ``mark_dynamic``, a promise that the
    length stays symbolic, is refused with Dynamo's own error naming the size."""
    store = FakeStore()
    dist.init_process_group("fake", store=store, rank=1, world_size=4)
    try:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")

        def ring(q, k, v):
            return dr.ring_attention(q, k, v, mesh=mesh, schedule="zigzag", is_causal=True)

        counter = CompileCounter()
        compiled = torch.compile(ring, backend=counter, fullgraph=True)
        for length in (32, 48, 64):
            q, k = torch.randn(1, 4, length, 16), torch.randn(1, 2, length, 16)
            torch._dynamo.maybe_mark_dynamic(q, 2)
            compiled(q, k, k)
        assert counter.frame_count == 3, counter.frame_count
        q, k = torch.randn(1, 4, 80, 16), torch.randn(1, 2, 80, 16)
        torch._dynamo.mark_dynamic(q, 2)
        with pytest.raises(ConstraintViolationError, match=r"L\['q'\]\.size\(\)\[2\]"):
            torch.compile(ring, backend="eager", fullgraph=True)(q, k, k)
    finally:
        dist.destroy_process_group()


def _llama3_after_other_sizes(rank, world):
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")

    def ring(a, b, c):
        return dr.ring_attention(a, b, c, mesh=mesh, schedule="llama3", is_causal=True)

    compiled = torch.compile(ring, fullgraph=True)
    layout = dr.SCHEDULE_LAYOUT["llama3"]
    for kv, tokens in ((32, 2048), (8, 2048), (8, 1024), (8, 1536)):
        q, k, v, dout = (x.cuda() for x in make_inputs(1, 32, kv, tokens * world, 128))
        reference = attention_and_grads(sdpa(True), q, k, v, dout, torch.float64)
        single = attention_and_grads(sdpa(True), q, k, v, dout, torch.bfloat16)
        shards = [dr.shard_sequence(x.bfloat16(), mesh, dim=2, layout=layout)
                  for x in (q, k, v, dout)]
        got = [dr.unshard_sequence(x.contiguous(), mesh, dim=2, layout=layout)
               for x in attention_and_grads(compiled, *shards, torch.bfloat16)]
        check_ratios(ratios(got, single, reference), torch.bfloat16,
                     f"rank {rank}: {kv} kv heads, {tokens} tokens per GPU")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs several GPUs")
def test_compiled_llama3_after_other_sizes_on_gpus():
    run_on_gpus(min(torch.cuda.device_count(), 4), _llama3_after_other_sizes)
