"""Compiled ring attention keeps its head counts constant.

A second compile with another kv head count (a benchmark's next row, a model with other kv heads)
makes the head dims symbolic (automatic dynamic shapes). On 2 H100s, torch 2.11, compiled llama3
then computed wrong gradients (dq/dk/dv 200-280x the single-GPU kernel's error, its output right)
where a static compile, aot_eager and CPU inductor were right. The compile pass now specialises
the head counts before it expands a call (``passes/ring_expand._static_heads``): each head count
gets its own graph.

* On the CPU: the pass's specialisation, on fake tensors whose head dims are symbolic (the
  sequence stays symbolic).
* On two or more GPUs: compiled llama3 at 32 then 8 kv heads, against float64 within the usual
  tolerance of the single-GPU kernel's error (the failure above, reproduced at 2K tokens per GPU).
"""
import pytest
import torch
import torch.distributed as dist
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

import dtensor_ring as dr
from dtensor_ring.passes.ring_expand import _static_heads
from dtensor_ring.tools.numerics import attention_and_grads, check_ratios, make_inputs, ratios, sdpa
from dist_utils import run_on_gpus


def _size(shape_env, name, value):
    return shape_env.create_unspecified_symint_and_symbol(value, ConstantSource(name),
                                                           DimDynamic.DYNAMIC)


def test_the_pass_makes_symbolic_head_counts_constant():
    shape_env = ShapeEnv()
    heads, kv_heads, seq, boundaries = (_size(shape_env, name, value) for name, value in
                                        (("heads", 8), ("kv_heads", 2), ("seq", 64),
                                         ("boundaries", 5)))
    with FakeTensorMode(shape_env=shape_env):
        q, k = torch.empty(1, heads, seq, 16), torch.empty(1, kv_heads, seq, 16)
        cu_seqlens = torch.empty(boundaries, dtype=torch.int32)
    symbols = [x.node.expr for x in (heads, kv_heads, seq, boundaries)]
    assert not any(shape_env.replace(x).is_number for x in symbols)
    _static_heads([q, k, cu_seqlens])
    now = [shape_env.replace(x) for x in symbols]
    assert now[:2] == [8, 2], now
    assert not now[2].is_number and not now[3].is_number, now  # the rest stays symbolic


def _llama3_after_another_head_count(rank, world):
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")

    def ring(a, b, c):
        return dr.ring_attention(a, b, c, mesh=mesh, schedule="llama3", is_causal=True)

    compiled = torch.compile(ring, fullgraph=True)
    layout = dr.SCHEDULE_LAYOUT["llama3"]
    for kv in (32, 8):
        q, k, v, dout = (x.cuda() for x in make_inputs(1, 32, kv, 2048 * world, 128))
        reference = attention_and_grads(sdpa(True), q, k, v, dout, torch.float64)
        single = attention_and_grads(sdpa(True), q, k, v, dout, torch.bfloat16)
        shards = [dr.shard_sequence(x.bfloat16(), mesh, dim=2, layout=layout)
                  for x in (q, k, v, dout)]
        got = [dr.unshard_sequence(x.contiguous(), mesh, dim=2, layout=layout)
               for x in attention_and_grads(compiled, *shards, torch.bfloat16)]
        check_ratios(ratios(got, single, reference), torch.bfloat16, f"rank {rank}: {kv} kv heads")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_compiled_llama3_after_another_head_count_on_gpus():
    run_on_gpus(2, _llama3_after_another_head_count)
