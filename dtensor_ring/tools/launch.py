"""Starting a function on N local processes through PyTorch's elastic launcher (what torchrun uses)."""
import os
import uuid

import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ..validation import check_int


def launch(fn, nproc: int, *args):
    """Run ``fn(*args)`` on ``nproc`` local processes; returns {rank: return value}.

    ``fn`` runs with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) and must be a
    module-level function; it initialises its own process group (``init_from_env``).
    """
    check_int(nproc, "nproc", 1, "a positive int")
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                          run_id=f"dtensor_ring_{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                          start_method="spawn")
    return elastic_launch(config, fn)(*args)


def init_from_env(backend: str = "gloo") -> None:
    """Join the process group the launcher set up; one thread per CPU process."""
    dist.init_process_group(backend)
    if backend == "gloo":
        import torch  # noqa: PLC0415 - keep the import cost off the launcher's side

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
