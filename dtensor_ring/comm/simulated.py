"""An in-process ring: W threads, one per simulated rank, exchanging tensors through a shared mailbox.

``SimComm`` implements ``base.Communicator`` (and the hybrid's all-to-all) so the schedules run
unchanged; each rank's arithmetic is exactly what a real rank does (same kernels, same shapes, same
summation order), only the transport differs. Messages are keyed by (src, dst, operation number),
so a rank may wait on its posted operations in any order, as a real process group allows.

``SimWorld`` is one group of ranks (a 1-D mesh); ``SimMesh`` a 2-D mesh of ``outer`` x ``inner``
ranks, one ``SimWorld`` per row (the all-to-all's groups) and per column (the ring's), as
``init_device_mesh`` builds them.

With a ``timeline.Timeline`` the worlds also model time: each message is charged to the link it
crosses (bytes / bandwidth + latency, per link kind) and each kernel call to its rank's clock
(``timeline.py`` says how).
"""
import threading

import torch

from ..hybrid.comm import HybridComm
from .base import _Done, check_most_rows, posted_then, sum_in_rank_order

_TIMEOUT_S = 600.0


class SimWorld:
    """``world_size`` simulated ranks. ``timeline``: model time on it (None: no model);
    ``ranks``: this world's ranks as the timeline numbers them (default 0 .. W-1)."""

    def __init__(self, world_size: int, timeline=None, ranks=None):
        self.world_size = world_size
        self.timeline = timeline
        self.ranks = list(range(world_size)) if ranks is None else list(ranks)
        self._mail: dict[tuple, object] = {}
        self._waiting: dict[tuple, threading.Event] = {}  # keys someone waits for: wake only them
        self._lock = threading.Lock()
        self.error: BaseException | None = None

    def post(self, src, dst, seq, message, collective=False):
        """``message``: a tensor or a list of tensors; ``collective``: part of an all-gather,
        reduce-scatter or all-to-all (timed at the pace of the group's slowest link). Returns the
        timeline's record of the send (None without a timeline)."""
        # Copies, as a wire would make: the sender may reuse its buffers after posting.
        copied = ([t.detach().clone() for t in message] if isinstance(message, list)
                  else message.detach().clone())
        sent = None
        if self.timeline is not None and src != dst:
            parts = message if isinstance(message, list) else [message]
            sent = self.timeline.send(self.ranks[src], self.ranks[dst],
                                      sum(t.numel() * t.element_size() for t in parts),
                                      self.ranks if collective else None)
        self._put((src, dst, seq), (copied, sent))
        return sent

    def posted(self, rank, seq):
        """Rank ``rank`` has posted its side of operation ``seq`` (its receives are ready)."""
        if self.timeline is not None:
            self._put(("ready", rank, seq), self.timeline.now(self.ranks[rank]))

    def take(self, src, dst, seq):
        message, sent = self._get((src, dst, seq), f"simulated rank {dst} waited for rank {src}")
        if sent is not None:
            self.timeline.arrive(self.ranks[dst], sent, self.ready_time(dst, seq))
        return message

    def ready_time(self, rank, seq):
        """When rank ``rank`` posted operation ``seq`` (waits until it has)."""
        return self._get(("ready", rank, seq), f"a simulated rank waited for rank {rank} to post",
                         pop=False)

    def delivered(self, src, dst, seq, sent):
        """The sender's side of a message: done once the receiver was ready (a rendezvous)."""
        self.timeline.arrive(self.ranks[src], sent, self.ready_time(dst, seq))

    def _put(self, key, value):
        with self._lock:
            self._mail[key] = value
            event = self._waiting.pop(key, None)
        if event is not None:
            event.set()

    def _get(self, key, what, pop=True):
        with self._lock:
            event = (self._waiting.setdefault(key, threading.Event())
                     if key not in self._mail and self.error is None else None)
        if event is not None and not event.wait(_TIMEOUT_S):
            raise RuntimeError(f"{what} for {_TIMEOUT_S}s")
        with self._lock:
            if self.error is not None:
                raise RuntimeError("another simulated rank failed") from self.error
            return self._mail.pop(key) if pop else self._mail[key]

    def fail(self, error):
        with self._lock:
            self.error = error
            waiting, self._waiting = list(self._waiting.values()), {}
        for event in waiting:
            event.set()

    def run(self, fn):
        """Run ``fn(comm)`` on every simulated rank; return the results in rank order."""
        return run_ranks(self.world_size, lambda rank: fn(SimComm(self, rank)), [self],
                         self.timeline, self.ranks)


