"""The communicator of schedules traced by the compile pass (``TracedComm``): each exchange a pair
of custom ops around the eager one,

    handle   = dtensor_ring::post_exchange(tensors, after, kind, group_name,
                                           after_kernels)              # posts it at once
    received = dtensor_ring::wait_exchange(handle, tensors, kind, world_size, after_kernels,
                                           recv_sizes, after_post)     # its result

``kind`` names the ``ProcessGroupComm`` operation run inside ("send_recv_next", "send_recv",
"all_gather", "reduce_scatter", and the hybrid's "all_to_all"; "send_recv", the sliding-window
exchange, also takes its offset, the received tensors' shapes, flattened in ``recv_sizes``, and
its ``most_rows``), so a compiled ring exchanges exactly as an eager one does: the K/V (or dK/dV)
of a ring step on the copy engines (``peer_copy.py``) or in one NCCL group, then the head start
that lets NCCL onto the GPU before the step's attention kernel
(``process_group.NCCL_HEAD_START_CYCLES``), and each exchange where the schedule posts it.

A shift (or a sliding window's exchange) whose step launches compute before it waits on anything
(a call's first: the rank's own blocks) is posted in two halves around that compute, as eager
posts it (``ProcessGroupComm.begin_send_recv_next`` / ``begin_send_recv``):

    begun    = dtensor_ring::begin_exchange(tensors, after, group_name, kind, ...)  # NCCL: posted
    ... the step's kernels ...
    handle   = dtensor_ring::post_begun_exchange(begun, after_kernels)   # copy engines: posted

NCCL's kernels must reach the GPU before the attention kernel's, which would hold every SM; the
copy engines need no SM, so the kernel goes first and the GPU computes while the host posts the
copies (their host time, ~0.2 ms, is otherwise idle GPU time for a call run alone: compiled
forwards run alone took 1.085x eager's time at W = 4 with the post first, 1.01x since;
docs/results.md). The copies still wait only for what was queued at the begin.

Why not PyTorch's functional collectives, as the pass used first. Torch 2.11 has no traceable
send/recv (``_c10d_functional.isend`` and ``batch_p2p_ops`` came in 2.12); the
``all_to_all_single`` that stood in for it (one non-zero split each way) posts a send and a
receive to every rank, one collective per tensor, with no head start: compiled zigzag was
slower than eager. And inductor moved llama3's all-gathers and reduce-scatters down to just
before their waits, after the compute they were posted to overlap (measured: docs/design.md,
"Measurements behind design choices"; now: docs/results.md, "torch.compile against eager").

What inductor must not do, and how it is kept from it:

* Reorder posts. Collectives must be posted in the same order on every rank, and NCCL pairs a
  rank's sends with its neighbour's receives in the order they are posted, but inductor schedules
  each rank's graph (other blocks on every rank) on its own: on real GPU ranks that gave wrong
  dK/dV (zigzag) and NaN (llama3). Each post takes the previous one's handle (``after``; the pass
  threads it through every ring node of a graph), a data dependency that fixes their order.
* Move a wait above the compute, or the post, that the schedule put before it. Inductor places
  a node anywhere its inputs allow, and its peak-memory reordering hoisted waits: in llama3's
  backward (the plan for kernels without a bottom-right causal mask, as cuDNN) each head group's
  reduce-scatter was posted below the next group's blocks and waited on at once, nothing
  overlapped. ``wait_exchange`` takes ``after_post`` and ``after_kernels`` only as dependencies:
  the pass hands it the last post before the wait in graph order and every attention kernel's
  output since its own post (``passes/ring_expand.py``, ``_order_exchanges``); a begun shift's
  second half likewise takes the kernels since its begin, so the copies are posted after their
  launch.
* Move a post above the compute that the schedule put before it. A post that reads only local
  tensors (llama3's all-gathers, a sliding window's messages) depends on no compute: inductor
  posted all of compiled llama3's head groups at the start of its forward, four in flight at
  once, and its blocks waited on later groups (the forward 1.4x eager's time on 4 H200s). Posts
  take ``after_kernels`` too: every kernel since the post before.
* Move compute above the post that the schedule put before it. The blocks after a post whose
  operands are all local (the backward's late own blocks, after the dK/dV accumulator's post)
  depend on it through nothing, and inductor's peak-memory reordering moved them above it: the
  post then came after all the compute, its transfer exposed (measured on 2 H200s: compiled
  zigzag's fwd+bwd 1.01-1.02x eager's back to back, 0.99x with the order kept). The pass hands
  such a block its LSE through ``after_exchange`` (``_order_kernels``).
* Reuse a buffer being sent. Inductor plans the reuse of a buffer from its last use in the graph;
  the transfer reads it until the wait. ``wait_exchange`` takes the sent tensors too, only to be
  their last use. Both ops are ``flexible_layout``: under inductor's default constraint (the
  traced strides) each op got its own realized copy of a computed tensor (the backward's dK/dV
  accumulator), and the copy the wait held was not the one being sent.

The exchange in flight travels on the handle, a tensor of no elements: the compiled code hands
``wait_exchange`` the very object ``post_exchange`` returned.
"""
from typing import Optional

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from .base import _Done, posted_then
from .process_group import comm_of

