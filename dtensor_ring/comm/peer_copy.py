"""Exchanges on the GPUs' copy engines: each rank writes its K/V (or dK/dV) straight into its
peers' memory with ``cudaMemcpyAsync`` through PyTorch's symmetric memory, instead of running
NCCL's send/recv or collective kernels. The ring shift (zigzag, ring, stripe) and the collectives
(llama3's all-gather and reduce-scatter, the hybrid's all-to-all).

Why: NCCL's send/recv are kernels; they take SMs from the attention kernel they overlap and move
a hop at a fraction of NVLink's rate, so with many heads the transfer outlasts the step it should
hide behind. A copy engine moves the bytes without any SM (docs/design.md, "Where the time goes
on real ranks", gives the measurements).

One ring shift, on a side stream of high priority, after what the compute stream had queued when
the call began (``begin_send_recv_next``: the compute it overlaps launches between its two halves):

    wait  FREE      rank+1 has emptied its arena (set by rank+1 after its last copy out)
    copy  ->  next  this rank's tensors into rank+1's arena (copy engine, over NVLink)
    set   LANDED    in rank+1's flags: the copy is there
    wait  LANDED    rank-1's copy is in this rank's arena
    copy  <-  arena the arena into fresh tensors, which are the result (local: this one runs on SMs,
                    so it starts as the running kernel drains)
    set   FREE      in rank-1's flags: this arena is empty again
    event           ``wait()`` makes the compute stream wait for it

A collective does the same with every peer, through a second arena of W slots (slot p holds
rank p's piece) and a pair of flags per peer: wait every FREE_FROM[p] (peer p has emptied this
rank's slot in its arena), copy the piece for each p into that slot (p = rank+1, rank+2, ...),
set each p's LANDED_FROM[rank], wait every LANDED_FROM[p], read the slots into the result in one
or two passes (all-gather and all-to-all: copied out; reduce-scatter: this rank's own piece
copied into its own slot and the W slots summed), and set each p's FREE_FROM[rank]. Every
transfer is direct, none relayed, and the only SM work is that last pass.

A sliding window's direct exchange (``send_recv``: to rank + d, from rank - d, either side
possibly empty) goes through a third arena of W slots and its own pair of flags per peer: the
sender waits MSG_FREE_FROM[dst], copies into its slot of dst's arena and sets dst's
MSG_LANDED_FROM[rank]; the receiver waits MSG_LANDED_FROM[src], copies its slot out and sets src's
MSG_FREE_FROM[rank]. Its slots are sized by the caller's bound on a message's rows, the same on
every rank, so that every rank grows the arena at the same call.

The flags are words in symmetric memory, set and awaited by the streams' front ends
(``stream_flags.py``), not by kernels: a cuDNN kernel running on the compute stream holds every
SM, and a barrier kernel would wait for it to drain before the shift could land. Each flag is
reset by the rank that waits for it, right after the wait, so an exchange leaves the flags as it
found them (FREE set, LANDED clear), and a CUDA graph that captured exchanges replays them.

The result is copied out of the arena so that it is an ordinary tensor, owned by its caller
(inductor may reuse a custom op's output buffer for anything once it is dead; a peer writing into
it later would corrupt that), and so that the two arenas per process group serve every call in
turn: calls run one after another on the side stream. An arena is the largest message sent
through it so far (kept for the process's life, like NCCL's own buffers; it grows, collectively,
when a larger message comes).

Used where every rank of the group can reach every other one's memory: NCCL groups of CUDA ranks
on one host with peer access and a driver that runs stream memory operations, agreed by all
ranks the first time a group exchanges (a collective, so that first exchange must not be inside
a CUDA graph capture). ``DTENSOR_RING_PEER_COPY=0`` keeps NCCL. Elsewhere (gloo, several hosts)
``ProcessGroupComm`` uses NCCL or gloo as before.
"""
import math
import os
import socket
import warnings
import zlib
from typing import Optional

import torch
import torch.distributed as dist

from . import stream_flags
from .stream_flags import SET, WAIT, Batch

