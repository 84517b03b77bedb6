#!/bin/bash
# Issue 5 before/after on 2 GPUs, in one lease: the schedules at commit 068ab7d ("old", the tree in
# .bench_old/, made by `git archive 068ab7d dtensor_ring passes pyproject.toml README.md`) and at
# this commit ("new"), then "new" with NCCL's streams at high priority (a user setting). Each is
# its own torchrun of the same bench/speed.py; the single-GPU ideal is measured in the "new" run
# and used for all three. Run from the repository root with $OUT set; writes $OUT/results.tar.gz.
# Arguments: which of old, new, hp, test to run (default: all four).
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
R=$PWD
W=$OUT/w
mkdir -p "$W"
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/new . >/dev/null || exit 3
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/old .bench_old >/dev/null \
    || exit 3
nvidia-smi topo -m > "$W/topo.txt" 2>&1
SCHEDULES=ring_fp32,zigzag_fp32,stripe_fp32,llama3_fp32
SWEEP="--tokens-per-gpu 8192,16384,32768 --heads 32 --kv-heads 32,8 --iters 20 --warmup 3"
cd /tmp || exit 3
speed() {  # name, site-packages dir, speed.py arguments...
    local name=$1 site=$2
    shift 2
    PYTHONPATH=$site:$R/bench python3 -m torch.distributed.run --nproc-per-node=2 \
        "$R/bench/speed.py" --out "$W/speed_$name.json" "$@" 2>&1 | tee "$W/log_$name.txt" \
        | grep -E "^\[|rror"
}
RUNS=${*:-old new hp test}
want() { [[ " $RUNS " == *" $1 "* ]]; }
want old && speed old /tmp/old $SWEEP --methods $SCHEDULES --accuracy-max-seq 0 \
    --also-non-causal 8192 --non-causal-methods ring_fp32 --budget-s 110
want new && speed new /tmp/new $SWEEP --methods ideal_cudnn,$SCHEDULES --also-non-causal 8192 \
    --non-causal-methods ideal_cudnn,ring_fp32 --profile "$W/profile_new.txt" --budget-s 130
want hp && speed hp /tmp/new $SWEEP --methods zigzag_fp32,stripe_fp32,llama3_fp32 --accuracy-max-seq 0 \
    --nccl-high-priority --profile "$W/profile_hp.txt" --budget-s 70
want test && PYTHONPATH=/tmp/new timeout 60 python3 -m pytest -q -p no:cacheprovider \
    "$R/tests/test_triton_merge.py" 2>&1 | tail -2 | tee "$W/gpu_test_triton_merge.txt"
gzip -f "$W"/*.trace.json
tar -czf "$OUT/results.tar.gz" -C "$W" .
ls -la "$W"
