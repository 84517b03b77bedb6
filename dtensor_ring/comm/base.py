"""The communicator interface the schedules are written against.

A schedule needs four things from its peers; ``Communicator`` names them. ``ProcessGroupComm``
(``process_group.py``) runs them on a real process group (gloo or NCCL); ``simulated.SimComm``
runs them between threads of one process, so ``simulate_ring`` executes the very same schedule
code; ``traced.TracedComm`` expresses them as traceable ops, so the compile pass can trace that same
code into a graph of explicit steps; ``replay.ReplayComm`` hands back ready buffers.

Every operation is posted at once and returns a ``Pending``; ``wait()`` gives the result. A schedule
posts the next step's exchange before it computes the current step, so the two overlap.
"""
from typing import Callable, Optional, Protocol

import torch


class Pending(Protocol):
    def wait(self): ...


class Communicator(Protocol):
    rank: int
    world_size: int

    def send_recv_next(self, tensors: list[torch.Tensor],
                       overlapping: Optional[Callable[[], None]] = None) -> Pending:
        """Send ``tensors`` to rank+1 and receive tensors of the same shapes from rank-1 (mod W);
        ``wait()`` gives the list. One message per tensor, posted together: K and V travel
        without being copied into one buffer first.

        ``overlapping``: launches the compute this exchange should hide behind, which needs
        nothing from it (a schedule's first step). The communicator runs it after posting, or
        before where that overlaps the two sooner (``peer_copy.py``: the copy engines need no SM,
        so the first kernel goes to the GPU before the post's host time)."""

    def send_recv(self, offset: int, send: list[torch.Tensor], recv_shapes: list,
                  most_rows: int, overlapping: Optional[Callable[[], None]] = None) -> Pending:
        """Send ``send`` to rank + ``offset`` and receive tensors of ``recv_shapes`` (dtype and
        device of the ``send`` tensor at the same place) from rank - ``offset`` (mod W);
        ``wait()`` gives the list. A tensor of no elements is not sent or received. Every rank
        calls it at the same points (its traced form is a collective), with nothing to move
        where it has nothing, and the same ``most_rows``: a bound on the rows (dim 2) of any
        tensor any rank sends or receives in this call, which sizes the copy engines' buffers
        (``peer_copy.py``). ``overlapping``: as ``send_recv_next``'s. The sliding-window
        exchange (``schedules/windowed.py``)."""

    def all_gather(self, tensor: torch.Tensor) -> Pending:
        """Every rank's ``tensor`` stacked along a new leading dim of size W, in rank order."""

    def reduce_scatter(self, tensor: torch.Tensor) -> Pending:
        """``tensor`` has a leading dim of size W; rank r gets the sum over ranks of ``tensor[r]``."""


def posted_then(pending: Pending, overlapping: Optional[Callable[[], None]]) -> Pending:
    """``pending``, once ``overlapping`` (``Communicator.send_recv_next``) has been launched."""
    if overlapping is not None:
        overlapping()
    return pending


class _Done:
    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value


def check_most_rows(send: list[torch.Tensor], recv_shapes: list, most_rows: int) -> None:
    """``Communicator.send_recv``'s bound holds: no tensor sent or received has more rows.

    Raises:
        ValueError: naming the tensor and its rows.
    """
    for what, shapes in (("send", [t.shape for t in send]), ("recv_shapes", recv_shapes)):
        for i, shape in enumerate(shapes):
            if shape[2] > most_rows:
                raise ValueError(f"send_recv: {what}[{i}] has {shape[2]} rows (dim 2 of "
                                 f"{tuple(shape)}), more than most_rows={most_rows}")


def sum_in_rank_order(parts: torch.Tensor) -> torch.Tensor:
    """Sum over the leading dim in a fixed order, so the simulated and gloo paths agree bit for bit."""
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total
