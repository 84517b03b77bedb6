"""DTensor SDPA rule and ContextParallel parity on W GPUs (NCCL), against float64.

    torchrun --nproc-per-node=4 bench/gpu_dtensor_parity.py --out dtensor_parity.json
    (a CPU smoke run: torchrun --nproc-per-node=2 bench/gpu_dtensor_parity.py --device cpu --small)

A. ``F.scaled_dot_product_attention`` on ``Shard(2)`` DTensors, each SDPA backend (so each aten op
   the rule handles: cuDNN, flash, efficient) and exact mode (the Triton kernel, under cuDNN's
   op), each schedule, causal bf16: rel-RMS of out/dq/dk/dv against float64 on the bf16 inputs
   over the whole sequence, as a ratio to the single-GPU SDPA under the same backend (1.00 =
   splitting added no error; the CPU tests hold bf16 to <= 1.25, exact mode to <= 1.02).
B. The repository's Llama-style model under ``parallelize_module(..., ContextParallel(schedule))``:
   loss and parameter-gradient rel-RMS against the float64 model on one GPU; fp32 (CPU tests hold
   <= 1e-5) and bf16 (ratio to the single-GPU bf16 model's error; CPU tests hold <= 1.25).
Prints a table; rank 0 writes JSON to --out.
"""
import argparse
import copy
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.attention import SDPBackend, sdpa_kernel

import dtensor_ring as dr
from dtensor_ring import dtensor as drt
from dtensor_ring.models import Llama, LlamaConfig
from dtensor_ring.tools.numerics import NAMES, rel_rms

# row name -> (the SDPA backend, so the aten op the rule handles; our block kernel; precision)
SDPA_BACKENDS = {"cudnn": (SDPBackend.CUDNN_ATTENTION, "cudnn", "fp32"),
                 "flash": (SDPBackend.FLASH_ATTENTION, "flash", "fp32"),
                 "efficient": (SDPBackend.EFFICIENT_ATTENTION, "auto", "fp32"),
                 "exact": (SDPBackend.CUDNN_ATTENTION, "triton_exact", "exact")}
CPU_BACKENDS = {"cpu_flash": (SDPBackend.FLASH_ATTENTION, "auto", "fp32"),
                "exact": (SDPBackend.FLASH_ATTENTION, "auto", "exact")}


def fwd_bwd(fn, q, k, v, dout, dtype):
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout.to(dtype))
    return [out.detach(), q.grad, k.grad, v.grad]