ENV = "DTENSOR_RING_PEER_COPY"
SWITCH = {"0": "NCCL's kernels", "1": "the copy engines (the default)"}  # ENV's values
_ALIGN = 256  # bytes: each tensor's place in the arena starts on such a boundary
# A rank's flag words (int32; see the module docstring): the ring's LANDED and FREE, then for
# each rank p of the group the collectives' LANDED_FROM + p and FREE_FROM + p, and the direct
# exchanges' MSG_LANDED_FROM + p and MSG_FREE_FROM + p
LANDED, FREE, LANDED_FROM = 0, 1, 2  # FREE_FROM, MSG_LANDED_FROM, MSG_FREE_FROM: + W, 2 W, 3 W

_RINGS: dict = {}  # process group name -> PeerCopyRing, or None where peer copies are not used


def peer_copy_ring(group) -> Optional["PeerCopyRing"]:
    """The group's ``PeerCopyRing``, or None where its ranks shift through NCCL or gloo. The first
    call for a group is collective (every rank of the group must make it)."""
    name = group.group_name
    if name not in _RINGS:
        _RINGS[name] = PeerCopyRing(group) if _agreed(group) else None
    return _RINGS[name]


def _agreed(group) -> bool:
    """Whether every rank can write into every other rank's memory: CUDA, NCCL, one host, peer
    access, symmetric memory importable, stream memory operations, not switched off."""
    world = dist.get_world_size(group)
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
          and stream_flags.unusable_because() is None
          and all(torch.cuda.can_device_access_peer(device.index, index)
                  for index in set(devices) - {device.index}))
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
    def __init__(self, event, received, device: int):
        self.event, self.received, self.device = event, received, device

    def wait(self):
        torch.cuda.current_stream(self.device).wait_event(self.event)
        return self.received


