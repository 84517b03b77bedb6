"""precision="exact" on CPU (PyTorch's CPU flash kernel on fp32-upcast blocks): error that does not
grow with the number of ranks.

Errors are rel-RMS against float64 attention on the same bf16-rounded inputs, so only arithmetic is
measured. Tolerance: 1.02x, of (a) the single-device SDPA kernel's error in bf16 and (b) the exact
path's own error at W = 1 (the exact kernel on the whole sequence) - nothing but the final cast may
round, so splitting may add no more than noise. The fp32 path, whose blocks come back rounded to
bf16, exceeds that bound for every ring-pass schedule (measured 1.05-1.24x at W = 2..16, growing
with W for ring and zigzag): that is the check that the tolerance can fail.
"""
import pytest
import torch

import dtensor_ring as dr
from dist_utils import run_on_ranks
from dtensor_ring.kernels import EXACT_BACKENDS, get_kernel
from dtensor_ring.kernels.base import CAUSAL, CAUSAL_BOTTOM_RIGHT, NONE
from dtensor_ring.tools.numerics import attention_and_grads, make_inputs, ratios, rel_rms, sdpa

EXACT_TOLERANCE = 1.02
SEQ, WORLDS = 256, (2, 4, 8, 16)


def _rounded(tensors, dtype=torch.bfloat16):
    return [x.to(dtype).double() for x in tensors]


def _simulated(world, schedule, precision, causal=True):
    return lambda a, b, c: dr.simulate_ring(a, b, c, world_size=world, schedule=schedule,
                                            is_causal=causal, precision=precision)


@pytest.mark.parametrize("schedule", sorted(dr.SCHEDULES))
def test_exact_error_does_not_grow_with_world_size_while_fp32_does(schedule):
    inputs = make_inputs(1, 4, 2, SEQ, 64)
    reference = attention_and_grads(sdpa(True), *_rounded(inputs), torch.float64)
    single = attention_and_grads(sdpa(True), *inputs, torch.bfloat16)
    exact_w1 = attention_and_grads(_simulated(1, schedule, "exact"), *inputs, torch.bfloat16)
    fp32_w1 = attention_and_grads(_simulated(1, schedule, "fp32"), *inputs, torch.bfloat16)
    fp32_growth = {}
    for world in WORLDS:
        exact = attention_and_grads(_simulated(world, schedule, "exact"), *inputs, torch.bfloat16)
        for baseline, what in ((single, "single-device SDPA"), (exact_w1, "exact at W=1")):
            bad = {n: round(r, 4) for n, r in ratios(exact, baseline, reference).items()
                   if not r <= EXACT_TOLERANCE}
            assert not bad, f"{schedule} W={world}: exact/{what} above {EXACT_TOLERANCE}: {bad}"
        fp32 = attention_and_grads(_simulated(world, schedule, "fp32"), *inputs, torch.bfloat16)
        fp32_growth[world] = max(ratios(fp32, fp32_w1, reference).values())
    if schedule == "llama3":
        # One bottom-right kernel call per q chunk: no merge, so fp32 mode's out/dq equal W = 1's.
        # (Its dk/dv sums are rounded per block too, but the CPU bf16 kernel's own dk/dv error on
        # the whole sequence is larger than that, so it shows no growth here; on GPUs it does.)
        assert all(0.5 < g <= EXACT_TOLERANCE for g in fp32_growth.values()), fp32_growth
    else:
        assert min(fp32_growth.values()) > 1.04, f"{schedule}: fp32 path {fp32_growth}"


def test_exact_path_returns_the_input_dtype_and_keeps_the_fp32_out_for_backward():
    q, k, v, dout = (x.to(torch.bfloat16) for x in make_inputs(1, 2, 1, 32, 16))
    q.requires_grad_()
    out = dr.simulate_ring(q, k, v, world_size=4, schedule="zigzag", is_causal=True,
                           precision="exact")
    assert out.dtype == torch.bfloat16
    out.backward(dout)
    assert q.grad.dtype == torch.bfloat16
    kernel = get_kernel("auto", q.device, q.dtype, 16, precision="exact")
    assert kernel.name == "cpu_flash_exact" and kernel.exact


@pytest.mark.parametrize("name,device", [("cpu_flash_exact", "cpu"), ("math_exact", "cpu"),
                                         ("efficient_exact", "cuda")])