KINDS = ("send_recv_next", "send_recv", "all_gather", "reduce_scatter",
         "all_to_all")  # ProcessGroupComm's
_LISTS = ("send_recv_next", "send_recv")  # the kinds that send and receive a list of tensors
_IN_FLIGHT = "_dtensor_ring_exchange"
_BEGUN = "_dtensor_ring_begun"  # begin_exchange's: the function that posts the rest
_TAGS = (torch.Tag.flexible_layout,)


def _shapes(recv_sizes, tensors) -> list[list[int]]:
    """``recv_sizes`` (the received tensors' shapes, each of its send tensor's rank, flattened)
    as shapes."""
    shapes, start = [], 0
    for t in tensors:
        shapes.append(list(recv_sizes[start:start + t.dim()]))
        start += t.dim()
    return shapes


@torch.library.custom_op("dtensor_ring::post_exchange", mutates_args=(), tags=_TAGS)
def post_exchange(tensors: list[torch.Tensor], after: Optional[torch.Tensor], kind: str,
                  group_name: str, after_kernels: list[torch.Tensor], offset: int = 0,
                  recv_sizes: Optional[list[int]] = None, most_rows: int = 0) -> torch.Tensor:
    operation = getattr(comm_of(_resolve_process_group(group_name)), kind)
    handle = tensors[0].new_empty(0)
    if kind == "send_recv":
        posted = operation(offset, tensors, _shapes(recv_sizes, tensors), most_rows)
    else:
        posted = operation(tensors) if kind == "send_recv_next" else operation(tensors[0])
    setattr(handle, _IN_FLIGHT, posted)
    return handle


@post_exchange.register_fake
def _(tensors, after, kind, group_name, after_kernels, offset=0, recv_sizes=None, most_rows=0):
    return tensors[0].new_empty(0)


