"""The hybrid schedule's communicators: the ring's (``comm.Communicator``) over the outer ranks, and
an all-to-all over the inner ranks.

``AllToAll.all_to_all(tensor)``: ``tensor`` has a leading dim of size I; row d goes to inner rank d,
and ``wait()`` gives a tensor of the same shape whose row s came from inner rank s. Posted at once,
like every ``Communicator`` operation. The communicators of the ring have the method: on a process
group (``comm.ProcessGroupComm``), traced for the compile pass (``comm/traced.TracedComm``),
and between simulated ranks (``comm/simulated.SimComm``).
"""
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from ..comm import Communicator, Pending
from ..comm.process_group import comm_of
from ..comm.mesh import SequenceMesh
from ..comm.traced import TracedComm


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


def process_group_comm(mesh: SequenceMesh):
    """The eager communicator of a call on ``mesh``: the ring's, or on a 2-D mesh the hybrid's."""
    if mesh.inner is None:
        return comm_of(mesh.outer)
    return HybridComm(comm_of(mesh.outer), comm_of(mesh.inner))


def traced_comms(group_names, after):
    """The compile pass's communicators for an op's groups (by name: the ring's, then on a 2-D
    mesh the all-to-all's), each posting after the handle ``after`` holds for its group (see
    ``comm/traced.py``): (the schedule's communicator, the per-group ``TracedComm``s)."""
    comms = []
    for name in group_names:
        group = _resolve_process_group(name)
        comms.append(TracedComm(name, dist.get_rank(group), dist.get_world_size(group),
                                after.get(name)))
    return (comms[0] if len(comms) == 1 else HybridComm(*comms)), comms
