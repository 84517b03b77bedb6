"""An in-process ring: W threads, one per simulated rank, exchanging tensors through a shared mailbox.

``SimComm`` implements ``comm.Communicator`` so the schedules run unchanged; each rank's arithmetic is
exactly what a real rank does (same kernels, same shapes, same summation order), only the transport
differs. Messages are keyed by (src, dst, operation number), so a rank may wait on its posted
operations in any order, as a real process group allows.
"""
import threading

import torch

from .comm import _Done, sum_in_rank_order

_TIMEOUT_S = 600.0


class SimWorld:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self._mail: dict[tuple[int, int, int], torch.Tensor] = {}
        self._cond = threading.Condition()
        self.error: BaseException | None = None

    def post(self, src, dst, seq, message):
        """``message``: a tensor or a list of tensors."""
        with self._cond:
            # Copies, as a wire would make: the sender may reuse its buffers after posting.
            self._mail[(src, dst, seq)] = (
                [t.detach().clone() for t in message] if isinstance(message, list)
                else message.detach().clone())
            self._cond.notify_all()

    def take(self, src, dst, seq):
        key = (src, dst, seq)
        with self._cond:
            ok = self._cond.wait_for(lambda: key in self._mail or self.error is not None, _TIMEOUT_S)
            if self.error is not None:
                raise RuntimeError("another simulated rank failed") from self.error
            if not ok:
                raise RuntimeError(f"simulated rank {dst} waited {_TIMEOUT_S}s for rank {src}")
            return self._mail.pop(key)

    def fail(self, error):
        with self._cond:
            self.error = error
            self._cond.notify_all()

    def run(self, fn):
        """Run ``fn(comm)`` on every simulated rank; return the results in rank order."""
        results = [None] * self.world_size

        def body(rank):
            try:
                results[rank] = fn(SimComm(self, rank))
            except BaseException as error:  # noqa: BLE001 - re-raised below on the caller's thread
                self.fail(error)

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if self.error is not None:
            raise self.error
        return results


class _Recv:
    def __init__(self, world, sources, dst, seq, finish):
        self.world, self.sources, self.dst, self.seq, self.finish = world, sources, dst, seq, finish

    def wait(self):
        return self.finish([self.world.take(src, self.dst, self.seq) for src in self.sources])


class SimComm:
    """``Communicator`` for simulated rank ``rank`` of ``world``."""

    def __init__(self, world: SimWorld, rank: int):
        self.world, self.rank, self.world_size = world, rank, world.world_size
        self._seq = 0

    def _next_seq(self):
        self._seq += 1
        return self._seq

    def send_recv_next(self, tensors):
        if self.world_size == 1:
            return _Done(list(tensors))
        seq = self._next_seq()
        self.world.post(self.rank, (self.rank + 1) % self.world_size, seq, list(tensors))
        return _Recv(self.world, [(self.rank - 1) % self.world_size], self.rank, seq,
                     lambda parts: parts[0])

    def send_recv(self, offset, send, recv_shapes):
        seq = self._next_seq()
        if any(t.numel() for t in send):
            self.world.post(self.rank, (self.rank + offset) % self.world_size, seq, list(send))
        if not any(torch.Size(shape).numel() for shape in recv_shapes):
            return _Done([t.new_empty(shape) for t, shape in zip(send, recv_shapes)])
        return _Recv(self.world, [(self.rank - offset) % self.world_size], self.rank, seq,
                     lambda parts: parts[0])

    def all_gather(self, tensor):
        seq = self._next_seq()
        for dst in range(self.world_size):
            self.world.post(self.rank, dst, seq, tensor)
        return _Recv(self.world, range(self.world_size), self.rank, seq, torch.stack)

    def reduce_scatter(self, tensor):
        seq = self._next_seq()
        for dst in range(self.world_size):
            self.world.post(self.rank, dst, seq, tensor[dst])
        return _Recv(self.world, range(self.world_size), self.rank, seq,
                     lambda parts: sum_in_rank_order(torch.stack(parts)))
