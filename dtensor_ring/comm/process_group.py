"""``ProcessGroupComm``: the ``Communicator`` (``base.py``) on a ``torch.distributed`` process
group, and ``TRAFFIC``, what it has posted.
"""
import collections

import torch
import torch.distributed as dist

from .base import _Done, check_most_rows, sum_in_rank_order
from .peer_copy import message_slot_bytes, peer_copy_ring

# torch 2.13 renamed the tensor collectives; 2.11 and 2.12 only have the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Works:
    def __init__(self, works, value, finish=None):
        self.works, self.value, self.finish = works, value, finish

    def wait(self):
        for work in self.works:
            work.wait()
        return self.finish(self.value) if self.finish else self.value


# cuDNN's attention kernels are persistent: one block per SM, with more shared memory than leaves
# room for an NCCL block beside it. The kernel a schedule launches right after posting a ring
# shift becomes ready at the same instant as NCCL's (both wait for the same last kernel), takes
# every SM, and NCCL starts only as it drains: the forward's K/V send started near the kernel's
# end, with NCCL's streams at high priority or not (priority orders waiting blocks, it does not
# make room; measured: docs/design.md, "Measurements behind design choices"). A one-block wait
# of NCCL_HEAD_START_CYCLES GPU clock cycles on the compute stream after posting lets NCCL's
# blocks onto the SMs first. (The backward has such a gap already: cuDNN's small dot(dO, O)
# kernel runs before each of its persistent kernels.)
NCCL_HEAD_START_CYCLES = 20_000


# What ``ProcessGroupComm`` has posted in this process since it started (or since you cleared it):
# the number of each operation ("send_recv_next", "send_recv", "all_gather", "reduce_scatter")
# and "bytes", the bytes this rank handed to them: the ring's exchanges, eager and compiled
# (``traced.py`` runs these same operations), for tests and accounting (e.g. an
# activation-checkpointing recompute's extra traffic).
TRAFFIC: collections.Counter = collections.Counter()


def _count(operation: str, tensors) -> None:
    TRAFFIC[operation] += 1
    TRAFFIC["bytes"] += sum(t.numel() * t.element_size() for t in tensors)


