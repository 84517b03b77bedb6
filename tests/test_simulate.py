"""simulate_ring: the real schedule code on W simulated ranks in one process, against float64.

Covers what the gloo tests cannot afford: W up to 64, odd W, head dims 64/80/128, fp16, batch > 1,
an explicit ``scale``, llama3's split path for kernels without a bottom-right causal mask, and a
deliberately wrong schedule that the tolerances must reject.
"""
import pytest
import torch

import dtensor_ring as dr
from dtensor_ring.call import RingCall
from dtensor_ring.kernels import BACKENDS
from dtensor_ring.kernels.base import CAUSAL, NONE
from dtensor_ring.kernels.cpu_flash import CpuFlash
from dtensor_ring.layouts import Block
from dtensor_ring.layouts.stripe import Stripe
from dtensor_ring.schedules.ring import RingSchedule
from dtensor_ring.tools.numerics import (attention_and_grads, check_ratios, make_inputs, ratios,
                                         rel_rms, sdpa)


def _check(schedule, world, dtype, *, is_causal=True, head_dim=64, q_heads=4, kv_heads=2,
           local=16, scale=None, backend="auto", seed=0, device="cpu"):
    q, k, v, dout = (x.to(device) for x in make_inputs(2, q_heads, kv_heads, local * world,
                                                       head_dim, seed))
    reference = attention_and_grads(
        lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
            a, b, c, is_causal=is_causal, scale=scale, enable_gqa=True), q, k, v, dout,
        torch.float64)
    single = attention_and_grads(
        lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
            a, b, c, is_causal=is_causal, scale=scale, enable_gqa=True), q, k, v, dout, dtype)
    got = attention_and_grads(
        lambda a, b, c: dr.simulate_ring(a, b, c, world_size=world, schedule=schedule,
                                         is_causal=is_causal, scale=scale, backend=backend),
        q, k, v, dout, dtype)
    check_ratios(ratios(got, single, reference), dtype,
                 f"{schedule} W={world} {dtype} causal={is_causal} d={head_dim}")


@pytest.mark.parametrize("schedule", sorted(dr.SCHEDULES))
@pytest.mark.parametrize("world", [5, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_schedules_at_larger_and_odd_world_sizes(schedule, world, dtype):
    _check(schedule, world, dtype)


@pytest.mark.parametrize("schedule", sorted(dr.SCHEDULES))
@pytest.mark.parametrize("head_dim", [80, 128])
def test_head_dims_fp16_and_scale(schedule, head_dim):
    _check(schedule, 3, torch.float16, head_dim=head_dim, q_heads=2, kv_heads=2, scale=0.3)
    _check(schedule, 3, torch.float32, is_causal=False, head_dim=head_dim, q_heads=6,
           kv_heads=3, scale=0.3)


@pytest.mark.parametrize("schedule", sorted(dr.SCHEDULES))
def test_runs_at_64_simulated_ranks(schedule):
    """At W = 64 each row merges up to 64 blocks, each rounded to the input dtype by the kernel:
    the fp32 path's error grows with W (measured 1.12-1.56x here for the ring schedules, ~1.0x for
    llama3, which gathers instead of merging). Bound: 2x; ``precision="exact"`` is the fix."""
    q, k, v, dout = make_inputs(1, 2, 1, 64 * 4, 64)
    reference = attention_and_grads(sdpa(True), q, k, v, dout, torch.float64)
    single = attention_and_grads(sdpa(True), q, k, v, dout, torch.float32)
    got = attention_and_grads(
        lambda a, b, c: dr.simulate_ring(a, b, c, world_size=64, schedule=schedule,
                                         is_causal=True), q, k, v, dout, torch.float32)
    worst = max(ratios(got, single, reference).values())
    assert worst <= 2.0, f"{schedule} at W=64: error ratio {worst:.3f}"


class SquareCausalOnly(CpuFlash):
    """The CPU kernel without the bottom-right mask, as cuDNN is: llama3 must split and merge."""
    name = "cpu_flash_square_causal_only"
    masks = (NONE, CAUSAL)


@pytest.mark.parametrize("world,kv_heads", [(1, 2), (2, 1), (4, 2), (8, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama3_without_bottom_right_mask_splits_and_merges(monkeypatch, world, kv_heads, dtype):
    monkeypatch.setitem(BACKENDS, SquareCausalOnly.name, SquareCausalOnly())
    # The split path (the rank's own causal block, then up to two blocks per head group merged
    # into it) merges in fp32: bf16 within the usual 1.25x; fp32 within 1.2x (the merge's own
    # rounding is of the order of the fp32 kernel's, 1.10-1.13x measured at W = 4), which is why
    # kernels with the bottom-right mask skip it. W = 1 and 2 have no X or no Y block on a rank.
    _check("llama3", world, dtype, backend=SquareCausalOnly.name, local=32, head_dim=64,
           kv_heads=kv_heads)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA kernels need a GPU")
@pytest.mark.parametrize("schedule", sorted(dr.SCHEDULES))
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_schedules_on_the_cuda_kernels(schedule, world):
    """bf16 on the kernel ``auto`` picks on a GPU (cuDNN on Hopper, whose square-only causal mask
    sends llama3 down the split path), against float64 SDPA, as on the CPU."""
    _check(schedule, world, torch.bfloat16, q_heads=8, kv_heads=2, local=256, head_dim=128,
           device="cuda")


class _OffByOneStripe(Stripe):
    """A broken stripe layout: K/V from later ranks seen with the diagonal (token i sees i + 1)."""

    def causal_ring_blocks(self, local_len, rank, src, world_size):
        return [Block(slice(0, local_len), slice(0, local_len), CAUSAL)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_off_by_one_causal_mask_fails_the_tolerance(dtype):
    q, k, v, dout = make_inputs(2, 4, 2, 64, 64)
    reference = attention_and_grads(sdpa(True), q, k, v, dout, torch.float64)
    single = attention_and_grads(sdpa(True), q, k, v, dout, dtype)
    wrong = RingSchedule("stripe", _OffByOneStripe())
    call = RingCall(schedule="stripe", mesh_shape=(4, 1), is_causal=True, scale=64 ** -0.5,
                    backend="cpu_flash", precision="fp32", placed=wrong)
    got = attention_and_grads(
        lambda a, b, c: dr.attention._SimulatedRing.apply(a, b, c, 4, call, None),
        q, k, v, dout, dtype)
    with pytest.raises(AssertionError, match="error ratio"):
        check_ratios(ratios(got, single, reference), dtype)
    assert rel_rms(got[0], reference[0]) > 10 * rel_rms(single[0], reference[0])


@pytest.mark.parametrize("q_heads,kv_heads,picked", [(8, 2, "llama3"), (4, 4, "zigzag")])
def test_auto_picks_llama3_for_strong_gqa_and_zigzag_otherwise(q_heads, kv_heads, picked):
    assert dr.SCHEDULE_LAYOUT["auto"] == "zigzag"
    q, k, v, dout = make_inputs(1, q_heads, kv_heads, 64, 16)
    reference = attention_and_grads(sdpa(True), q, k, v, dout, torch.float64)
    single = attention_and_grads(sdpa(True), q, k, v, dout, torch.float32)
    results = {
        name: attention_and_grads(lambda a, b, c, name=name: dr.simulate_ring(
            a, b, c, world_size=4, schedule=name, is_causal=True), q, k, v, dout, torch.float32)
        for name in ("auto", picked)}
    for got, want in zip(results["auto"], results[picked]):
        assert torch.equal(got, want)
    check_ratios(ratios(results["auto"], single, reference), torch.float32, "auto")