class _Arena:
    """A symmetric buffer of one group, grown collectively, and the views of it that messages use
    (made once per message shape: a call posts several, and making views costs host time)."""

    def __init__(self, group_name: str, stream):
        self.group_name, self.stream = group_name, stream
        self.buffer, self.handle = None, None
        self._views: dict = {}
        # Buffers outgrown after a CUDA graph capture used them, kept: the graph holds views of
        # them (its replays copy into them), on every rank alike. Others are dropped on growth.
        self._outgrown: list = []
        self._captured = False  # whether a capture used the current buffer

    def holds(self, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` fits without growing the buffer."""
        return self.buffer is not None and self.buffer.numel() >= nbytes

    def views(self, key, nbytes: int, device, make):
        """``make(handle)``'s views for ``key``, in an arena of at least ``nbytes`` (collective the
        first time a key comes: every rank asks for the same size)."""
        views = self._views.get(key)
        if views is None:
            self.reserve(nbytes, device)  # a new buffer drops the views
            views = self._views[key] = make(self.handle)
        self._captured = self._captured or torch.cuda.is_current_stream_capturing()
        return views

    def reserve(self, nbytes: int, device) -> None:
        """At least ``nbytes`` (collective when it grows: every rank asks for the same size)."""
        if self.holds(nbytes):
            return
        # Idle here means idle everywhere that touches this buffer: the last exchange here
        # waited for every copy into it, and its own copies into the peers' are done.
        self.stream.synchronize()
        self._views.clear()
        if self._captured:
            self._outgrown.append((self.buffer, self.handle))
        self._captured = False
        self.buffer = _symmetric_memory().empty(nbytes, dtype=torch.uint8, device=device)
        self.handle = _symmetric_memory().rendezvous(self.buffer, self.group_name)


class PeerCopyRing:
    """Ring shifts and collectives of one process group through symmetric arenas (see the module
    docstring)."""

    def __init__(self, group):
        self.group_name = group.group_name
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.stream = torch.cuda.Stream(priority=-1)
        # The device by index: torch.cuda's stream calls without one (current_stream(),
        # Event.record(), the torch.cuda.stream context) look the current device up through
        # its availability checks, 5-10 us a call; a post made several (2 x 2 mesh, 4 H200s:
        # 100 lookups per fwd+bwd, 2 ms of host time under cProfile).
        self.device = self.stream.device_index
        # one arena for the ring shifts, one for the collectives: a rank ahead of its peers may
        # start the next exchange while they finish this one, and each arena's flags guard only
        # its own exchanges
        self.arena = _Arena(self.group_name, self.stream)
        self.slots = _Arena(self.group_name, self.stream)
        self.messages = _Arena(self.group_name, self.stream)  # the direct exchanges' W slots
        self._flag_words()

    def _flag_words(self) -> None:
        """This rank's flag words, FREE and FREE_FROM set, the LANDED words clear, before any
        peer can see them; the batches of waits and sets the exchanges post (collective)."""
        symm_mem, world = _symmetric_memory(), self.world_size
        free_from, msg_landed_from = LANDED_FROM + world, LANDED_FROM + 2 * world
        msg_free_from, words = LANDED_FROM + 3 * world, LANDED_FROM + 4 * world
        _enable(symm_mem, self.group_name)
        self.flags = symm_mem.empty(words, dtype=torch.int32, device="cuda")
        self.flags.zero_()
        self.flags[FREE] = 1
        self.flags[free_from:msg_landed_from] = 1
        self.flags[msg_free_from:] = 1
        torch.cuda.synchronize()
        handle = symm_mem.rendezvous(self.flags, self.group_name)
        handle.barrier(channel=0)  # no rank sets a peer's flag before the peer has set its own
        torch.cuda.synchronize()

        def word(rank, index):
            return handle.get_buffer(rank % world, [words], torch.int32, 0)[index].data_ptr()
        r, peers = self.rank, [(self.rank + i) % world for i in range(1, world)]
        free, landed = word(r, FREE), word(r, LANDED)
        # the ring shift (module docstring): before the copy, after it, after the copy out
        self._ring_steps = (
            Batch([(WAIT, free, 1), (SET, free, 0)]),
            Batch([(SET, word(r + 1, LANDED), 1), (WAIT, landed, 1), (SET, landed, 0)]),
            Batch([(SET, word(r - 1, FREE), 1)]))
        # the collectives, per peer p: this rank's words for p, and p's words for this rank
        mine_free = [word(r, free_from + p) for p in peers]
        mine_landed = [word(r, LANDED_FROM + p) for p in peers]
        self._peers = peers
        self._collective_steps = (
            Batch([(WAIT, a, 1) for a in mine_free] + [(SET, a, 0) for a in mine_free]),
            Batch([(SET, word(p, LANDED_FROM + r), 1) for p in peers]
                  + [(WAIT, a, 1) for a in mine_landed] + [(SET, a, 0) for a in mine_landed]),
            Batch([(SET, word(p, free_from + r), 1) for p in peers]))
        # the direct exchanges, per peer p: (before copying to p, after it, before copying p's
        # message out, after it)
        self._message_steps = {p: (
            Batch([(WAIT, word(r, msg_free_from + p), 1), (SET, word(r, msg_free_from + p), 0)]),
            Batch([(SET, word(p, msg_landed_from + r), 1)]),
            Batch([(WAIT, word(r, msg_landed_from + p), 1),
                   (SET, word(r, msg_landed_from + p), 0)]),
            Batch([(SET, word(p, msg_free_from + r), 1)])) for p in peers}

    def _post(self, sending, received, ready, steps) -> torch.cuda.Event:
        """Runs ``steps`` on the side stream after ``ready`` (an event on the compute stream), or
        after all the compute stream has queued (None); the event returned marks their end."""
        stream, compute = self.stream, torch.cuda.current_stream(self.device)
        if ready is None:
            stream.wait_stream(compute)
        else:
            stream.wait_event(ready)
        torch.cuda.set_stream(stream)  # the copies' stream (what torch.cuda.stream(...) does)
        try:
            steps()
        finally:
            torch.cuda.set_stream(compute)
        landed = torch.cuda.Event()
        landed.record(stream)
        for t in sending + received:  # the caching allocator keeps them until the copies ran
            t.record_stream(stream)
        return landed

    def begin_send_recv_next(self, tensors: list[torch.Tensor]):
        """``Communicator.send_recv_next`` in two halves: ``tensors`` (contiguous, on this rank's
        GPU) to rank+1. This half marks the compute stream (the copies wait for what is queued
        so far, nothing later) and returns the other, which posts the copies and returns the
        ``Pending``: ``wait()`` gives rank-1's tensors, fresh tensors of the same shapes.

        Launch the compute the shift overlaps between the two: the copies need no SM, so they
        can follow its kernels onto the GPU and still run beside them, and its first kernel
        starts without waiting for the post's host time."""
        theirs, mine = self._ring_views(tensors)
        # allocated before the compute launched between the halves: no block it still uses can
        # become them
        received = [torch.empty_like(t) for t in tensors]
        ready = torch.cuda.Event()  # the tensors are ready here
        ready.record(torch.cuda.current_stream(self.device))
        before, after, emptied = self._ring_steps

        def steps():
            before.post(self.stream)
            for place, t in zip(theirs, tensors):
                place.copy_(t)
            after.post(self.stream)
            for r, place in zip(received, mine):
                r.copy_(place)
            emptied.post(self.stream)
        return lambda: _Landed(self._post(tensors, received, ready, steps), received, self.device)

    def begin_send_recv(self, dst: int, src: int, sending: list[torch.Tensor],
                        received: list[torch.Tensor], slot_bytes: int):
        """``Communicator.send_recv`` in two halves, as ``begin_send_recv_next`` (``dst``,
        ``src``: group ranks): ``sending`` (contiguous; none: nothing goes to dst) into this
        rank's slot of dst's message arena, and ``received`` (fresh tensors; none: nothing
        comes) filled from src's message in this rank's. Every rank calls it at the same points
        with the same ``slot_bytes``, at least any message's size: the arena grows
        collectively. The copies wait for what the compute stream had queued at this half."""
        r, device = self.rank, self.device
        self.messages.reserve(self.world_size * slot_bytes, device)
        theirs = self._message_views(dst, r, sending) if sending else []
        mine = self._message_views(r, src, received) if received else []
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))

        def steps():
            if sending:
                before, landed = self._message_steps[dst][:2]
                before.post(self.stream)
                for place, t in zip(theirs, sending):
                    place.copy_(t)
                landed.post(self.stream)
            if received:
                arrived, emptied = self._message_steps[src][2:]
                arrived.post(self.stream)
                for t, place in zip(received, mine):
                    t.copy_(place)
                emptied.post(self.stream)
        return lambda: _Landed(self._post(sending, received, ready, steps), received, device)

    def _message_views(self, rank: int, slot: int, tensors) -> list:
        """Views of ``tensors``' shapes in slot ``slot`` of ``rank``'s message arena. A slot is
        a W-th of the arena whatever the call's ``slot_bytes``: messages of calls with other
        bounds (K/V in bf16, dK/dV in fp32) may be in flight at once, each in its sender's
        slot, and only the same sender's are kept apart by the flags."""
        offsets, _ = _ring_bytes(tensors)
        stride = self.messages.buffer.numel() // self.world_size  # a multiple of _ALIGN

        def make(handle):
            return [handle.get_buffer(rank, list(t.shape), t.dtype,
                                      (slot * stride + offset) // t.element_size())
                    for t, offset in zip(tensors, offsets)]
        key = (rank, slot, tuple((tuple(t.shape), t.dtype) for t in tensors))
        return self.messages.views(key, self.messages.buffer.numel(), tensors[0].device, make)

    def holds_messages(self, slot_bytes: int) -> bool:
        """Whether direct exchanges of ``slot_bytes`` fit the message arena as it is (``holds``)."""
        return self.messages.holds(self.world_size * slot_bytes)

    def holds(self, tensors: list[torch.Tensor], collective: bool = False) -> bool:
        """Whether ``tensors`` (a ring shift's; ``collective``: one piece of a collective) fit
        the arena as it is. Inside a CUDA graph capture an arena cannot grow (growing reserves
        symmetric memory collectively and waits for the side stream): a message eager calls did
        not size it for (a capture's traced packed-document form sends every row where the
        eager exact form sent the long part's) goes through NCCL instead (``process_group``)."""
        if collective:
            (piece,) = tensors
            return self.slots.holds(_slot_bytes(piece, self.world_size))
        return self.arena.holds(_ring_bytes(tensors)[1])

    def _ring_views(self, tensors) -> tuple[list, list]:
        """Where ``tensors`` go in the ring's arena: (views of rank+1's, views of this rank's)."""
        offsets, total = _ring_bytes(tensors)

        def make(handle):
            return tuple([handle.get_buffer(rank, list(t.shape), t.dtype,
                                            offset // t.element_size())
                          for t, offset in zip(tensors, offsets)]
                         for rank in ((self.rank + 1) % self.world_size, self.rank))
        key = tuple((tuple(t.shape), t.dtype) for t in tensors)
        return self.arena.views(key, total, tensors[0].device, make)

    def _slot_views(self, piece: torch.Tensor) -> tuple[list, torch.Tensor]:
        """The collectives' arena as W slots of ``piece``'s shape, slot p for rank p's piece:
        (this rank's slot in each peer's arena, this rank's slots [W, ...])."""
        world, shape = self.world_size, [self.world_size, *piece.shape]

        def make(handle):
            return ([handle.get_buffer(p, shape, piece.dtype, 0)[self.rank] for p in range(world)],
                    handle.get_buffer(self.rank, shape, piece.dtype, 0))
        return self.slots.views((tuple(piece.shape), piece.dtype), _slot_bytes(piece, world),
                                piece.device, make)

    def _to_every_peer(self, pieces, theirs, take) -> None:
        """On the side stream: ``pieces[p]`` into this rank's slot of peer p's arena, for every
        peer; once every peer's piece has landed here, ``take()`` reads this rank's slots, and
        they are marked free. Peers in the order rank+1, rank+2, ...: at each moment the ranks
        write to different GPUs."""
        before, after, emptied = self._collective_steps
        before.post(self.stream)
        for p in self._peers:
            theirs[p].copy_(pieces[p])
        after.post(self.stream)
        take()
        emptied.post(self.stream)

    def _exchange(self, pieces: list[torch.Tensor], own: torch.Tensor) -> _Landed:
        """[W, ...]: row p what rank p's ``pieces[this rank]`` was, this rank's row ``own``.
        ``pieces`` and ``own`` share one allocation (a tensor and views of it): ``own``'s
        ``record_stream`` keeps it for the copies."""
        r, world = self.rank, self.world_size
        theirs, mine = self._slot_views(own)
        received = own.new_empty(world, *own.shape)
        received[r].copy_(own)  # on the compute stream, before the post
        others = [part for part in (slice(0, r), slice(r + 1, world)) if part.start < part.stop]

        def take():
            for part in others:
                received[part].copy_(mine[part])
        steps = lambda: self._to_every_peer(pieces, theirs, take)  # noqa: E731
        return _Landed(self._post([own], [received], None, steps), received, self.device)

    def all_gather(self, tensor: torch.Tensor) -> _Landed:
        """``Communicator.all_gather`` (``tensor`` contiguous): written into every peer's arena."""
        return self._exchange([tensor] * self.world_size, tensor)

    def all_to_all(self, tensor: torch.Tensor) -> _Landed:
        """``ProcessGroupComm.all_to_all`` (``tensor`` contiguous, [W, ...]): row p into peer p's
        arena."""
        return self._exchange(list(tensor.unbind(0)), tensor[self.rank])

    def reduce_scatter(self, parts: torch.Tensor) -> _Landed:
        """``Communicator.reduce_scatter`` (``parts`` contiguous, [W, ...]): row p into peer p's
        arena; this rank's own row copied into its own slot, then the W slots summed in one pass
        (in their dtype: fp32 for the schedules' dK/dV)."""
        r = self.rank
        theirs, mine = self._slot_views(parts[r])
        total = torch.empty_like(parts[r])

        def take():
            mine[r].copy_(parts[r])  # this rank's slot: no peer writes it
            torch.sum(mine, 0, out=total)
        steps = lambda: self._to_every_peer(list(parts.unbind(0)), theirs, take)  # noqa: E731
        return _Landed(self._post([parts], [total], None, steps), total, self.device)


def _ring_bytes(tensors) -> tuple[list[int], int]:
    """Each tensor's byte offset in a ring message, and the message's size."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return offsets, total


def message_slot_bytes(send: list[torch.Tensor], most_rows: int) -> int:
    """The size of a direct exchange's slot: ``send``'s tensors ([B, H, rows, ...]) with
    ``most_rows`` rows each, every one starting on an ``_ALIGN`` boundary."""
    row_bytes = [math.prod(t.shape[:2]) * math.prod(t.shape[3:]) * t.element_size() for t in send]
    return sum(-(-n * most_rows // _ALIGN) * _ALIGN for n in row_bytes)


def _slot_bytes(piece: torch.Tensor, world: int) -> int:
    """The size of the collectives' W slots of ``piece``'s shape."""
    return world * piece.numel() * piece.element_size()


def _enable(symm_mem, group_name: str) -> None:
    with warnings.catch_warnings():  # not needed, and deprecated, from torch 2.12
        warnings.simplefilter("ignore")
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group_name)