@torch.library.custom_op("dtensor_ring::wait_exchange", mutates_args=(), tags=_TAGS)
def wait_exchange(handle: torch.Tensor, tensors: list[torch.Tensor], kind: str,
                  world_size: int, after_kernels: list[torch.Tensor],
                  recv_sizes: Optional[list[int]] = None,
                  after_post: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
    exchange = getattr(handle, _IN_FLIGHT, None)
    if exchange is None:
        raise RuntimeError("dtensor_ring::wait_exchange was handed a tensor that "
                           "dtensor_ring::post_exchange did not return (or waited on it twice)")
    delattr(handle, _IN_FLIGHT)
    received = exchange.wait()
    return received if kind in _LISTS else [received]


@wait_exchange.register_fake
def _(handle, tensors, kind, world_size, after_kernels, recv_sizes=None, after_post=None):
    if kind == "send_recv_next":
        return [t.new_empty(t.shape) for t in tensors]  # contiguous, as they are received
    if kind == "send_recv":
        return [t.new_empty(shape) for t, shape in zip(tensors, _shapes(recv_sizes, tensors))]
    (tensor,) = tensors
    shapes = {"all_gather": (world_size, *tensor.shape), "reduce_scatter": tensor.shape[1:],
              "all_to_all": tensor.shape}
    return [tensor.new_empty(shapes[kind])]


@torch.library.custom_op("dtensor_ring::begin_exchange", mutates_args=(), tags=_TAGS)
def begin_exchange(tensors: list[torch.Tensor], after: Optional[torch.Tensor],
                   group_name: str, after_kernels: list[torch.Tensor],
                   kind: str = "send_recv_next", offset: int = 0,
                   recv_sizes: Optional[list[int]] = None, most_rows: int = 0) -> torch.Tensor:
    """The first half of a ring shift or sliding-window exchange (``kind``, with
    ``post_exchange``'s arguments) whose step launches compute in between
    (``ProcessGroupComm.begin_send_recv_next`` / ``begin_send_recv``): NCCL and gloo post here;
    the copy engines mark the compute stream here and post in ``post_begun_exchange``."""
    comm = comm_of(_resolve_process_group(group_name))
    handle = tensors[0].new_empty(0)
    if kind == "send_recv":
        begun = comm.begin_send_recv(offset, tensors, _shapes(recv_sizes, tensors), most_rows)
    else:
        begun = comm.begin_send_recv_next(tensors)
    setattr(handle, _BEGUN, begun)
    return handle


@begin_exchange.register_fake
def _(tensors, after, group_name, after_kernels, kind="send_recv_next", offset=0,
      recv_sizes=None, most_rows=0):
    return tensors[0].new_empty(0)


@torch.library.custom_op("dtensor_ring::post_begun_exchange", mutates_args=(), tags=_TAGS)
def post_begun_exchange(begun: torch.Tensor, after_kernels: list[torch.Tensor]) -> torch.Tensor:
    """The second half of ``begun``'s shift; its handle, as ``post_exchange``'s. ``after_kernels``
    are only dependencies: the pass hands it the attention kernels launched since the begin."""
    post = getattr(begun, _BEGUN, None)
    if post is None:
        raise RuntimeError("dtensor_ring::post_begun_exchange was handed a tensor that "
                           "dtensor_ring::begin_exchange did not return (or posted it twice)")
    delattr(begun, _BEGUN)
    handle = begun.new_empty(0)
    setattr(handle, _IN_FLIGHT, post())
    return handle


@post_begun_exchange.register_fake
def _(begun, after_kernels):
    return begun.new_empty(0)


def _eager_strides(x: torch.Tensor) -> list[int]:
    """``x``'s strides, except that a size-1 dim of stride 0 gets the stride eager's views give
    it (``unsqueeze``: the next dim's stride times its size, 1 last). Inductor may lay a size-1
    dim out with stride 0; no element is read along it, but cuDNN's backward refuses an LSE
    ``[B, H, S, 1]`` whose last stride is not 1 ("The stride for the last dimension ... should
    be 1 for input_names::Stats": the compiled windowed zigzag's reversed blocks on 4 H200s)."""
    strides = list(x.stride())
    for i in reversed(range(x.dim())):
        if x.shape[i] == 1 and strides[i] == 0:
            strides[i] = strides[i + 1] * x.shape[i + 1] if i + 1 < x.dim() else 1
    return strides


@torch.library.custom_op("dtensor_ring::after_exchange", mutates_args=())
def after_exchange(x: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` (its strides kept, ``_eager_strides``: a kernel must see the strides eager
    hands it) that exists only once ``handle``'s exchange is posted: the pass hands it to the
    blocks the schedule computes after that post (a backward block's LSE, the smallest of its
    operands), so that no reordering of inductor's moves them above it
    (``passes/ring_expand.py``, ``_order_kernels``)."""
    return torch.empty_strided(x.shape, _eager_strides(x), dtype=x.dtype,
                               device=x.device).copy_(x)


@after_exchange.register_fake
def _(x, handle):
    return torch.empty_strided(x.shape, _eager_strides(x), dtype=x.dtype, device=x.device)


# Neither may be dropped from a graph whose results look unused: a rank that skipped an exchange
# would leave the others waiting.
for _op in (torch.ops.dtensor_ring.post_exchange.default,
            torch.ops.dtensor_ring.begin_exchange.default,
            torch.ops.dtensor_ring.post_begun_exchange.default,
            torch.ops.dtensor_ring.wait_exchange.default):
    torch.fx.node.has_side_effect(_op)


class _Posted:
    def __init__(self, handle, tensors, kind, world_size, recv_sizes=None):
        self.args = handle, tensors, kind, world_size, recv_sizes

    def wait(self):
        handle, tensors, kind, world_size, recv_sizes = self.args
        received = wait_exchange(handle, tensors, kind, world_size, [], recv_sizes)
        return received if kind in _LISTS else received[0]


class TracedComm:
    """``Communicator`` for rank ``rank`` of the ``world_size`` ranks of process group
    ``group_name``, as traceable ops (make_fx, Dynamo). ``after``: the handle of the last exchange
    posted before (see the module docstring); ``last`` is this one's last, for the next."""

    def __init__(self, group_name: str, rank: int, world_size: int,
                 after: Optional[torch.Tensor] = None):
        self.group_name, self.rank, self.world_size = group_name, rank, world_size
        self.last = after

    def _post(self, tensors, kind, offset=0, recv_sizes=None, most_rows=0, overlapping=None):
        """The exchange posted, or, with ``overlapping``, begun, the compute launched, then
        posted: the order eager runs them in."""
        tensors = list(tensors)
        if overlapping is None:
            self.last = post_exchange(tensors, self.last, kind, self.group_name, [], offset,
                                      recv_sizes, most_rows)
        else:
            begun = begin_exchange(tensors, self.last, self.group_name, [], kind, offset,
                                   recv_sizes, most_rows)
            overlapping()
            self.last = post_begun_exchange(begun, [])
        return _Posted(self.last, tensors, kind, self.world_size, recv_sizes)

    def send_recv_next(self, tensors, overlapping=None):
        if self.world_size == 1:
            return posted_then(_Done(list(tensors)), overlapping)
        return self._post(tensors, "send_recv_next", overlapping=overlapping)

    def send_recv(self, offset, send, recv_shapes, most_rows, overlapping=None):
        sizes = [int(n) for shape in recv_shapes for n in shape]
        return self._post(send, "send_recv", offset, sizes, most_rows, overlapping)

    def all_gather(self, tensor):
        return self._post([tensor], "all_gather")

    def reduce_scatter(self, tensor):
        return self._post([tensor], "reduce_scatter")

    def all_to_all(self, tensor):
        if self.world_size == 1:
            return _Done(tensor)
        return self._post([tensor], "all_to_all")
