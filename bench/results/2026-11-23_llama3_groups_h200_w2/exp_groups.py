"""Experiment (the record of README.md here): bench/speed.py with llama3's number of KV head groups
set by LLAMA3_GROUPS instead of min(Hkv, W).

    LLAMA3_GROUPS=4 torchrun --nproc-per-node=2 bench/results/2026-11-23_llama3_groups_h200_w2/exp_groups.py \\
        --tokens-per-gpu 16384 --heads 32 --kv-heads 32,8 \\
        --methods ideal_cudnn,zigzag_fp32,llama3_fp32,llama3_exact --accuracy-max-seq 0 --out groups_4.json
"""
import os
import runpy
import sys

import dtensor_ring.schedules.llama3 as llama3

COUNT = int(os.environ["LLAMA3_GROUPS"])
BENCH = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def head_groups(kv_heads, world_size):
    count = min(kv_heads, COUNT)
    bounds = [round(i * kv_heads / count) for i in range(count + 1)]
    return [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


llama3.head_groups = head_groups
sys.path.insert(0, BENCH)
sys.argv = [os.path.join(BENCH, "speed.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
