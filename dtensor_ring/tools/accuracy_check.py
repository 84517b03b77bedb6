"""The accuracy check job: every schedule on N CPU processes, each rank's shard against float64.

``python -m dtensor_ring check`` runs it and prints, per schedule and dtype, the error of out, dq,
dk, dv as a ratio to the single-device kernel's own error on the same inputs (worst rank), and a
verdict: "ok" within the test tolerances of ``numerics.TOLERANCE``; "high" above them but below
``WRONG_RATIO`` (in fp32 mode each block's bf16-rounded dk/dv can take bf16 dv to ~1.3x: what
``precision="exact"`` is for); "WRONG" beyond that, which only a broken schedule reaches (its
ratios are in the tens to thousands). The command fails only on "WRONG".
"""
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ..attention import ring_attention
from ..schedules import SCHEDULES
from ..sharding import shard_sequence
from .launch import init_from_env, launch
from .numerics import NAMES, TOLERANCE, attention_and_grads, make_inputs, ratios, sdpa

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WRONG_RATIO = 2.0


def verdict(ratio_by_name, dtype) -> str:
    worst = max(ratio_by_name.values())
    return "ok" if worst <= TOLERANCE[dtype] else "high" if worst <= WRONG_RATIO else "WRONG"


def _rank_main(schedules, dtypes, seq, heads, kv_heads, head_dim):
    init_from_env("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rows = []
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        q, k, v, dout = make_inputs(1, heads, kv_heads, seq, head_dim, seed=0)
        reference = attention_and_grads(sdpa(True), q, k, v, dout, torch.float64)
        single = attention_and_grads(sdpa(True), q, k, v, dout, dtype)
        for schedule in schedules:
            layout = SCHEDULES[schedule].layout.name

            def shard(x, layout=layout):
                return shard_sequence(x, mesh, layout=layout)

            def ring(a, b, c, schedule=schedule):
                return ring_attention(a, b, c, mesh=mesh, schedule=schedule, is_causal=True)

            start = time.perf_counter()
            got = attention_and_grads(ring, *map(shard, (q, k, v, dout)), dtype)
            seconds = time.perf_counter() - start
            rows.append(dict(schedule=schedule, dtype=dtype_name, seconds=seconds,
                             ratios=ratios(got, list(map(shard, single)),
                                           list(map(shard, reference)))))
    # Worst rank: every rank holds the same rows, so a MAX all-reduce of their numbers is enough.
    worst = torch.tensor([[row["seconds"], *row["ratios"].values()] for row in rows],
                         dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    dist.destroy_process_group()
    return [dict(row, seconds=w[0].item(), ratios=dict(zip(NAMES, w[1:].tolist())))
            for row, w in zip(rows, worst)]


def run_check(nproc=4, schedules=tuple(sorted(SCHEDULES)), dtypes=("float32", "bfloat16"),
              seq=1024, heads=8, kv_heads=2, head_dim=64):
    """Launch the check and print its table; returns the rows and whether every row passed."""
    print(f"dtensor_ring check: causal ring attention on {nproc} CPU processes (gloo), "
          f"{seq} tokens, {heads} q / {kv_heads} kv heads, head_dim {head_dim}")
    print("Error vs float64 (rel-RMS) as a ratio to the single-device kernel's own error on the "
          "same inputs, worst rank; 1.00 = splitting added no error.")
    rows = launch(_rank_main, nproc, schedules, dtypes, seq, heads, kv_heads, head_dim)[0]
    print(f"{'schedule':9} {'dtype':9} {'out':>5} {'dq':>5} {'dk':>5} {'dv':>5} "
          f"{'fwd+bwd s':>9}  verdict (tolerance)")
    verdicts = []
    for row in rows:
        dtype = DTYPES[row["dtype"]]
        verdicts.append(verdict(row["ratios"], dtype))
        cells = " ".join(f"{row['ratios'][n]:5.2f}" for n in NAMES)
        print(f"{row['schedule']:9} {row['dtype']:9} {cells} {row['seconds']:9.3f}  "
              f"{verdicts[-1]} ({TOLERANCE[dtype]:.2f}x)")
    if "WRONG" in verdicts:
        print(f"WRONG: some schedule is more than {WRONG_RATIO}x the kernel's error")
    elif "high" in verdicts:
        print("correct; some fp32-mode bf16 gradients are above the test tolerance (each block's "
              "dk/dv is rounded to bf16 by the kernel before the fp32 sum)")
    else:
        print("all schedules within the test tolerances")
    return rows, "WRONG" not in verdicts
