"""``ReplayComm``: one rank of a W-rank ring on its own, communication replaced by ready buffers.

A ``Communicator`` (``base.py``) whose operations hand back, at once, buffers of the shapes and
dtypes the peers would have sent: ``send_recv_next`` one like each tensor sent, ``send_recv``
one of each shape asked for, ``all_gather`` [W, *shape], ``reduce_scatter`` ``shape[1:]``.
Nothing is transferred or copied and what is sent is ignored, so a schedule run through it does exactly one rank's own work (block kernels, merges,
accumulations, copies, host work) and none of the communication. ``bench/per_rank.py`` times that
against the single-GPU ideal (DESIGN.md, "How we measure"); with nothing to transfer, capturing
a schedule in a CUDA graph needs only one GPU (``bench/per_rank.py --capture`` tries it).

Buffers: the n-th operation after ``rewind()`` gets the n-th set, allocated at its first use and
filled once with N(0, 1) values (seeded by ``seed``, the rank and the operation), then handed back
on every later iteration: nothing is allocated, filled or copied per call. Call ``rewind()`` at the
start of each iteration (a forward, or a forward and its backward). Operations never share a
buffer, so a schedule that writes into one it received (the ring backward adds its dK/dV into the
received accumulator) changes no other; such a buffer's values drift from call to call, which
changes no timing and no result of the current schedules (they read it only before sending it on).

Memory: one set per operation of an iteration, kept for the communicator's life (``buffer_bytes``):
W-1 received K/V pairs for the ring forward, where a real rank holds two at a time. A new buffer
is never allocated while a CUDA graph is being captured (that raises): run an iteration eagerly
first.
"""
import torch

from .base import _Done, check_most_rows, posted_then


class ReplayComm:
    """``Communicator`` for rank ``rank`` of ``world_size``; see the module docstring.

    ``max_ops``: how many operations an iteration may post before one is taken for a missing
    ``rewind()`` (which would allocate a new buffer set per call); default 64 + 8 W.
    """

    def __init__(self, rank: int, world_size: int, *, seed: int = 0, max_ops: int | None = None):
        for name, value in (("rank", rank), ("world_size", world_size), ("seed", seed)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int; got {value!r}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}, world_size={world_size}: need world_size >= 1 and "
                             f"0 <= rank < world_size")
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.max_ops = 64 + 8 * world_size if max_ops is None else max_ops
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._op = 0
        self.sent_bytes = 0

    def rewind(self) -> None:
        """Start an iteration: the next operation gets the first buffer set again, and
        ``sent_bytes`` (the bytes handed to the operations since) starts at 0."""
        self._op = 0
        self.sent_bytes = 0

    def buffer_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def _take(self, shapes_like: list[tuple[tuple, torch.Tensor]]) -> list[torch.Tensor]:
        """This operation's buffers: one per (shape, tensor whose dtype and device it takes);
        the tensors' bytes count as sent (as ``process_group.TRAFFIC`` counts them)."""
        self.sent_bytes += sum(like.numel() * like.element_size() for _, like in shapes_like)
        if self._op >= self.max_ops:
            raise RuntimeError(f"ReplayComm: {self._op} operations since the last rewind() "
                               f"(max_ops={self.max_ops}); call rewind() before each iteration")
        buffers = [self._buffer(part, tuple(shape), like)
                   for part, (shape, like) in enumerate(shapes_like)]
        self._op += 1
        return buffers

    def _buffer(self, part: int, shape: tuple, like: torch.Tensor) -> torch.Tensor:
        key = (self._op, part, shape, like.dtype, like.device)
        buffer = self._buffers.get(key)
        if buffer is None:
            if like.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"ReplayComm: operation {self._op} needs a new buffer {list(shape)} "
                    f"{like.dtype} during CUDA graph capture; run the same iteration eagerly "
                    "first (and rewind() before each)")
            buffer = torch.empty(shape, dtype=like.dtype, device=like.device)
            gen = torch.Generator(device=like.device)
            gen.manual_seed(((self.seed * 1_000_003 + self.rank) * 10_007 + self._op) * 101 + part)
            if buffer.is_floating_point() or buffer.is_complex():
                buffer.normal_(generator=gen)
            else:
                buffer.random_(0, 2 if buffer.dtype == torch.bool else 64, generator=gen)
            self._buffers[key] = buffer
        return buffer

    def send_recv_next(self, tensors, overlapping=None):
        if self.world_size == 1:  # as the real communicators: nothing to exchange
            return posted_then(_Done(list(tensors)), overlapping)
        return posted_then(_Done(self._take([(t.shape, t) for t in tensors])), overlapping)

    def send_recv(self, offset, send, recv_shapes, most_rows, overlapping=None):
        check_most_rows(send, recv_shapes, most_rows)
        return posted_then(_Done(self._take([(shape, t) for t, shape in zip(send, recv_shapes)])),
                           overlapping)

    def all_gather(self, tensor):
        return _Done(self._take([((self.world_size, *tensor.shape), tensor)])[0])

    def reduce_scatter(self, tensor):
        if tensor.shape[0] != self.world_size:
            raise ValueError(f"reduce_scatter: tensor.shape[0]={tensor.shape[0]} must be the "
                             f"world size {self.world_size}")
        return _Done(self._take([(tensor.shape[1:], tensor)])[0])

    def __repr__(self):
        return (f"ReplayComm(rank={self.rank}, world_size={self.world_size}, "
                f"{len(self._buffers)} buffers, {self.buffer_bytes() / 2**20:.1f} MiB)")
