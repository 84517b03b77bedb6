"""Run-to-run reproducibility on W GPUs: the same inputs through each schedule N times; does any
output change, and where? The kernels, merges and sums are deterministic, so any difference means
a race (a buffer read before it was written, or reused while still in flight).

    torchrun --nproc-per-node=2 bench/repeat_probe.py --tokens-per-gpu 4096 --heads 8 --kv-heads 8 \\
        --repeats 6 --out repeat.json

Per schedule x precision: out, dq, dk, dv of ``ring_attention`` (local shards, before any gather)
compared bit for bit with the first call's, per rank: how many elements differ, in which local
rows, and the largest difference; then the same for the gathered (``unshard_sequence``) results,
and the error of each call against float64 (rel-RMS of out).

``--poison``: before every call, fill 8 GiB of the caching allocator's free memory with NaN (allocate,
fill, free), so a read of memory nothing wrote shows up as NaN in the outputs (counted per call).

``--record``: keep every exact-kernel forward call's inputs and outputs and every merge's accumulator
before and after, and report per call which of them differ bit-wise from the first call's: whether
a difference starts in the K/V received, in the kernel's output, or in the merge.

``--simulate``: the same on one GPU through ``simulate_ring`` (threads, one stream, no NCCL); then
``--out`` is written by the single process.
"""
import argparse
import json
import os
import threading

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dtensor_ring as dr
from dtensor_ring.numerics import NAMES, fwd_bwd, rel_rms


def compare(first, later):
    """Differences of ``later`` from ``first`` ([B, H, S, D] each): count, rows, largest."""
    diff = (later.float() - first.float()).abs()
    rows = diff.amax(dim=(0, 1, 3)).nonzero().flatten()
    return dict(count=int((diff > 0).sum()), max=float(diff.max()),
                rows=[int(rows.min()), int(rows.max())] if rows.numel() else None,
                n_rows=int(rows.numel()))


def bits(x):
    return x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def bit_diff(a, b):
    """Elements that differ bit-wise, and the rows (dim 2) they are in."""
    differ = bits(a) != bits(b)
    rows = differ.flatten(3).any(-1).any(0).any(0) if differ.dim() == 4 else \
        differ.any(0).any(0)
    found = rows.nonzero().flatten().tolist()
    return dict(count=int(differ.sum()), rows=found[:8], n_rows=len(found))


def inputs_float64(args, seq, device):
    """q, k, v, dout of the whole sequence, float64 (seed 0; the same in every process)."""
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = [(1, args.heads, seq, 128), (1, args.kv_heads, seq, 128),
              (1, args.kv_heads, seq, 128), (1, args.heads, seq, 128)]
    return [torch.randn(s, generator=gen, device=device, dtype=torch.float64) for s in shapes]


def before_call(args, recorder, device):
    if args.poison:
        torch.full((2 << 30,), float("nan"), device=device)  # freed at once, cached
    if recorder:
        recorder.start_call()


