"""Command line: ``python -m dtensor_ring demo [--nproc 4] [--schedule zigzag] ...`` (train with
context parallelism next to a single process) and ``python -m dtensor_ring check ...`` (accuracy
of every schedule's attention against float64)."""
import argparse
import sys

from .schedules import SCHEDULES
from .tools.accuracy_check import DTYPES, run_check
from .tools.demo import DEVICES, run_demo


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtensor_ring")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small Llama with context parallelism on N "
                               "processes next to one process")
    demo.add_argument("--nproc", type=int, default=4)
    demo.add_argument("--dp", type=int, default=1,
                      help="data-parallel groups (each of nproc / dp context-parallel ranks)")
    demo.add_argument("--schedule", choices=["auto", *sorted(SCHEDULES)], action="append",
                      help="repeat to pick several (default: all four)")
    demo.add_argument("--steps", type=int, default=30)
    demo.add_argument("--batch", type=int, default=2,
                      help="sequences per step, over all data-parallel groups")
    demo.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    demo.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                      help="torch.compile each block of the model (default: on)")
    demo.add_argument("--device", choices=DEVICES, default="cpu",
                      help="cuda: one GPU per process, NCCL")
    check = commands.add_parser("check", help="accuracy of every schedule on N CPU processes")
    check.add_argument("--nproc", type=int, default=4)
    check.add_argument("--schedule", choices=sorted(SCHEDULES), action="append",
                       help="repeat to pick several (default: all)")
    check.add_argument("--dtype", choices=sorted(DTYPES), action="append",
                       help="repeat to pick several (default: float32 and bfloat16)")
    check.add_argument("--seq", type=int, default=1024, help="global sequence length")
    check.add_argument("--heads", type=int, default=8)
    check.add_argument("--kv-heads", type=int, default=2)
    check.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args(argv)
    if args.command == "demo":
        _, ok = run_demo(nproc=args.nproc, schedules=tuple(args.schedule or sorted(SCHEDULES)),
                         steps=args.steps, batch=args.batch, seq=args.seq,
                         compile_model=args.compile, device=args.device, dp=args.dp)
        return 0 if ok else 1
    _, ok = run_check(nproc=args.nproc, schedules=tuple(args.schedule or sorted(SCHEDULES)),
                      dtypes=tuple(args.dtype or ("float32", "bfloat16")), seq=args.seq,
                      heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
