"""Command line: ``python -m dtensor_ring check [--nproc 4] [--seq 1024] ...``."""
import argparse
import sys

from .accuracy_check import DTYPES, run_check
from .schedules import SCHEDULES


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtensor_ring")
    commands = parser.add_subparsers(dest="command", required=True)
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
    _, ok = run_check(nproc=args.nproc, schedules=tuple(args.schedule or sorted(SCHEDULES)),
                      dtypes=tuple(args.dtype or ("float32", "bfloat16")), seq=args.seq,
                      heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
