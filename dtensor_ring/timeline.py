"""Modelled time: the real schedule code on simulated ranks, its messages charged to the links they
cross and its kernel calls to a compute rate, on meta tensors (shapes only, no arithmetic), so a
W = 64 run of 8K tokens per GPU takes seconds on a CPU.

The model (``Timeline``):

* a ``Link`` (bandwidth, latency): a message of n bytes takes latency + n / bandwidth;
* a ``Machine``: ``gpus_per_node`` GPUs per node, ``nvlink`` between GPUs of a node, ``network``
  between nodes, and ``flops``, the attention kernels' throughput (a block's flops: the forward's
  4 B H Sq Sk D times the fraction its mask keeps; the backward's 2.5 times that);
* every rank has a clock: a kernel call advances it by flops / ``flops``; posting an operation
  costs nothing; each of its messages leaves through the sender's port for its link kind, one
  after another (n / bandwidth each), no earlier than the receiver posted its side of the same
  operation (NCCL's send/recv and collectives meet like that), and is done latency + n /
  bandwidth after it left; a collective's messages (all-gather, reduce-scatter, all-to-all) all
  take the slowest link among its ranks, as NCCL's rings do; waiting on an operation moves the clock to the last of its messages
  to and from the rank (a send completes when it is received, as NCCL's do);
* not modelled: merges, copies and host time (free), contention other than the sender's port,
  collective algorithms (an all-gather is W - 1 messages from each rank, one latency each).

``modelled_time`` runs a schedule's forward and backward on a 1-D or 2-D simulated mesh under
this model; ``hybrid/cost.py``'s closed-form model is checked against it (tests/test_hybrid.py).
"""
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .comm.simulated import simulated_mesh
from .hybrid.schedule import placed_schedule
from .kernels.base import CAUSAL, MASKS, NONE, BlockKernel
from .schedules import get_schedule

BACKWARD_FLOPS = 2.5  # the backward's flops per forward flop (5 matmuls to 2)


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes per second, one direction, per GPU
    latency: float  # seconds per message

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Machine:
    """Nodes of ``gpus_per_node`` GPUs; defaults like an H100 SXM node (NVLink 4) and 400 Gb/s
    InfiniBand per GPU, and a bf16 attention kernel at 450 TFLOP/s."""

    gpus_per_node: int = 8
    nvlink: Link = Link(370e9, 8e-6)
    network: Link = Link(45e9, 15e-6)
    flops: float = 450e12

    def link(self, *ranks: int) -> tuple[str, Link]:
        """The slowest link between global ``ranks`` (node-major numbering)."""
        if len({rank // self.gpus_per_node for rank in ranks}) == 1:
            return "nvlink", self.nvlink
        return "network", self.network


class Sent(NamedTuple):
    leaves: float  # when its port lets it go (before the receiver's side is known)
    link: Link
    nbytes: int


class Timeline:
    """The clocks and ports of ``world_size`` ranks on ``machine`` (see the module docstring).
    Each rank's clock and ports are changed only by its own thread (``bind``)."""

    def __init__(self, machine: Machine, world_size: int):
        self.machine = machine
        self.clock = [0.0] * world_size
        self._port: dict = {}  # (rank, link kind) -> when it is free
        self._local = threading.local()

    def bind(self, rank: int) -> None:
        self._local.rank = rank

    def now(self, rank: int) -> float:
        return self.clock[rank]

    def compute(self, seconds: float) -> None:
        self.clock[self._local.rank] += seconds

    def send(self, src: int, dst: int, nbytes: int, group=None) -> Sent:
        """A message from ``src`` to ``dst``; ``group``: the ranks of the collective it is part
        of (it goes at the pace of their slowest link), None for a point-to-point one."""
        kind, link = self.machine.link(*(group or (src, dst)))
        leaves = max(self.clock[src], self._port.get((src, kind), 0.0))
        self._port[(src, kind)] = leaves + nbytes / link.bandwidth
        return Sent(leaves, link, nbytes)

    def arrive(self, rank: int, sent: Sent, receiver_ready: float) -> None:
        done = max(sent.leaves, receiver_ready) + sent.link.time(sent.nbytes)
        self.clock[rank] = max(self.clock[rank], done)


def mask_fraction(mask: str, q_len: int, k_len: int) -> float:
    """The fraction of a q_len x k_len block's scores that ``mask`` keeps."""
    if mask == NONE:
        return 1.0
    if mask == CAUSAL:  # square
        return (q_len + 1) / (2 * q_len)
    kept = q_len * (k_len - q_len + 1) + q_len * (q_len - 1) / 2  # bottom-right, q_len <= k_len
    return kept / (q_len * k_len)


class ModelledKernel(BlockKernel):
    """A block kernel that computes nothing: it returns empty results of the right shapes and
    charges its flops to the calling rank's clock."""

    name = "modelled"
    masks = MASKS

    def __init__(self, timeline: Timeline):
        self.timeline = timeline

    def available(self, device, dtype, head_dim):
        return True

    def _charge(self, q, k, mask, factor):
        batch, heads, q_len, dim = q.shape
        flops = 4 * batch * heads * q_len * k.shape[2] * dim * mask_fraction(mask, q_len,
                                                                             k.shape[2])
        self.timeline.compute(factor * flops / self.timeline.machine.flops)

    def forward(self, q, k, v, mask, scale, segments=None, window=None):  # no window modelled
        self._charge(q, k, mask, 1.0)
        return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)

    def backward(self, dout, q, k, v, out, lse, mask, scale, segments=None, window=None):
        self._charge(q, k, mask, BACKWARD_FLOPS)
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


class Modelled(NamedTuple):
    forward: float  # seconds: the last rank's clock at the end of the forward
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward


def modelled_time(schedule: str, mesh_shape: tuple[int, int], machine: Machine, *,
                  tokens_per_gpu: int, q_heads: int, kv_heads: int, head_dim: int = 128,
                  batch: int = 1, dtype: torch.dtype = torch.bfloat16,
                  is_causal: bool = True) -> Modelled:
    """Forward and backward time of ``schedule`` on a mesh of ``mesh_shape`` = (ring ranks,
    all-to-all ranks) of ``machine``, ranks numbered node-major ((W, 1): the flat ring)."""
    outer, inner = mesh_shape
    world = outer * inner
    sched = placed_schedule(get_schedule(schedule), outer, inner)

    def tensor(heads, dt=dtype):
        return torch.empty(batch, heads, tokens_per_gpu, head_dim, device="meta", dtype=dt)

    q, k, v, dout = tensor(q_heads), tensor(kv_heads), tensor(kv_heads), tensor(q_heads)
    lse = torch.empty(batch, q_heads, tokens_per_gpu, device="meta", dtype=torch.float32)
    times = []
    for run in (lambda comm, kw: sched.forward(comm, q, k, v, **kw),
                lambda comm, kw: sched.backward(comm, dout, q, k, v, q, lse, **kw)):
        timeline = Timeline(machine, world)
        options = dict(is_causal=is_causal, scale=head_dim ** -0.5,
                       kernel=ModelledKernel(timeline), docs=None)
        simulated_mesh(mesh_shape, timeline).run(lambda comm: run(comm, options))
        times.append(max(timeline.clock))
    return Modelled(*times)
