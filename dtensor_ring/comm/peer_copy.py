"""The ring shift on the GPUs' copy engines: each rank writes its K/V (or dK/dV) straight into the
next rank's memory with ``cudaMemcpyAsync`` through PyTorch's symmetric memory, instead of running
NCCL's send/recv kernels.

Why: NCCL's send/recv are kernels; they take SMs from the attention kernel they overlap and move
a hop at a fraction of NVLink's rate, so with many heads the transfer outlasts the step it should
hide behind. A copy engine moves the bytes without any SM (docs/design.md, "The ring shift on the
copy engines", gives the measurements).

One call, on a side stream of high priority, after what the compute stream had queued when the
call began (``send_recv_next``: its ``overlapping`` compute launches before the post):

    wait  FREE      rank+1 has emptied its arena (set by rank+1 after its last copy out)
    copy  ->  next  this rank's tensors into rank+1's arena (copy engine, over NVLink)
    set   LANDED    in rank+1's flags: the copy is there
    wait  LANDED    rank-1's copy is in this rank's arena
    copy  <-  arena the arena into fresh tensors, which are the result (local: this one runs on SMs,
                    so it starts as the running kernel drains)
    set   FREE      in rank-1's flags: this arena is empty again
    event           ``wait()`` makes the compute stream wait for it

The flags are words in symmetric memory, set and awaited by the streams' front ends
(``stream_flags.py``), not by kernels: a cuDNN kernel running on the compute stream holds every
SM, and a barrier kernel would wait for it to drain before the shift could land. Each flag is
reset by the rank that waits for it, right after the wait, so a shift leaves the flags as it
found them (FREE set, LANDED clear), and a CUDA graph that captured shifts replays them.

The result is copied out of the arena so that it is an ordinary tensor, owned by its caller
(inductor may reuse a custom op's output buffer for anything once it is dead; a peer writing into
it later would corrupt that), and so that one arena per process group serves every call in turn:
calls run one after another on the side stream. The arena is the largest message sent so far
(kept for the process's life, like NCCL's own buffers; it grows, collectively, when a larger
message comes).

Used where every rank of the group can reach the next one's memory: NCCL groups of CUDA ranks on
one host with peer access and a driver that runs stream memory operations, agreed by all ranks
the first time a group shifts (a collective, so that first shift must not be inside a CUDA graph
capture). ``DTENSOR_RING_PEER_COPY=0`` keeps NCCL's send/recv. Elsewhere (gloo, several hosts) ``ProcessGroupComm`` uses NCCL or gloo as before.
"""
import os
import socket
import warnings
import zlib
from typing import Optional

import torch
import torch.distributed as dist

from . import stream_flags

ENV = "DTENSOR_RING_PEER_COPY"
SWITCH = {"0": "NCCL's send/recv", "1": "the copy engines (the default)"}  # ENV's values
_ALIGN = 256  # bytes: each tensor's place in the arena starts on such a boundary
LANDED, FREE = 0, 1  # the flag words of a rank (int32): see the module docstring

_RINGS: dict = {}  # process group name -> PeerCopyRing, or None where peer copies are not used


def peer_copy_ring(group) -> Optional["PeerCopyRing"]:
    """The group's ``PeerCopyRing``, or None where its ranks shift through NCCL or gloo. The first
    call for a group is collective (every rank of the group must make it)."""
    name = group.group_name
    if name not in _RINGS:
        _RINGS[name] = PeerCopyRing(group) if _agreed(group) else None
    return _RINGS[name]


