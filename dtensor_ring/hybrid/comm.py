"""The hybrid schedule's communicators: the ring's (``comm.Communicator``) over the outer ranks, and
an all-to-all over the inner ranks.

``AllToAll.all_to_all(tensor)``: ``tensor`` has a leading dim of size I; row d goes to inner rank d,
and ``wait()`` gives a tensor of the same shape whose row s came from inner rank s. Posted at once,
like every ``Communicator`` operation. Three implementations, as for the ring: on a process group
(``GroupAllToAll``), as ``_c10d_functional.all_to_all_single`` for the compile pass
(``FunctionalAllToAll``), and between simulated ranks (``simulated.SimComm`` has the method).
"""
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from ..comm import (NCCL_HEAD_START_CYCLES, Communicator, FunctionalComm, Pending,
                    ProcessGroupComm, _count, _Done, _Wait)
from ..mesh import SequenceMesh


class AllToAll(Protocol):
    rank: int
    world_size: int

    def all_to_all(self, tensor: torch.Tensor) -> Pending: ...


class HybridComm(NamedTuple):
    """What the hybrid schedule talks through: the ring over the outer ranks, the all-to-all over
    the inner ranks."""

    outer: Communicator
    inner: AllToAll

    @property
    def rank(self) -> int:
        return self.outer.rank * self.inner.world_size + self.inner.rank


class _Received:
    def __init__(self, work, received):
        self.work, self.received = work, received

    def wait(self):
        self.work.wait()
        return self.received


class GroupAllToAll:
    """``AllToAll`` over a ``torch.distributed`` process group (one ``all_to_all_single``)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self._nccl = dist.get_backend(group) == "nccl"

    def all_to_all(self, tensor):
        if self.world_size == 1:
            return _Done(tensor)
        _count("all_to_all", [tensor])
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        work = dist.all_to_all_single(received, tensor, group=self.group, async_op=True)
        if self._nccl:  # as for the ring's shift: let NCCL onto the SMs before the next kernel
            torch.cuda._sleep(NCCL_HEAD_START_CYCLES)
        return _Received(work, received)


class FunctionalAllToAll:
    """``AllToAll`` as ``_c10d_functional.all_to_all_single`` + ``wait_tensor`` (traceable)."""

    def __init__(self, group_name: str, rank: int, world_size: int):
        self.group_name, self.rank, self.world_size = group_name, rank, world_size

    def all_to_all(self, tensor):
        if self.world_size == 1:
            return _Done(tensor)
        splits = [1] * self.world_size  # rows of the leading dim, one per rank
        return _Wait(torch.ops._c10d_functional.all_to_all_single(
            tensor.contiguous(), splits, splits, self.group_name))


def process_group_comm(mesh: SequenceMesh):
    """The eager communicator of a call on ``mesh``: the ring's, or on a 2-D mesh the hybrid's."""
    if mesh.inner is None:
        return ProcessGroupComm(mesh.outer)
    return HybridComm(ProcessGroupComm(mesh.outer), GroupAllToAll(mesh.inner))


def functional_comm(outer_group_name: str, inner_group_name: str | None):
    """The traced communicator of an op's groups (by name): the compile pass's."""
    def functional(name, kind):
        group = _resolve_process_group(name)
        return kind(name, dist.get_rank(group), dist.get_world_size(group))

    outer = functional(outer_group_name, FunctionalComm)
    if inner_group_name is None:
        return outer
    return HybridComm(outer, functional(inner_group_name, FunctionalAllToAll))
