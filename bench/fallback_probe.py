"""One-GPU probe of the CUDA fallback kernels: PyTorch's memory-efficient kernel (``efficient``,
``efficient_exact``) against the plain-PyTorch ``math`` / ``math_exact`` they replace in ``auto``.

    python bench/fallback_probe.py --out fallback.json

For each case (fp32 inputs in fp32 mode; bf16 inputs with head dim 256 in exact mode, where the
Triton kernel does not apply) it runs ``simulate_ring`` (zigzag, causal) forward and backward with
each backend and records the peak memory it adds on top of its inputs, the fwd+bwd time (CUDA
events, median) and the rel-RMS / max-abs error of out, dq, dk, dv against float64 on the same
rounded inputs, next to the single-device SDPA kernel's error (a ratio of 1.00 = splitting and the
kernel added nothing over it). A backend that runs out of memory is recorded as such.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import local_median_ms  # noqa: E402

import dtensor_ring as dr  # noqa: E402
from dtensor_ring.numerics import NAMES, errors, fwd_bwd, make_inputs, sdpa  # noqa: E402

# (label, dtype, precision, heads, kv heads, head dim, global sequence, world, backends); the
# float64 reference only on the small cases (at 32K it would need ~100 GiB itself).
CASES = [
    ("fp32 inputs, fp32 mode, 4K", torch.float32, "fp32", 8, 2, 128, 4096, 4,
     ("efficient", "math")),
    ("fp32 inputs, fp32 mode, 32K", torch.float32, "fp32", 16, 4, 128, 32768, 2,
     ("efficient", "math")),
    ("bf16 d=256, exact mode, 4K", torch.bfloat16, "exact", 8, 2, 256, 4096, 4,
     ("efficient_exact", "math_exact")),
    ("bf16 d=256, exact mode, 32K", torch.bfloat16, "exact", 16, 4, 256, 32768, 2,
     ("efficient_exact", "math_exact")),
]
REFERENCE_MAX_SEQ = 4096


def run_case(label, dtype, precision, heads, kv_heads, head_dim, seq, world, backends, args):
    q64, k64, v64, d64 = (x.cuda() for x in make_inputs(1, heads, kv_heads, seq, head_dim))
    q, k, v, dout = (x.to(dtype) for x in (q64, k64, v64, d64))
    row = dict(case=label, dtype=str(dtype), precision=precision, heads=heads, kv_heads=kv_heads,
               head_dim=head_dim, seq=seq, world=world, backends={})
    reference = None
    if seq <= REFERENCE_MAX_SEQ:
        reference = fwd_bwd(sdpa(True), *(x.double() for x in (q, k, v, dout)))
        row["single_device"] = errors(fwd_bwd(sdpa(True), q, k, v, dout), reference)
    for backend in backends:
        def call(backend=backend):
            return fwd_bwd(lambda a, b, c: dr.simulate_ring(
                a, b, c, world_size=world, schedule="zigzag", is_causal=True,
                precision=precision, backend=backend), q, k, v, dout)
        found = {}
        try:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            result = call()
            torch.cuda.synchronize()
            found["added_peak_gib"] = (torch.cuda.max_memory_allocated() - before) / 2**30
            if reference is not None:
                found["errors"] = errors(result, reference)
                found["ratio_to_single"] = {
                    n: {m: found["errors"][n][m] / row["single_device"][n][m]
                        for m in ("rel_rms", "max_abs")} for n in NAMES}
            del result
            found["fwd_bwd_ms"] = local_median_ms(call, args.warmup, args.iters)
        except torch.OutOfMemoryError as error:
            found["error"] = "OutOfMemoryError: " + str(error).splitlines()[0][:200]
        torch.cuda.empty_cache()
        row["backends"][backend] = found
        print(json.dumps(dict(case=label, backend=backend, **{
            key: value for key, value in found.items() if key != "errors"})), flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    started = time.time()
    rows = [run_case(*case, args) for case in CASES]
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                cudnn=torch.backends.cudnn.version(), argv=sys.argv,
                seconds=time.time() - started)
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"{'case':34} {'backend':16} {'GiB':>7} {'ms':>8}  rel-RMS ratio out/dq/dk/dv")
    for row in rows:
        for backend, found in row["backends"].items():
            if "error" in found:
                print(f"{row['case']:34} {backend:16} {found['error'][:60]}")
                continue
            ratio = "/".join(f"{found['ratio_to_single'][n]['rel_rms']:.3f}" for n in NAMES
                             ) if "ratio_to_single" in found else "-"
            print(f"{row['case']:34} {backend:16} {found['added_peak_gib']:7.2f} "
                  f"{found['fwd_bwd_ms']:8.2f}  {ratio}")


if __name__ == "__main__":
    main()