class Recorder:
    """Clones of the exact kernel's forward inputs/outputs and the merges' accumulators, per call."""

    def __init__(self):
        self.calls = []

    def install(self):
        import dtensor_ring.schedules.base as base  # noqa: PLC0415
        from dtensor_ring.kernels.triton_exact import TritonExact  # noqa: PLC0415

        forward, merge = TritonExact.forward, base.merge_

        def recorded_forward(kernel, q, k, v, mask, scale, tiles=None):
            out, lse = forward(kernel, q, k, v, mask, scale, tiles)
            self.add("forward", q=q, k=k, v=v, out=out, lse=lse)
            return out, lse

        def recorded_merge(out, lse, block_out, block_lse):
            before = out.clone(), lse.clone()
            merge(out, lse, block_out, block_lse)
            self.add("merge", out_before=before[0], lse_before=before[1], block_out=block_out,
                     block_lse=block_lse, out=out, lse=lse)

        TritonExact.forward, base.merge_ = recorded_forward, recorded_merge

    def start_call(self):
        self.calls.append({})

    def add(self, what, **tensors):
        # Per thread: simulated ranks are threads, created in rank order ("Thread-N (body)").
        thread = threading.current_thread().name
        entries = self.calls[-1].setdefault(thread, [])
        entries.append((what, {n: t.detach().clone() for n, t in tensors.items()}))

    @staticmethod
    def _in_rank_order(call):
        def number(name):
            digits = "".join(c for c in name.split(" ")[0] if c.isdigit())
            return int(digits) if digits else -1
        return [entry for name in sorted(call, key=number) for entry in call[name]]

    def report(self):
        calls = [self._in_rank_order(c) for c in self.calls]
        first = calls[0]
        found = []
        for i, call in enumerate(calls[1:], start=1):
            for j, ((what, a), (_, b)) in enumerate(zip(first, call)):
                diffs = {n: bit_diff(a[n], b[n]) for n in a}
                diffs = {n: d for n, d in diffs.items() if d["count"]}
                if diffs:
                    found.append(dict(call=i, entry=j, what=what, differ=diffs))
        return dict(entries_per_call=[len(c) for c in calls], differences=found)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens-per-gpu", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--schedules", default="zigzag,ring,stripe,llama3")
    p.add_argument("--precisions", default="exact,fp32")
    p.add_argument("--poison", action="store_true")
    p.add_argument("--backend", default="auto")
    p.add_argument("--tiles", metavar="JSON", help='launch shapes for triton_exact, e.g. '
                   '\'{"forward": [128, 128, 8, 2]}\' (Tiles fields; the rest stay TUNED)')
    p.add_argument("--record", action="store_true")
    p.add_argument("--simulate", type=int, default=0, metavar="W",
                   help="W simulated ranks on one GPU instead of a process group")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.tiles:
        from dtensor_ring.kernels.triton_exact import TUNED, Tiles  # noqa: PLC0415
        TUNED.update({part: Tiles(*shape) for part, shape in json.loads(args.tiles).items()})
    recorder = Recorder() if args.record else None
    if recorder:
        recorder.install()
    if args.simulate:
        return simulate(args, recorder)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cuda", (world,))
    x64 = inputs_float64(args, args.tokens_per_gpu * world, "cuda")
    inputs = [x.bfloat16() for x in x64]
    ref_out = torch.nn.functional.scaled_dot_product_attention(
        *x64[:3], is_causal=True, enable_gqa=args.heads != args.kv_heads)
    rows = []
    for schedule in args.schedules.split(","):
        layout = dr.SCHEDULE_LAYOUT[schedule]
        shards = [dr.shard_sequence(x, mesh, layout=layout) for x in inputs]
        for precision in args.precisions.split(","):
            def ring(a, b, c):
                return dr.ring_attention(a, b, c, mesh=mesh, schedule=schedule, is_causal=True,
                                         precision=precision, backend=args.backend)

            calls = []
            for _ in range(args.repeats):
                before_call(args, recorder, "cuda")
                local = fwd_bwd(ring, *shards)
                gathered = [dr.unshard_sequence(x.contiguous(), mesh, layout=layout)
                            for x in local]
                torch.cuda.synchronize()
                calls.append((local, [g.clone() for g in gathered]))
            row = dict(rank=rank, schedule=schedule, precision=precision,
                       out_rel_rms=[rel_rms(c[1][0], ref_out) for c in calls],
                       nan_counts=[[int(x.isnan().sum()) for x in c[0]] for c in calls])
            for i, (local, gathered) in enumerate(calls[1:], start=1):
                row[f"call{i}_local"] = {n: compare(a, b) for n, a, b in
                                        zip(NAMES, calls[0][0], local)}
                row[f"call{i}_gathered"] = {n: compare(a, b) for n, a, b in
                                           zip(NAMES, calls[0][1], gathered)}
            if recorder:
                row["record"] = recorder.report()
                recorder.calls.clear()
                print(json.dumps(dict(rank=rank, record=row["record"])), flush=True)
            rows.append(row)
            changed = sum(v[n]["count"] for k, v in row.items() if k.startswith("call")
                          for n in NAMES)
            print(json.dumps(dict(rank=rank, schedule=schedule, precision=precision,
                                  elements_changed=changed, nans=row["nan_counts"],
                                  out_rel_rms=[round(x, 7) for x in row["out_rel_rms"]])),
                  flush=True)
    everyone = [None] * world
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump([r for part in everyone for r in part], f, indent=1)
    dist.destroy_process_group()


def simulate(args, recorder):
    """The probe through ``simulate_ring`` on one GPU (whole tensors, compared as they come out)."""
    world = args.simulate
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: TRITON_INTERPRET=1 checks
    inputs = [x.bfloat16() for x in inputs_float64(args, args.tokens_per_gpu * world, device)]
    rows = []
    for schedule in args.schedules.split(","):
        for precision in args.precisions.split(","):
            def ring(a, b, c):
                return dr.simulate_ring(a, b, c, world_size=world, schedule=schedule,
                                        is_causal=True, precision=precision,
                                        backend=args.backend)

            calls = []
            for _ in range(args.repeats):
                before_call(args, recorder, device)
                calls.append(fwd_bwd(ring, *inputs))
            row = dict(schedule=schedule, precision=precision, simulated_world=world,
                       nan_counts=[[int(x.isnan().sum()) for x in c] for c in calls])
            for i, later in enumerate(calls[1:], start=1):
                row[f"call{i}"] = {n: compare(a, b) for n, a, b in zip(NAMES, calls[0], later)}
            if recorder:
                row["record"] = recorder.report()
                recorder.calls.clear()
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
