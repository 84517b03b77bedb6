"""Running a test body on W real processes with a gloo process group.

``run_on_ranks(W, fn, *args)`` spawns W processes, initialises gloo, builds a 1-D CPU DeviceMesh and
calls ``fn(mesh, *args)`` on every rank. An exception on any rank fails the test with that rank's
traceback; every rank asserts for itself. ``fn`` must be a module-level function (it is pickled).

``run_on_gpus(W, fn, *args)`` is the same on W GPUs of this machine with an NCCL process group
(one GPU a process): ``fn(rank, W, *args)``.

``mesh_shape=(2, 2), mesh_dim_names=("tp", "cp")`` builds an N-D mesh instead (the product must be
W). A collective that one rank never joins fails after ``timeout_s`` rather than hanging.

The ranks meet through a file of their own (a ``FileStore``), not a TCP port: a port picked as free
can be taken by another test's ranks before ours bind it (seen with ``pytest -n 8``: a gloo
"connectFullMesh failed ... Connection closed by peer"), a fresh file cannot.
"""
import os
import shutil
import socket
import sys
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh


def _worker(rank, world_size, store_path, fn, args, mesh_shape=None, mesh_dim_names=None,
            timeout_s=300):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
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
    folder = tempfile.mkdtemp(prefix="dtensor_ring_store_")
    try:
        mp.start_processes(_worker, args=(world_size, os.path.join(folder, "store"), fn, args,
                                          mesh_shape, mesh_dim_names, timeout_s),
                           nprocs=world_size, start_method="spawn")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_on_gpus(world_size: int, fn, *args, timeout_s=300) -> None:
    """``fn(rank, world_size, *args)`` on ``world_size`` processes, one GPU each, with NCCL. A
    collective or send/recv that a rank never joins fails after ``timeout_s`` (NCCL's watchdog
    names the stuck op in its log and ends the process) rather than after NCCL's default 10
    minutes, longer than a device session's command may run."""
    with socket.socket() as s:  # a free port for the ranks to meet at
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_gpu_worker, args=(world_size, port, fn, args, timeout_s),
                       nprocs=world_size, start_method="spawn")


def _gpu_worker(rank, world_size, port, fn, args, timeout_s):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size,
                            device_id=torch.device("cuda", rank),
                            timeout=timedelta(seconds=timeout_s))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