@pytest.mark.parametrize("mask", [NONE, CAUSAL, CAUSAL_BOTTOM_RIGHT])
def test_upcast_kernels_return_fp32_results(name, device, mask):
    """The upcast exact kernels are fp32 kernels on upcast blocks: fp32 out/LSE/grads, with the
    error of fp32 arithmetic (<= 1.1x the fp32 CPU SDPA kernel's own on the same inputs); the same
    results rounded to bf16, as the fp32 path's kernels return them, are ~100x worse and fail.
    The lengths (24, 16 x 40) are not multiples of the efficient kernel's 32-row LSE padding."""
    kernel, scale, device = EXACT_BACKENDS[name], 16 ** -0.5, torch.device(device)
    if not kernel.available(device, torch.bfloat16, 16):
        pytest.skip(f"{name} does not run on {device} here")
    sq, sk = (24, 24) if mask != CAUSAL_BOTTOM_RIGHT else (16, 40)
    q, k, v, dout = make_inputs(2, 4, 2, sk, 16, seed=3)
    q, dout = q[:, :, :sq], dout[:, :, :sq]
    low = [x.to(torch.bfloat16) for x in (q, k, v, dout)]
    allowed = (None if mask == NONE else
               torch.ones(sq, sk, dtype=torch.bool).tril(0 if mask == CAUSAL else sk - sq))

    def sdpa_masked(a, b, c):
        return torch.nn.functional.scaled_dot_product_attention(a, b, c, attn_mask=allowed,
                                                                enable_gqa=True)

    reference = attention_and_grads(sdpa_masked, *_rounded(low), torch.float64)
    fp32_single = attention_and_grads(sdpa_masked, *_rounded(low), torch.float32)
    on_device = [x.to(device) for x in low]
    out, lse = kernel.forward(*on_device[:3], mask, scale)
    grads = kernel.backward(on_device[3], *on_device[:3], out, lse, mask, scale)
    for tensor_name, x, s, ref in zip("out dq dk dv".split(), (out, *grads), fp32_single,
                                      reference):
        assert x.dtype == torch.float32, tensor_name
        x = x.cpu()
        assert rel_rms(x, ref) <= 1.1 * rel_rms(s, ref) + 1e-7, tensor_name
        assert rel_rms(x.bfloat16(), ref) > 10 * rel_rms(s, ref), tensor_name


def _ring_matches_simulation(mesh):
    world = mesh.size()
    for schedule in sorted(dr.SCHEDULES):
        q, k, v, dout = make_inputs(1, 4, 2, 32 * world, 16)
        layout = dr.SCHEDULE_LAYOUT[schedule]

        def shard(x, layout=layout):
            return dr.shard_sequence(x, mesh, layout=layout)

        def ring(a, b, c, schedule=schedule):
            return dr.ring_attention(a, b, c, mesh=mesh, schedule=schedule, is_causal=True,
                                     precision="exact")

        got = attention_and_grads(ring, *map(shard, (q, k, v, dout)), torch.bfloat16)
        sim = attention_and_grads(_simulated(world, schedule, "exact"), q, k, v, dout,
                                  torch.bfloat16)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, sim):
            assert a.dtype == torch.bfloat16, f"{schedule} {name}"
            assert torch.equal(a, shard(b)), f"{schedule}: {name} differs from simulate_ring"


def test_ring_attention_exact_on_two_gloo_ranks_is_the_simulation():
    run_on_ranks(2, _ring_matches_simulation)