def _agreed(group) -> bool:
    """Whether every rank can write into the next rank's memory: CUDA, NCCL, one host, peer
    access both ways round the ring, symmetric memory importable, stream memory operations,
    not switched off."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if dist.get_backend(group) != "nccl" or world == 1:
        return False
    switched_on = switched_on_by_env()  # before any collective: a bad value fails every rank
    device = torch.device("cuda", torch.cuda.current_device())
    host = zlib.crc32(socket.gethostname().encode())
    mine = torch.tensor([host, device.index], dtype=torch.int64, device=device)
    everyone = mine.new_empty(world, 2)
    dist.all_gather_into_tensor(everyone, mine, group=group)
    rows = everyone.tolist()
    hosts, devices = {host for host, _ in rows}, [index for _, index in rows]
    ok = (switched_on and len(hosts) == 1 and _symmetric_memory() is not None
          and stream_flags.unusable_because() is None and all(torch.cuda.can_device_access_peer(device.index, devices[peer])
                              for peer in ((rank + 1) % world, (rank - 1) % world)
                              if devices[peer] != device.index))
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def switched_on_by_env() -> bool:
    """``DTENSOR_RING_PEER_COPY``: "1" (or unset) lets the copy engines shift, "0" keeps NCCL.

    Raises:
        ValueError: any other value.
    """
    value = os.environ.get(ENV, "1")
    if value not in SWITCH:
        raise ValueError(f"{ENV}={value!r} is not valid; valid: "
                         + ", ".join(f"{v!r} ({what})" for v, what in SWITCH.items()))
    return value == "1"


def _symmetric_memory():
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return None
    return symm_mem


class _Landed:
    def __init__(self, event, received):
        self.event, self.received = event, received

    def wait(self):
        torch.cuda.current_stream().wait_event(self.event)
        return self.received


class PeerCopyRing:
    """Ring shifts of one process group through a symmetric arena (see the module docstring)."""

    def __init__(self, group):
        self.group_name = group.group_name
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.stream = torch.cuda.Stream(priority=-1)
        self.arena, self.handle = None, None
        self._plans: dict = {}  # message shape -> _plan's views
        # the flag words' addresses: this rank's FREE and LANDED, rank+1's LANDED, rank-1's FREE
        self._free, self._landed, self._next_landed, self._prev_free = self._flag_words()

    def _flag_words(self) -> tuple:
        """This rank's flag words, FREE set and LANDED clear before any peer can see them; the
        addresses the shifts use (collective)."""
        symm_mem = _symmetric_memory()
        _enable(symm_mem, self.group_name)
        self.flags = symm_mem.empty(2, dtype=torch.int32, device="cuda")
        self.flags[LANDED], self.flags[FREE] = 0, 1
        torch.cuda.synchronize()
        handle = symm_mem.rendezvous(self.flags, self.group_name)
        handle.barrier(channel=0)  # no rank sets a peer's flag before the peer has set its own
        torch.cuda.synchronize()

        def word(rank, index):
            return handle.get_buffer(rank % self.world_size, [2], torch.int32, 0)[index].data_ptr()
        return (word(self.rank, FREE), word(self.rank, LANDED), word(self.rank + 1, LANDED),
                word(self.rank - 1, FREE))

    def _reserve(self, nbytes: int, device) -> None:
        """An arena of at least ``nbytes`` (collective: every rank asks for the same size)."""
        if self.arena is not None and self.arena.numel() >= nbytes:
            return
        # Idle here means idle everywhere that touches this arena: the last shift here waited
        # for rank-1's copy into it, and its own copy into rank+1's is done.
        self.stream.synchronize()
        self._plans.clear()
        self.arena = _symmetric_memory().empty(nbytes, dtype=torch.uint8, device=device)
        self.handle = _symmetric_memory().rendezvous(self.arena, self.group_name)

    def _plan(self, tensors) -> tuple[list, list]:
        """Where ``tensors`` go in the arena: (views of rank+1's arena, views of this rank's),
        made once per message shape (a call posts several; making views costs host time)."""
        key = tuple((tuple(t.shape), t.dtype) for t in tensors)
        plan = self._plans.get(key)
        if plan is None:
            offsets, total = [], 0
            for t in tensors:
                offsets.append(total)
                total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
            self._reserve(total, tensors[0].device)  # a new arena drops the plans
            plan = self._plans[key] = tuple(
                [self.handle.get_buffer(rank, list(t.shape), t.dtype, offset // t.element_size())
                 for t, offset in zip(tensors, offsets)]
                for rank in ((self.rank + 1) % self.world_size, self.rank))
        return plan

    def send_recv_next(self, tensors: list[torch.Tensor], overlapping=None) -> _Landed:
        """``Communicator.send_recv_next``: ``tensors`` (contiguous, on this rank's GPU) to rank+1;
        ``wait()`` gives those of rank-1, fresh tensors of the same shapes.

        ``overlapping`` is launched first: the copies need no SM, so they can follow its kernels
        onto the GPU and still run beside them, and its first kernel starts without waiting for
        this post's host time. The copies wait only for what was queued before it."""
        theirs, mine = self._plan(tensors)
        # allocated before ``overlapping``: no block its compute still uses can become them
        received = [torch.empty_like(t) for t in tensors]
        stream = self.stream
        if overlapping is None:
            stream.wait_stream(torch.cuda.current_stream())
        else:
            ready = torch.cuda.Event()  # the tensors are ready here
            ready.record()
            overlapping()
            stream.wait_event(ready)
        with torch.cuda.stream(stream):
            stream_flags.wait_flag(stream, self._free, 1)
            stream_flags.set_flag(stream, self._free, 0)
            for place, t in zip(theirs, tensors):
                place.copy_(t)
            stream_flags.set_flag(stream, self._next_landed, 1)
            stream_flags.wait_flag(stream, self._landed, 1)
            stream_flags.set_flag(stream, self._landed, 0)
            for r, place in zip(received, mine):
                r.copy_(place)
            stream_flags.set_flag(stream, self._prev_free, 1)
            landed = torch.cuda.Event()
            landed.record(stream)
        for t in tensors + received:  # the caching allocator keeps them until the copies ran
            t.record_stream(stream)
        return _Landed(landed, received)


def _enable(symm_mem, group_name: str) -> None:
    with warnings.catch_warnings():  # not needed, and deprecated, from torch 2.12
        warnings.simplefilter("ignore")
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group_name)
