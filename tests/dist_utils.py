"""Running a test body on W real processes with a gloo process group.

``run_on_ranks(W, fn, *args)`` spawns W processes, initialises gloo, builds a 1-D CPU DeviceMesh and
calls ``fn(mesh, *args)`` on every rank. An exception on any rank fails the test with that rank's
traceback; every rank asserts for itself. ``fn`` must be a module-level function (it is pickled).

``mesh_shape=(2, 2), mesh_dim_names=("tp", "cp")`` builds an N-D mesh instead (the product must be
W). A collective that one rank never joins fails after ``timeout_s`` rather than hanging.
"""
import os
import socket
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, mesh_shape=None, mesh_dim_names=None,
            timeout_s=300):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    try:
        mesh = init_device_mesh("cpu", tuple(mesh_shape or (world_size,)),
                                mesh_dim_names=mesh_dim_names)
        fn(mesh, *args)
    except BaseException:
        traceback.print_exc(file=sys.stderr)
        raise
    finally:
        dist.destroy_process_group()


def run_on_ranks(world_size: int, fn, *args, mesh_shape=None, mesh_dim_names=None,
                 timeout_s=300) -> None:
    mp.start_processes(_worker, args=(world_size, _free_port(), fn, args, mesh_shape,
                                      mesh_dim_names, timeout_s),
                       nprocs=world_size, start_method="spawn")
