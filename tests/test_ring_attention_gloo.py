"""ring_attention on real gloo process groups at W = 1..4: every schedule, causal and not, GQA and
MHA, fp32 and bf16. Every rank checks its shard of out, dq, dk, dv against a float64 reference of the
whole attention (tolerances: dtensor_ring/tools/numerics.py), and that simulate_ring gives the same
bits."""
import itertools

import pytest
import torch

import dtensor_ring as dr
from dist_utils import run_on_ranks
from dtensor_ring.kernels import BACKENDS
from dtensor_ring.tools.numerics import attention_and_grads, check_ratios, make_inputs, ratios, sdpa
from test_simulate import SquareCausalOnly

CASES = list(itertools.product(sorted(dr.SCHEDULES), (True, False), (2, 4),
                               (torch.float32, torch.bfloat16)))


def _check_case(mesh, schedule, causal, kv_heads, dtype, seed, backend="auto"):
    """One case on this rank: its shard of out, dq, dk, dv against float64 (AssertionError
    naming the case otherwise), and the same bits as simulate_ring."""
    world, rank = mesh.size(), mesh.get_local_rank()
    where = f"rank {rank}/{world} {schedule} causal={causal} kv_heads={kv_heads} {dtype}"
    if backend != "auto":
        where += f" {backend}"
    q, k, v, dout = make_inputs(2, 4, kv_heads, 64 * world, 64, seed=seed)
    reference = attention_and_grads(sdpa(causal), q, k, v, dout, torch.float64)
    single = attention_and_grads(sdpa(causal), q, k, v, dout, dtype)
    options = dict(schedule=schedule, is_causal=causal, backend=backend)

    def shard(x):
        return dr.shard_sequence(x, mesh, layout=dr.SCHEDULE_LAYOUT[schedule])

    got = attention_and_grads(lambda a, b, c: dr.ring_attention(a, b, c, mesh=mesh, **options),
                              *map(shard, (q, k, v, dout)), dtype)
    check_ratios(ratios(got, list(map(shard, single)), list(map(shard, reference))), dtype, where)
    sim = attention_and_grads(lambda a, b, c: dr.simulate_ring(a, b, c, world_size=world,
                                                               **options), q, k, v, dout, dtype)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, sim):
        assert torch.equal(a, shard(b)), f"{where}: {name} differs from simulate_ring"


def _check_all_cases(mesh):
    failures = []
    for i, (schedule, causal, kv_heads, dtype) in enumerate(CASES):
        try:
            _check_case(mesh, schedule, causal, kv_heads, dtype, seed=i)
        except AssertionError as failure:
            failures.append(str(failure))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_schedule_matches_float64_on_every_rank(world_size):
    run_on_ranks(world_size, _check_all_cases)


def _check_llama3_split(mesh):
    BACKENDS[SquareCausalOnly.name] = SquareCausalOnly()  # this rank process's registry
    for dtype in (torch.float32, torch.bfloat16):
        _check_case(mesh, "llama3", True, 2, dtype, seed=mesh.size(),
                    backend=SquareCausalOnly.name)


@pytest.mark.parametrize("world_size", [2, 4])
def test_llama3_without_a_bottom_right_mask_on_gloo(world_size):
    """llama3's path for kernels without the bottom-right mask (cuDNN): sequence-major messages
    and its own reduce-scatter layout, on real collectives."""
    run_on_ranks(world_size, _check_llama3_split)
