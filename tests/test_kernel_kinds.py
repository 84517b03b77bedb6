"""bench/kernel_kinds.py: kernel names sorted into kinds, and a profiler trace into per-phase launch
counts and GPU time, on a synthetic chrome trace shaped like torch.profiler's (no GPU here)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import kernel_kinds  # noqa: E402

NAMES = {
    "attention": [
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1_"
        "kernel0_0",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<"
        "128, 64, 128, 8, 2, 4, 2, false, false, cutlass::bfloat16_t>, true, false>"
        "(Flash_bwd_params)",
        "fmha_cutlassB_bf16_aligned_64x64_k128_sm80", "_forward", "_dq", "_dkdv"],
    "merge/accumulation": [
        "_merge_many", "_sum_many",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
        "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<float>, "
        "std::array<char*, 3ul>)"],
    "copies": [
        "_to_fp16",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::"
        "TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::"
        "{lambda(float)#1}, std::array<char*, 2ul>, 4, TrivialOffsetCalculator<1, unsigned int>, "
        "at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int)",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous "
        "namespace)::OpaqueType<2u>, unsigned int, 5, 64, 64>(...)"],
    "other": [
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
        "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::"
        "AbsMaxOps<float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, "
        "at::native::AbsMaxOps<float>, unsigned int, float, 4, 4>)",
        "some_new_kernel"],
}


@pytest.mark.parametrize("kind, name", [(k, n) for k, names in NAMES.items() for n in names])
def test_kernel_names_sorted_into_kinds(kind, name):
    assert kernel_kinds.kind_of(name) == kind


def test_memcpy_is_a_copy_and_memset_other():
    assert kernel_kinds.kind_of("Memcpy DtoD (Device -> Device)", "gpu_memcpy") == "copies"
    assert kernel_kinds.kind_of("Memset (Device)", "gpu_memset") == "other"


def _x(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def test_trace_split_by_phase_and_kind():
    # Two iterations; host ranges fwd [0, 100) and bwd [100, 300), then [1000, 1100), [1100, 1300).
    events = []
    for it, base in enumerate((0, 1000)):
        c = 10 * it
        events += [
            _x("user_annotation", "per_rank.fwd", base, 100),
            _x("user_annotation", "per_rank.bwd", base + 100, 200),
            _x("user_annotation", "unrelated", base, 300),
            _x("cuda_runtime", "cudaLaunchKernelExC", base + 10, 5, correlation=c + 1),
            _x("cuda_driver", "cuLaunchKernel", base + 20, 5, correlation=c + 2),
            _x("cuda_runtime", "cudaLaunchKernel", base + 150, 5, correlation=c + 3),
            _x("cuda_driver", "cuLaunchKernel", base + 160, 5, correlation=c + 4),
            _x("cuda_runtime", "cudaMemsetAsync", base + 170, 5, correlation=c + 5),
            _x("kernel", NAMES["attention"][0], base + 400, 50, correlation=c + 1),
            _x("kernel", "_merge_many", base + 450, 6, correlation=c + 2),
            _x("kernel", NAMES["copies"][1], base + 460, 4, correlation=c + 3),
            _x("kernel", "_dkdv", base + 470, 40, correlation=c + 4),
            _x("gpu_memset", "Memset (Device)", base + 510, 2, correlation=c + 5),
            # launched where the trace holds no launch: placed by the GPU-side span
            _x("gpu_user_annotation", "per_rank.bwd", base + 455, 100),
            _x("kernel", "some_new_kernel", base + 520, 8, correlation=999 + it),
        ]
    events.append(_x("kernel", "stray", 5000, 1, correlation=12345))
    got = kernel_kinds.breakdown(events, iters=2, prefix="per_rank.")
    assert set(got) == {"fwd", "bwd", "unattributed"}
    fwd, bwd = got["fwd"], got["bwd"]
    assert fwd["launches"] == 2 and bwd["launches"] == 4
    assert fwd["kinds"] == pytest.approx({"attention": 0.050, "copies": 0.0,
                                          "merge/accumulation": 0.006, "other": 0.0})
    assert bwd["kinds"] == pytest.approx({"attention": 0.040, "copies": 0.004,
                                          "merge/accumulation": 0.0, "other": 0.010})
    assert bwd["gpu_ms"] == pytest.approx(0.054)
    assert [n for n, _, _ in bwd["other_top"]] == ["some_new_kernel", "Memset (Device)"]
    assert bwd["top"][0] == ["_dkdv", 0.04, 1.0]
    assert got["unattributed"]["launches"] == 0.5