def whole_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def max_over_ranks(value):
    t = torch.tensor([value], dtype=torch.float64, device=dist_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def dist_device():
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def rule_accuracy(mesh, args, device, rows):
    world = mesh.size()
    gen = torch.Generator(device="cpu").manual_seed(0)
    shapes = [(1, args.heads, args.seq, args.head_dim), (1, args.kv_heads, args.seq, args.head_dim),
              (1, args.kv_heads, args.seq, args.head_dim), (1, args.heads, args.seq, args.head_dim)]
    # Rounded to bf16 first: the reference then has the inputs every kernel sees, and input
    # rounding is in no kernel's error.
    q, k, v, dout = (torch.randn(s, generator=gen, dtype=torch.float64).bfloat16().double()
                     .to(device) for s in shapes)
    reference = fwd_bwd(whole_sdpa, q, k, v, dout, torch.float64)
    backends = SDPA_BACKENDS if device.type == "cuda" else CPU_BACKENDS
    for backend, (sdpa_backend, kernel, precision) in backends.items():
        try:
            with sdpa_kernel(sdpa_backend):
                single = fwd_bwd(whole_sdpa, q, k, v, dout, torch.bfloat16)
        except RuntimeError as error:
            rows.append(dict(part="A", backend=backend, skipped=str(error)[:200]))
            continue
        for schedule in sorted(dr.SCHEDULES):
            drt.set_sequence_schedule(mesh, schedule, backend=kernel, precision=precision)

            def ring(a, b, c):
                a, b, c = (drt.distribute_sequence(x, mesh) for x in (a, b, c))
                with sdpa_kernel(sdpa_backend):
                    out = whole_sdpa(a, b, c)
                return drt.sequence_full_tensor(out)

            try:
                got = fwd_bwd(ring, q, k, v, dout, torch.bfloat16)
                for grad in got[1:]:  # each rank's leaf holds the gradient of its own rows only
                    dist.all_reduce(grad, group=mesh.get_group())
            except (RuntimeError, ValueError) as error:
                rows.append(dict(part="A", backend=backend, schedule=schedule,
                                 skipped=str(error)[:200]))
                continue
            row = dict(part="A", backend=backend, schedule=schedule, world=world)
            for name, g, s, ref in zip(NAMES, got, single, reference):
                row[f"{name}_ratio"] = max_over_ranks(rel_rms(g, ref) / rel_rms(s, ref))
            rows.append(row)
            drt.clear_sequence_schedule(mesh)


def grads(model):
    return torch.cat([(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                      .double().flatten() for p in model.parameters()])


def model_run(model, ids, labels, mesh=None):
    model.zero_grad()
    loss = model(ids, labels=labels).loss
    loss.backward()
    loss = loss.detach().double()
    if mesh is not None:
        drt.sync_gradients(model, mesh)
        loss = loss.clone()
        dist.all_reduce(loss, group=mesh.get_group())
        loss /= mesh.size()
    return loss, grads(model)


def model_parity(mesh, args, device, rows):
    torch.manual_seed(0)
    base = Llama(LlamaConfig()).to(device)
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids, labels = (torch.randint(0, base.cfg.vocab_size, (2, args.model_seq), generator=gen)
                   .to(device) for _ in range(2))
    reference = model_run(copy.deepcopy(base).double(), ids, labels)
    single16 = model_run(copy.deepcopy(base).bfloat16(), ids, labels)
    single16_err = [rel_rms(a, b) for a, b in zip(single16, reference)]
    for schedule in sorted(dr.SCHEDULES):
        row = dict(part="B", schedule=schedule, world=mesh.size())
        for dtype in (torch.float32, torch.bfloat16):
            model = parallelize_module(copy.deepcopy(base).to(dtype), mesh,
                                       dr.ContextParallel(schedule))
            result = model_run(model, ids, labels, mesh)
            loss_err, grad_err = (rel_rms(a, b) for a, b in zip(result, reference))
            tag = "fp32" if dtype == torch.float32 else "bf16"
            row[f"{tag}_loss_rel_rms"] = max_over_ranks(loss_err)
            row[f"{tag}_grad_rel_rms"] = max_over_ranks(grad_err)
            if tag == "bf16":
                row["bf16_loss_ratio"] = row["bf16_loss_rel_rms"] / single16_err[0]
                row["bf16_grad_ratio"] = row["bf16_grad_rel_rms"] / single16_err[1]
        rows.append(row)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="dtensor_parity.json", help="JSON results")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--model-seq", type=int, default=4096)
    parser.add_argument("--small", action="store_true", help="tiny shapes for a CPU smoke run")
    return parser.parse_args(argv)


def main():
    args = parse_args()
    if args.small:
        args.seq, args.heads, args.kv_heads, args.head_dim, args.model_seq = 256, 4, 2, 64, 64
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    mesh = init_device_mesh(args.device, (dist.get_world_size(),))
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" \
        else torch.device("cpu")
    rows = []
    rule_accuracy(mesh, args, device, rows)
    model_parity(mesh, args, device, rows)
    if dist.get_rank() == 0:
        for row in rows:
            print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in row.items()))
        info = dict(torch=torch.__version__, world=dist.get_world_size(),
                    device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                    args=vars(args))
        with open(args.out, "w") as f:
            json.dump(dict(info=info, rows=rows), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