class ProcessGroupComm:
    """``Communicator`` over a ``torch.distributed`` process group."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._next = dist.get_global_rank(group, (self.rank + 1) % self.world_size)
        self._prev = dist.get_global_rank(group, (self.rank - 1) % self.world_size)
        # NCCL sums in its own (fast) order; on gloo we sum in rank order to match the simulator.
        self._nccl = dist.get_backend(group) == "nccl"

    def send_recv_next(self, tensors, overlapping=None):
        post = self.begin_send_recv_next(tensors)
        if overlapping is not None:
            overlapping()
        return post()

    def begin_send_recv_next(self, tensors):
        """``send_recv_next(tensors, overlapping)`` in two halves, for a caller that launches the
        overlapping compute itself between them (the compiled ring, ``traced.py``): this one
        posts where the post must reach the GPU first (NCCL's kernels, gloo), or only marks the
        compute stream (the copy engines, ``PeerCopyRing.begin_send_recv_next``); the function
        it returns posts what is left and returns the ``Pending``."""
        if self.world_size == 1:
            done = _Done(list(tensors))
            return lambda: done
        _count("send_recv_next", tensors)
        # Dense buffers (a model's k/v may be transposed views), for NCCL and the copy engines.
        tensors = [t.contiguous() for t in tensors]
        ring = self._copy_engines(lambda ring: ring.holds(tensors))
        if ring is not None:  # no SM to make room for
            return ring.begin_send_recv_next(tensors)
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self._next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self._prev, self.group) for r in received]
        works = _Works(dist.batch_isend_irecv(ops), received)  # one NCCL group: one kernel
        if self._nccl:
            torch.cuda._sleep(NCCL_HEAD_START_CYCLES)  # see NCCL_HEAD_START_CYCLES
        return lambda: works

    def send_recv(self, offset, send, recv_shapes, most_rows, overlapping=None):
        post = self.begin_send_recv(offset, send, recv_shapes, most_rows)
        if overlapping is not None:
            overlapping()
        return post()

    def begin_send_recv(self, offset, send, recv_shapes, most_rows):
        """``send_recv`` in two halves, as ``begin_send_recv_next``: NCCL and gloo post here;
        the copy engines mark the compute stream here and post in the function returned."""
        check_most_rows(send, recv_shapes, most_rows)
        sending = [t.contiguous() for t in send if t.numel()]
        received = [t.new_empty(shape) for t, shape in zip(send, recv_shapes)]
        receiving = [r for r in received if r.numel()]
        if sending:
            _count("send_recv", sending)
        to, source = ((self.rank + offset) % self.world_size,
                      (self.rank - offset) % self.world_size)
        slot = message_slot_bytes(send, most_rows)
        ring = self._copy_engines(lambda ring: ring.holds_messages(slot))
        if ring is not None:  # every rank, also one with nothing to move: the arena may grow
            post = ring.begin_send_recv(to, source, sending, receiving, slot)
            return lambda: _Works([post()], received)
        done = _Done(received)
        if not sending and not receiving:
            return lambda: done
        to, source = (dist.get_global_rank(self.group, r) for r in (to, source))
        ops = [dist.P2POp(dist.isend, t, to, self.group) for t in sending]
        ops += [dist.P2POp(dist.irecv, r, source, self.group) for r in receiving]
        works = _Works(dist.batch_isend_irecv(ops), received)
        if self._nccl:
            torch.cuda._sleep(NCCL_HEAD_START_CYCLES)  # see NCCL_HEAD_START_CYCLES
        return lambda: works

    def _copy_engines(self, fits):
        """The group's ``PeerCopyRing`` (one host: the copy engines, ``peer_copy.py``), or None:
        also inside a CUDA graph capture when the message does not fit its arena as it is
        (``fits(ring)``, e.g. ``PeerCopyRing.holds``), which cannot grow there; NCCL then, on
        every rank alike (the arenas' sizes and the messages' bounds are the same on every
        rank)."""
        ring = peer_copy_ring(self.group) if self._nccl else None
        if ring is not None and torch.cuda.is_current_stream_capturing() and not fits(ring):
            return None
        return ring

    def all_gather(self, tensor):
        _count("all_gather", [tensor])
        ring = self._copy_engines(lambda ring: ring.holds([tensor], collective=True))
        if ring is not None:
            return ring.all_gather(tensor.contiguous())
        # The collectives concatenate along dim 0; flatten the leading dims so any rank works.
        flat = tensor.contiguous().view(-1, *tensor.shape[-1:])
        gathered = flat.new_empty((self.world_size * flat.shape[0], flat.shape[1]))
        work = _all_gather_tensor(gathered, flat, group=self.group, async_op=True)
        return _Works([work], gathered.view(self.world_size, *tensor.shape))

    def all_to_all(self, tensor):
        """``tensor`` has a leading dim of size W: row d goes to rank d, and the result's row s
        came from rank s (the hybrid's all-to-all over heads, ``hybrid/``)."""
        if self.world_size == 1:
            return _Done(tensor)
        _count("all_to_all", [tensor])
        tensor = tensor.contiguous()
        ring = self._copy_engines(lambda ring: ring.holds([tensor[0]], collective=True))
        if ring is not None:
            return ring.all_to_all(tensor)
        received = torch.empty_like(tensor)
        work = dist.all_to_all_single(received, tensor, group=self.group, async_op=True)
        if self._nccl:
            torch.cuda._sleep(NCCL_HEAD_START_CYCLES)  # see NCCL_HEAD_START_CYCLES
        return _Works([work], received)

    def reduce_scatter(self, tensor):
        _count("reduce_scatter", [tensor])
        tensor = tensor.contiguous()
        ring = self._copy_engines(lambda ring: ring.holds([tensor[0]], collective=True))
        if ring is not None:
            return ring.reduce_scatter(tensor)
        if self._nccl:
            out = tensor.new_empty(tensor.shape[1:])
            work = _reduce_scatter_tensor(out.view(-1), tensor.view(-1), group=self.group,
                                              async_op=True)
            return _Works([work], out)
        received = torch.empty_like(tensor)
        work = dist.all_to_all_single(received, tensor, group=self.group, async_op=True)
        return _Works([work], received, sum_in_rank_order)


def comm_of(group) -> ProcessGroupComm:
    """The ``ProcessGroupComm`` of ``group``, made once per group (it holds nothing but the group
    and its ranks): a call posts several exchanges, and asking the group for its ranks each time
    costs host time before the first kernel (docs/design.md, "Host time of an eager call")."""
    comm = _COMMS.get(group)
    if comm is None:
        if len(_COMMS) >= 64:  # groups destroyed and made anew (tests) do not pile up
            _COMMS.clear()
        comm = _COMMS[group] = ProcessGroupComm(group)
    return comm


_COMMS: dict = {}  # process group -> its ProcessGroupComm