class SimMesh:
    """A 2-D mesh of ``outer`` x ``inner`` simulated ranks; rank (i, j) is ``i * inner + j``."""

    def __init__(self, outer: int, inner: int, timeline=None):
        self.outer, self.inner, self.world_size = outer, inner, outer * inner
        self.timeline = timeline
        self.columns = [SimWorld(outer, timeline, [i * inner + j for i in range(outer)])
                        for j in range(inner)]  # the ring's groups
        self.rows = [SimWorld(inner, timeline, [i * inner + j for j in range(inner)])
                     for i in range(outer)]  # the all-to-all's groups

    def comm(self, rank: int) -> HybridComm:
        i, j = divmod(rank, self.inner)
        return HybridComm(SimComm(self.columns[j], i), SimComm(self.rows[i], j))

    def run(self, fn):
        """Run ``fn(comm)`` (a ``HybridComm``) on every rank; the results in rank order."""
        return run_ranks(self.world_size, lambda rank: fn(self.comm(rank)),
                         self.columns + self.rows, self.timeline, range(self.world_size))


def simulated_mesh(world, timeline=None):
    """W ranks (``SimWorld``), or (ring ranks, all-to-all ranks) (``SimMesh``; a ``SimWorld`` of
    the ring ranks when the all-to-all has one)."""
    if isinstance(world, tuple):
        outer, inner = world
        return SimWorld(outer, timeline) if inner == 1 else SimMesh(outer, inner, timeline)
    return SimWorld(world, timeline)


def run_ranks(world_size, body, worlds, timeline, ranks):
    """``body(rank)`` on one thread per rank; the first error fails every world and is raised."""
    results = [None] * world_size

    def run(rank):
        try:
            if timeline is not None:
                timeline.bind(ranks[rank])
            results[rank] = body(rank)
        except BaseException as error:  # noqa: BLE001 - re-raised below on the caller's thread
            for world in worlds:
                world.fail(error)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for world in worlds:
        if world.error is not None:
            raise world.error
    return results


class _Recv:
    def __init__(self, world, sources, dst, seq, finish, destinations=()):
        self.world, self.sources, self.dst, self.seq, self.finish = world, sources, dst, seq, finish
        self.destinations = destinations  # with a timeline: the sends to wait for
        self.sent = {}

    def wait(self):
        received = [self.world.take(src, self.dst, self.seq) for src in self.sources]
        for dst, sent in self.sent.items():
            self.world.delivered(self.dst, dst, self.seq, sent)
        return self.finish(received)


class SimComm:
    """``Communicator`` (and ``AllToAll``) for simulated rank ``rank`` of ``world``."""

    def __init__(self, world: SimWorld, rank: int):
        self.world, self.rank, self.world_size = world, rank, world.world_size
        self._seq = 0

    def _post(self, messages: dict, sources, finish, collective=True):
        """Post ``messages`` (dst -> message) as one operation; receive from ``sources``."""
        self._seq += 1
        seq = self._seq
        self.world.posted(self.rank, seq)
        pending = _Recv(self.world, sources, self.rank, seq, finish)
        for dst, message in messages.items():
            sent = self.world.post(self.rank, dst, seq, message, collective)
            if sent is not None:
                pending.sent[dst] = sent
        return pending

    def send_recv_next(self, tensors, overlapping=None):
        if self.world_size == 1:
            return posted_then(_Done(list(tensors)), overlapping)
        return posted_then(self._post({(self.rank + 1) % self.world_size: list(tensors)},
                                      [(self.rank - 1) % self.world_size], lambda parts: parts[0],
                                      collective=False), overlapping)

    def send_recv(self, offset, send, recv_shapes, most_rows, overlapping=None):
        """``send`` to rank + ``offset`` (nothing if it is empty), ``recv_shapes`` from rank -
        ``offset`` (the sliding-window exchange, ``schedules/windowed.py``)."""
        check_most_rows(send, recv_shapes, most_rows)
        messages = ({(self.rank + offset) % self.world_size: list(send)}
                    if any(t.numel() for t in send) else {})
        if any(torch.Size(shape).numel() for shape in recv_shapes):
            pending = self._post(messages, [(self.rank - offset) % self.world_size],
                                 lambda parts: parts[0], collective=False)
        else:
            empty = [t.new_empty(shape) for t, shape in zip(send, recv_shapes)]
            pending = self._post(messages, [], lambda parts: empty, collective=False)
        return posted_then(pending, overlapping)

    def all_gather(self, tensor):
        return self._post({dst: tensor for dst in range(self.world_size)},
                          range(self.world_size), torch.stack)

    def reduce_scatter(self, tensor):
        return self._post({dst: tensor[dst] for dst in range(self.world_size)},
                          range(self.world_size),
                          lambda parts: sum_in_rank_order(torch.stack(parts)))

    def all_to_all(self, tensor):
        """Row d of ``tensor`` to rank d; ``wait()``: row s from rank s (the hybrid's inner
        exchange, ``hybrid/comm.py``)."""
        if self.world_size == 1:
            return _Done(tensor)
        return self._post({dst: tensor[dst] for dst in range(self.world_size)},
                          range(self.world_size), torch.stack)
