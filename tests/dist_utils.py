"""Running a test body on W real processes with a gloo process group.

``run_on_ranks(W, fn, *args)`` spawns W processes, initialises gloo, builds a 1-D CPU DeviceMesh and
calls ``fn(mesh, *args)`` on every rank. An exception on any rank fails the test with that rank's
traceback; every rank asserts for itself. ``fn`` must be a module-level function (it is pickled).
"""
import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        fn(mesh, *args)
    except BaseException:
        traceback.print_exc(file=sys.stderr)
        raise
    finally:
        dist.destroy_process_group()


def run_on_ranks(world_size: int, fn, *args) -> None:
    mp.start_processes(_worker, args=(world_size, _free_port(), fn, args), nprocs=world_size,
                       start_method="spawn")