def _rule_exact(mesh):
    """SDPA on DTensors with precision="exact": the rule keeps the fp32 out for the backward."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.nn.functional import scaled_dot_product_attention

    from dtensor_ring import dtensor as drt
    from dtensor_ring.dtensor import kept_out

    world = mesh.size()

    def attend(a, b, c):
        return scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)

    def on_dtensors(fn, drop_kept=False):
        def run(a, b, c):
            out = fn(*(DTensor.from_local(x, mesh, [Shard(2)], run_check=False)
                       for x in (a, b, c)))
            if drop_kept:  # the backward then sees only the bf16 out autograd saved
                kept_out._KEPT.clear()
            return out.to_local()
        return run

    inputs = make_inputs(1, 4, 2, 128 * world, 64)
    reference = attention_and_grads(sdpa(True), *_rounded(inputs), torch.float64)
    for schedule in sorted(dr.SCHEDULES):
        layout = dr.SCHEDULE_LAYOUT[schedule]

        def shard(x, layout=layout):
            return dr.shard_sequence(x, mesh, layout=layout)

        sim = attention_and_grads(_simulated(world, schedule, "exact"), *inputs, torch.bfloat16)
        drt.set_sequence_schedule(mesh, schedule, precision="exact")
        try:
            got = attention_and_grads(on_dtensors(attend), *map(shard, inputs), torch.bfloat16)
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, sim):
                assert torch.equal(a, shard(b)), f"{schedule}: {name} differs from simulate_ring"
            assert len(kept_out._KEPT) == 1, f"{schedule}: {len(kept_out._KEPT)} fp32 outs kept"
            del got  # the bf16 out (got[0]) was the last holder of its storage
            assert not kept_out._KEPT, f"{schedule}: the fp32 out outlived the bf16 one"
            # Without the kept fp32 out, D comes from the rounded out: measured 1.08-1.10x the
            # error in dq and dk, so the 1.02 bound tells the two apart.
            def whole_ratios(fn, layout=layout):  # over the whole sequence, on every rank
                local = attention_and_grads(fn, *map(shard, inputs), torch.bfloat16)
                got = [dr.unshard_sequence(x.contiguous(), mesh, layout=layout) for x in local]
                return ratios(got, sim, reference)

            worse = whole_ratios(on_dtensors(attend, drop_kept=True))
            assert min(worse["dq"], worse["dk"]) > EXACT_TOLERANCE, f"{schedule}: {worse}"
            if schedule == "zigzag":  # traced: the joint graph carries the fp32 out instead
                close = whole_ratios(on_dtensors(torch.compile(attend)))
                assert max(close.values()) <= EXACT_TOLERANCE, f"compiled: {close}"
        finally:
            drt.clear_sequence_schedule(mesh)
    _rule_exact_replicated_kv(mesh, inputs, reference)


def _rule_exact_replicated_kv(mesh, inputs, reference):
    """Query sharded, key/value replicated (local attention): exact mode sums the ranks' fp32
    dk/dv shares before rounding; fp32 mode's bf16 ``Partial`` shares measured 1.4-1.5x."""
    from torch.distributed.tensor import DTensor, Replicate

    from dtensor_ring import dtensor as drt

    exact_w1 = attention_and_grads(_simulated(1, "zigzag", "exact"), *inputs, torch.bfloat16)
    found = {}
    for precision in ("exact", "fp32"):
        drt.set_sequence_schedule(mesh, "zigzag", precision=precision)

        def attend(a, b, c):
            kv = (DTensor.from_local(x, mesh, [Replicate()]) for x in (b, c))
            out = torch.nn.functional.scaled_dot_product_attention(
                drt.distribute_sequence(a, mesh), *kv, is_causal=True, enable_gqa=True)
            return drt.sequence_full_tensor(out)

        try:
            got = attention_and_grads(attend, *inputs, torch.bfloat16)
        finally:
            drt.clear_sequence_schedule(mesh)
        torch.distributed.all_reduce(got[1])  # each rank's leaf holds its own rows' dq
        found[precision] = ratios(got, exact_w1, reference)
    assert max(found["exact"].values()) <= EXACT_TOLERANCE, found
    assert min(found["fp32"]["dk"], found["fp32"]["dv"]) > EXACT_TOLERANCE, found


def test_dtensor_rule_exact_mode_is_the_simulation_and_needs_the_fp32_out():
    """The DTensor rule in exact mode gives simulate_ring's bits (eager; compiled within 1.02x),
    and without the fp32 out it keeps, its dq/dk error exceeds the 1.02 bound; with key/value
    replicated, its dk/dv are within 1.02x of exact mode at W = 1."""
    run_on_ranks(2, _rule_exact)


def test_kept_out_lives_exactly_as_long_as_the_rounded_out():
    """kept_out finds the fp32 out through any tensor sharing the rounded out's storage (views,
    detached copies: what autograd saves), drops it when that storage is freed, and refuses to
    key an out by itself (the entry would never be freed)."""
    from dtensor_ring.dtensor import kept_out

    fp32_out = torch.randn(1, 2, 8, 4)
    rounded = fp32_out.to(torch.bfloat16)
    kept_out.keep(rounded, fp32_out)
    saved = rounded.detach()
    del rounded
    assert kept_out.kept(saved) is fp32_out
    assert kept_out.kept(saved[:, :1]) is None  # another shape: not this out
    assert kept_out.kept(fp32_out.to(torch.bfloat16)) is None  # another storage
    del saved
    assert not kept_out._KEPT
    with pytest.raises(ValueError, match="rounded has fp32_out's dtype torch.float32"):
        kept_out.keep(fp32_out, fp32_out)
