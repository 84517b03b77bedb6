"""The cost model that picks the split of a context-parallel job: how many GPUs of a node share the
all-to-all (inner size I), and which schedule runs the ring over the rest (outer).

Closed form, per GPU, for causal attention of B x Hq heads (Hkv key/value heads) of head dim D,
n tokens per GPU, W = O x I GPUs, e bytes per element (docs/design.md derives and checks it):

    F  = 2 B Hq D W n^2 / flops          the forward's attention time (balanced layouts);
                                         the backward's is 2.5 F
    K  = 2 B Hkv' I n D e / C            bytes of one piece's K and V on an outer rank
                                         (Hkv' = max(Hkv / I, 1) key/value heads per inner rank;
                                          C pieces per head group; I = 1: the flat ring)

ring schedules (zigzag, stripe) over P = O ranks, per piece, with c = F / (C P) per step:
    forward   c + (P - 1) max(c, t(K))                 t(x) = latency + x / bandwidth of the
    backward  2.5c + (P - 1) max(2.5c, t(3K))          outer link (the dK/dV accumulator: fp32)
llama3 over P ranks in g = min(Hkv' / C, P) head groups, c_g = F / (C g):
    forward   t((P-1) K / g) + (g - 1) max(c_g, t((P-1) K / g)) + c_g
    backward  max(t(G) + 2.5 g c_g + t(2G), g (t(G) + t(2G)))   G = (P-1) K / g  (gather, then
                                                                fp32 reduce-scatter, per group)
the all-to-all (I > 1), per piece, over the inner link, (I - 1) / I of each buffer leaving:
    forward   in: q, k, v;  out: out (fp32 in exact mode), LSE
    backward  in: dout, q, k, v, out, LSE;  out: dq, dk, dv
    a piece's exchanges hide behind the previous piece's outer schedule, except the first's in
    and the last's out:  T = in + sum_c max(outer_c, in_(c+1) + out_(c-1)) + out

The outer link is the network when the job spans nodes (every outer hop then crosses one: the
ring waits for its slowest hop each step), else NVLink. ``pick`` takes the cheapest (inner size,
outer schedule) over the inner sizes that divide the node's GPUs and the heads.
"""
from dataclasses import dataclass

from ..timeline import BACKWARD_FLOPS, Link, Machine, Modelled
from .heads import head_split

OUTER_SCHEDULES = ("zigzag", "llama3")  # stripe costs what zigzag does; ring is unbalanced


@dataclass(frozen=True)
class Job:
    """One attention call's shape: tokens per GPU, heads, head dim, batch, bytes per element."""

    tokens_per_gpu: int
    q_heads: int
    kv_heads: int
    head_dim: int = 128
    batch: int = 1
    element_size: int = 2
    exact: bool = False


def _ring(pieces, steps, compute, k_bytes, link: Link) -> Modelled:
    """A ring schedule over ``steps`` ranks, ``pieces`` times (one per head piece)."""
    c = compute / (pieces * steps)
    if steps == 1:
        return Modelled(c, BACKWARD_FLOPS * c)
    forward = c + (steps - 1) * max(c, link.time(k_bytes))
    cb = BACKWARD_FLOPS * c
    backward = cb + (steps - 1) * max(cb, link.time(3 * k_bytes))
    return Modelled(forward, backward)


def _llama3(pieces, steps, groups, compute, k_bytes, link: Link) -> Modelled:
    c = compute / (pieces * groups)
    if steps == 1:
        return Modelled(c, BACKWARD_FLOPS * c)
    gather = (steps - 1) * k_bytes / groups
    cb = BACKWARD_FLOPS * c
    forward = link.time(gather) + (groups - 1) * max(c, link.time(gather)) + c
    # the gathers (16-bit K/V) and reduce-scatters (fp32 dK/dV) share the sender's port; a
    # group's reduce-scatter overlaps the next group's compute: the compute path or the port's
    backward = max(link.time(gather) + groups * cb + link.time(2 * gather),
                   groups * (link.time(gather) + link.time(2 * gather)))
    return Modelled(forward, backward)


def predict(job: Job, machine: Machine, inner: int, outer_schedule: str,
            world_size: int) -> Modelled:
    """Modelled forward and backward seconds of ``outer_schedule`` on ``world_size`` GPUs split
    as (world_size / inner) ring ranks x ``inner`` all-to-all ranks (inner = 1: the flat ring)."""
    outer = world_size // inner
    split = head_split(job.q_heads, job.kv_heads, inner) if inner > 1 else None
    pieces = split.chunks if split else 1
    kv_heads = max(job.kv_heads // inner, 1)
    n, e, b, d = job.tokens_per_gpu, job.element_size, job.batch, job.head_dim
    compute = 2 * b * job.q_heads * d * world_size * n * n / machine.flops
    k_bytes = 2 * b * kv_heads * inner * n * d * e / pieces
    link = machine.network if world_size > machine.gpus_per_node else machine.nvlink
    if outer_schedule == "llama3":
        groups = min(max(kv_heads // pieces, 1), outer)
        piece = _llama3(pieces, outer, groups, compute, k_bytes, link)
    else:
        piece = _ring(pieces, outer, compute, k_bytes, link)
    if inner == 1:
        return piece
    share = (inner - 1) / inner
    q_bytes = b * job.q_heads * n * d * e / pieces  # one piece of q, sent as a whole buffer
    kv_buffer = k_bytes / 2  # k or v: a piece's all-to-all buffer
    out_bytes = q_bytes * (2 if job.exact else 1)
    lse_bytes = b * job.q_heads * n * 4 / pieces
    a2a = machine.nvlink
    forward_in = a2a.time(share * (q_bytes + 2 * kv_buffer))
    forward_out = a2a.time(share * (out_bytes + lse_bytes))
    backward_in = a2a.time(share * (2 * q_bytes + 2 * kv_buffer + out_bytes + lse_bytes))
    backward_out = a2a.time(share * (q_bytes + 2 * kv_buffer))
    return Modelled(_pipelined(pieces, piece.forward, forward_in, forward_out),
                    _pipelined(pieces, piece.backward, backward_in, backward_out))


def _pipelined(pieces, outer, into, back) -> float:
    """``pieces`` runs of the outer schedule with the all-to-all of the next piece's inputs and
    the previous piece's results behind each (schedule.py's timeline)."""
    total = into + back
    for c in range(pieces):
        total += max(outer, (into if c + 1 < pieces else 0) + (back if c > 0 else 0))
    return total


@dataclass(frozen=True)
class Split:
    inner: int
    outer_schedule: str
    time: Modelled


def candidates(job: Job, machine: Machine, world_size: int) -> list[Split]:
    """Every (inner size, outer schedule) the model can price for ``world_size`` GPUs: inner sizes
    that divide the node's GPUs and the world, and that the heads can split over."""
    found = []
    for inner in range(1, machine.gpus_per_node + 1):
        if machine.gpus_per_node % inner or world_size % inner:
            continue
        if inner > 1 and (job.q_heads % inner or (job.kv_heads % inner
                                                  and inner % job.kv_heads)):
            continue
        for schedule in OUTER_SCHEDULES:
            found.append(Split(inner, schedule, predict(job, machine, inner, schedule,
                                                        world_size)))
    return found


def pick(job: Job, machine: Machine, world_size: int) -> Split:
    """The split the model says is fastest (forward + backward)."""
    return min(candidates(job, machine, world_size), key=lambda s: s.time.total)
