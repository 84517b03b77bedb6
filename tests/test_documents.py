"""Packed documents (``cu_seqlens``): the per-document layouts, every schedule against a float64
reference of each document's own attention, and the errors for bad boundaries.

The reference is the single-device kernel run on each document alone (a block-diagonal mask), in
float64; tolerances as everywhere (``dtensor_ring/tools/numerics.py``: fp32 mode <= 1.25x the
single-device kernel's rel-RMS in bf16), and exact mode <= 1.02x it *per document* (documents
shorter than 16 tokens together). A ring that ignores the boundaries, or boundaries one chunk
off, must fail them.
"""
import itertools
import math

import pytest
import torch

import dtensor_ring as dr
from dist_utils import run_on_ranks
from dtensor_ring.comm import TRAFFIC
from dtensor_ring.comm.simulated import SimWorld
from dtensor_ring.documents import documents, within_document
from dtensor_ring.kernels import get_kernel
from dtensor_ring.layouts import placement
from dtensor_ring.layouts.boundaries import Documents
from dtensor_ring.layouts.placement import placement_of, plan_row
from dtensor_ring.schedules.llama3 import _NaturalOrder
from dtensor_ring.tools.numerics import (NAMES, attention_and_grads, check_ratios, document_sdpa,
                                         make_inputs, ratios, rel_rms)
from dtensor_ring.sharding import rank_major_positions

EXACT_PER_DOCUMENT = 1.02
# The float64 references run on the CPU; the ring and the single-device kernel where this runs
# (on a GPU machine: PyTorch's flash varlen op, the Triton exact kernels, cuDNN/flash SDPA).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _on_device(fn):
    """``fn`` run on DEVICE, results back on the CPU (``attention_and_grads`` makes CPU leaves)."""
    def run(q, k, v, dout):
        got = attention_and_grads(fn, *(x.to(DEVICE) for x in (q, k, v)), dout.to(DEVICE),
                                  q.dtype)
        return [x.cpu() for x in got]
    return run


def _placed(lengths, world, length=None):
    """The boundaries of documents of ``lengths`` as ``dr.pad_documents(..., world_size=world)``
    orders and pads them (``placement.plan_row``)."""
    return [0, *itertools.accumulate(p for _, p in plan_row(lengths, world, length))]


def _mixes(world):
    """Document boundaries: 2W tokens each (whole, two per rank, or cut at W = 8, where 2W is
    half a rank's tokens), short documents only (each whole on one rank), long ones only (every
    one cut), one document of the whole row, a long one last (every document cut, as without the
    placement: each a multiple of 2W), a long-tailed mix of odd lengths as ``pad_documents``
    places it (cut, whole and padding documents), one long document and many tiny ones."""
    unit = 2 * world
    return {"one_chunk_each": list(range(0, 16 * unit + 1, unit)),
            "short": _placed([world + 1, world, world + 2, world] * 8, world),
            "spanning": [0, 6 * unit, 16 * unit],
            "whole_row": [0, 16 * unit],
            "mix": [0, unit, 3 * unit, 4 * unit, 10 * unit, 11 * unit, 16 * unit],
            "placed": _placed([16 * world, 3 * world + 1, 2 * world + 3, world + 5, world, 7, 5,
                               3, 4 * world, world + 3, 1, 2 * world + 1, 9, 6], world),
            "tiny": _placed([16 * world] + [3] * (5 * world), world)}


def _docs(layout, cu, world):
    seq = cu[-1]
    return documents(torch.tensor(cu), None, seq, dr.LAYOUTS[layout].document_multiple(world),
                     layout, torch.device("cpu"), world_size=world)


def _placement(layout, cu, world):
    return placement_of(_docs(layout, cu, world), world, cu[-1] // world)


# --- layouts -------------------------------------------------------------------------------------

def test_document_layouts_are_the_documented_ones():
    """Zigzag: chunks r and 2W-1-r of every document; stripe: tokens r, r+W, ... of every
    document; contiguous: the packed row in W parts."""
    zigzag = _docs("zigzag", [0, 8, 12], 2)
    assert dr.LAYOUTS["zigzag"].positions(6, 0, 2, zigzag).tolist() == [0, 1, 6, 7, 8, 11]
    assert dr.LAYOUTS["zigzag"].positions(6, 1, 2, zigzag).tolist() == [2, 3, 4, 5, 9, 10]
    stripe = _docs("stripe", [0, 4, 10], 2)
    assert dr.LAYOUTS["stripe"].positions(5, 0, 2, stripe).tolist() == [0, 2, 4, 6, 8]
    assert dr.LAYOUTS["stripe"].positions(5, 1, 2, stripe).tolist() == [1, 3, 5, 7, 9]
    contiguous = _docs("contiguous", [0, 3, 10], 2)
    assert dr.LAYOUTS["contiguous"].positions(5, 1, 2, contiguous).tolist() == [5, 6, 7, 8, 9]
    assert within_document(torch.tensor([0, 1, 6, 7, 8, 11]), zigzag.cu).tolist() == [
        0, 1, 6, 7, 0, 3]


def test_a_ring_step_with_no_shared_document_costs_no_kernel_call():
    """Contiguous layout, boundaries on the host: rank 1 holding rank 0's keys computes a block
    only if a document crosses from rank 0 to rank 1."""
    layout = dr.LAYOUTS["contiguous"]
    apart, crossing = _docs("contiguous", [0, 4, 8], 2), _docs("contiguous", [0, 6, 8], 2)
    assert layout.ring_blocks(4, 1, 0, 2, True, apart) == []
    assert len(layout.ring_blocks(4, 1, 0, 2, True, crossing)) == 1
    assert len(layout.ring_blocks(4, 1, 1, 2, True, apart)) == 1  # its own keys: always


@pytest.mark.parametrize("layout", sorted(dr.LAYOUTS))
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_every_position_is_held_once(layout, world):
    for cu in _mixes(world).values():
        positions = rank_major_positions(dr.LAYOUTS[layout], cu[-1], world,
                                         _docs(layout, cu, world))
        assert torch.equal(positions.sort().values, torch.arange(cu[-1])), (layout, world, cu)


def _causal_work(layout, cu, world):
    """Per rank: the (q, k) pairs its queries attend causally, from the layout's positions."""
    docs = _docs(layout, cu, world)
    work = []
    for rank in range(world):
        positions = dr.LAYOUTS[layout].positions(cu[-1] // world, rank, world, docs)
        work.append(int((within_document(positions, docs.cu) + 1).sum()))
    return work


def _random_mix(world, seed, shortest_per_rank):
    """Long-tailed document lengths (log-uniform), each a multiple of 2W, at least
    ``shortest_per_rank`` tokens per rank."""
    gen = torch.Generator().manual_seed(seed)
    unit, cu = 2 * world, [0]
    while cu[-1] < 4096 * world:
        length = int(2 ** (torch.rand((), generator=gen).item() * 8)) * shortest_per_rank * world
        cu.append(cu[-1] + max(unit, length // unit * unit))
    return cu


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_document_cut_balances_causal_work(world):
    """Rows whose short documents do not fill the ranks in row order (here: multiples of 2W,
    log-uniform lengths, a long one last) keep every document cut, as without the placement:
    zigzag (and llama3, which holds zigzag shards) then gives every rank the same causal work
    (chunk r and 2W-1-r of a document together see (2W-1) c^2 + c (c+1) pairs); stripe is within
    2% of the mean once documents hold at least ~50 tokens per rank (rank r of a document with c
    tokens per rank does c r more than rank 0). Contiguous (``ring``) is not balanced, with or
    without documents."""
    for seed in range(5):
        for name, cu in {"any": _random_mix(world, seed, 1), "mix": _mixes(world)["mix"],
                         "spanning": _mixes(world)["spanning"]}.items():
            if not all(_placement("zigzag", cu, world).cut):
                continue  # the short documents after the last long one happen to fit
            work = _causal_work("zigzag", cu, world)
            assert max(work) == min(work), (world, seed, name, work)
        cu = _random_mix(world, seed, 64)
        if all(_placement("stripe", cu, world).cut):
            work = _causal_work("stripe", cu, world)
            mean = sum(work) / world
            assert max(abs(w - mean) for w in work) <= 0.02 * mean, (world, seed, work)


def _realistic_mixes(world, tokens_per_rank):
    """Document lengths a long-context batch holds (``world`` x ``tokens_per_rank`` tokens), any
    lengths: long-tailed (log-uniform from 128 to half the row, as bench/per_rank.py's mix, and
    from 16 to 4096), short only (16 to 1000), 37-token documents and one long one, one document
    of the whole row, prime lengths."""
    seq, mixes = world * tokens_per_rank, {}

    def fill(name, draw):
        lengths = []
        while sum(lengths) < seq:
            lengths.append(min(draw(), seq - sum(lengths)))
        mixes[name] = lengths

    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)

        def log_uniform(lo, hi, gen=gen):
            return int(2 ** (math.log2(lo) + torch.rand((), generator=gen).item()
                             * math.log2(hi / lo)))
        fill(f"long_tailed_{seed}", lambda: log_uniform(128, seq // 2))
        fill(f"long_tailed_short_{seed}", lambda: log_uniform(16, 4096))
        fill(f"short_{seed}", lambda gen=gen: int(torch.randint(16, 1001, (), generator=gen)))
    mixes["tiny_and_one_long"] = [seq // 3] + [37] * ((seq - seq // 3) // 37)
    mixes["whole_row"] = [seq]
    primes = [p for p in range(2, 2000) if all(p % d for d in range(2, int(p ** 0.5) + 1))]
    mixes["primes"] = [primes[i % len(primes)] for i in range(0, 10_000, 7)]
    fill("primes", iter(mixes.pop("primes")).__next__)
    return mixes


def _off_balance(work):
    """The largest deviation of a rank's causal work from the mean, as a fraction of it."""
    mean = sum(work) / len(work)
    return max(abs(w - mean) for w in work) / mean


@pytest.fixture
def one_thread():
    # Host index arithmetic on a shared 2-core machine: intra-op threads only add contention
    # (torch.searchsorted over 8K positions took 9 ms with two threads, 0.2 ms with one).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_placement_balances_work_and_pads_little(world, one_thread):
    """The placement pad_documents makes (``layouts/placement.py``), for realistic mixes at 8K
    and 2K tokens per rank: every rank's causal work (its (q, k) pairs, counted from the
    layout's positions) within 3% of the mean, for zigzag (and llama3) and stripe; padding at
    most 5% of the row; and the short documents whole where there are many (the 37-token ones:
    today's rule, every document a multiple of 2W, pads that row by 11% at W = 8). The measure
    fails a layout off balance (contiguous), and the rule refuses (cuts every document of)
    short documents that fill the ranks unevenly."""
    for tokens in (8192, 2048):
        for name, lengths in _realistic_mixes(world, tokens).items():
            cu = _placed(lengths, world)
            padding = (cu[-1] - sum(lengths)) / cu[-1]
            where = f"W={world} {tokens} tokens per rank, {name}: {len(lengths)} documents"
            assert padding <= 0.05, f"{where}: padding {padding:.1%}"
            for layout in ("zigzag", "stripe"):
                off = _off_balance(_causal_work(layout, cu, world))
                assert off <= 0.03, f"{where}, {layout}: a rank's work {off:.1%} off the mean"
            if name == "tiny_and_one_long":
                whole = _placement("zigzag", cu, world).cut.count(False)
                assert whole >= len(lengths) - 1, f"{where}: only {whole} documents whole"
                today = dr.pad_documents(torch.zeros(1, sum(lengths)), _bounds(lengths),
                                         multiple=2 * world).cu_seqlens[-1].item()
                assert world < 8 or (today - sum(lengths)) / today > 0.10, today
    # The measure catches a rank off balance: the contiguous layout's causal rows
    cu = _placed(_realistic_mixes(world, 2048)["long_tailed_0"], world)
    assert _off_balance(_causal_work("contiguous", cu, world)) > 0.03
    # and the rule refuses short documents that fill the ranks exactly but not evenly: rank 0
    # the largest, the others one-token documents
    part = 2048
    big = placement.cut_length(world, part) - 1
    uneven = [big] * (part // big) + [1] * (world * part - big * (part // big))
    assert placement.cut_documents(torch.tensor(_bounds(uneven)), world, part).all()


def _bounds(lengths):
    return [0, *itertools.accumulate(lengths)]


# --- numerics against float64 ----------------------------------------------------------------------

SMALL_DOCUMENT = 16  # tokens: shorter documents are compared together (see _document_errors)


def _document_errors(got, single, reference, cu):
    """rel-RMS ratio to the single-device kernel, per tensor and per document; the documents of
    fewer than ``SMALL_DOCUMENT`` tokens as one group: an 8-token document's ratio rests on a
    few hundred values, and exact mode's ran to 1.07 on one of them for every schedule, ``ring``
    too (whose layout the placement does not change)."""
    spans = [(lo, hi) for lo, hi in zip(cu, cu[1:]) if hi - lo >= SMALL_DOCUMENT]
    small = [i for lo, hi in zip(cu, cu[1:]) if hi - lo < SMALL_DOCUMENT for i in range(lo, hi)]
    worst = {}
    for name, a, s, ref in zip(NAMES, got, single, reference):
        parts = [tuple(x[:, :, lo:hi] for x in (a, s, ref)) for lo, hi in spans]
        if small:
            index = torch.tensor(small)
            parts.append(tuple(x.index_select(2, index) for x in (a, s, ref)))
        worst[name] = max(rel_rms(x, r) / rel_rms(y, r) for x, y, r in parts)
    return worst


def _check_documents(schedule, world, cu, is_causal, precision, *, q_heads=4, kv_heads=2,
                     head_dim=16, seed=0):
    where = f"{schedule} W={world} causal={is_causal} {precision} cu={cu}"
    q, k, v, dout = make_inputs(1, q_heads, kv_heads, cu[-1], head_dim, seed)
    reference = attention_and_grads(document_sdpa(is_causal, cu), q, k, v, dout, torch.float64)
    bf16 = [x.bfloat16() for x in (q, k, v, dout)]
    single = _on_device(document_sdpa(is_causal, cu))(*bf16)
    got = _on_device(
        lambda a, b, c: dr.simulate_ring(a, b, c, world_size=world, schedule=schedule,
                                         is_causal=is_causal, precision=precision,
                                         cu_seqlens=torch.tensor(cu)))(*bf16)
    if precision == "exact":
        worst = _document_errors(got, single, reference, cu)
        assert max(worst.values()) <= EXACT_PER_DOCUMENT, f"{where}: {worst}"
    else:
        check_ratios(ratios(got, single, reference), torch.bfloat16, where)
    return got, reference, single


@pytest.mark.parametrize("schedule", sorted(dr.SCHEDULES))
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("precision", ["fp32", "exact"])
def test_every_schedule_attends_within_documents_at_8_ranks(schedule, is_causal, precision):
    for seed, cu in enumerate(_mixes(8).values()):
        _check_documents(schedule, 8, cu, is_causal, precision, seed=seed)


@pytest.mark.parametrize("schedule", sorted(dr.SCHEDULES))
def test_documents_at_64_simulated_ranks(schedule):
    """One long document cut across the 64 ranks, then two short ones whole on each rank."""
    cu = _bounds([512] + [5, 3] * 64)
    assert placement.cut_documents(torch.tensor(cu), 64, 16).sum() == 1
    for precision in ("fp32", "exact"):
        _check_documents(schedule, 64, cu, True, precision, q_heads=2, kv_heads=1)


def test_ignoring_or_misplacing_the_boundaries_fails():
    """The tolerances reject a ring that attends across documents, and boundaries one chunk off."""
    world, cu = 4, [0, 8, 48, 64]
    q, k, v, dout = make_inputs(1, 4, 2, cu[-1], 16)
    reference = attention_and_grads(document_sdpa(True, cu), q, k, v, dout, torch.float64)
    single = attention_and_grads(document_sdpa(True, cu), q, k, v, dout, torch.bfloat16)
    for wrong in (None, [0, 16, 48, 64]):
        got = attention_and_grads(
            lambda a, b, c: dr.simulate_ring(a, b, c, world_size=world, schedule="zigzag",
                                             is_causal=True, cu_seqlens=wrong), q, k, v, dout,
            torch.bfloat16)
        with pytest.raises(AssertionError, match="error ratio"):
            check_ratios(ratios(got, single, reference), torch.bfloat16)
        assert rel_rms(got[0], reference[0]) > 10 * rel_rms(single[0], reference[0])


def _traced_and_host(schedule, cu, world, is_causal, precision):
    """Each rank's out, dq, dk, dv (simulated ranks, fp32 inputs) with the boundaries' values on
    the host and as a traced graph has them (a tensor only: the placement's static-shape form)."""
    sched, seq = dr.get_schedule(schedule), cu[-1]
    q, k, v, dout = (x.float() for x in make_inputs(1, 4, 2, seq, 16))
    kernel = get_kernel("auto", q.device, q.dtype, 16, precision, True)
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    results = []
    for host in (cu, None):
        docs = Documents(torch.tensor(cu, dtype=torch.int32), longest, host)
        index = [sched.layout.positions(seq // world, r, world, docs) for r in range(world)]

        def rank(comm, docs=docs, index=index):
            q_, k_, v_, d_ = (x.index_select(2, index[comm.rank]) for x in (q, k, v, dout))
            options = dict(is_causal=is_causal, scale=0.25, kernel=kernel, docs=docs)
            out, lse = sched.forward(comm, q_, k_, v_, **options)
            return (out, *sched.backward(comm, d_, q_, k_, v_, out, lse, **options))
        results.append(SimWorld(world).run(rank))
    return results


@pytest.mark.parametrize("schedule", ["zigzag", "llama3", "stripe"])
def test_traced_placement_is_the_hosts(schedule):
    """The placement derived from the boundaries as a tensor (compiled or captured graphs:
    every block over all rows, the rows outside its documents attending nothing) gives the
    host's results, up to the order of the sums (other blocks: fp32 inputs, within 1e-5)."""
    cu = _mixes(4)["placed"]
    for is_causal in (True, False):
        for precision in ("fp32", "exact"):
            host, traced = _traced_and_host(schedule, cu, 4, is_causal, precision)
            for r, (a, b) in enumerate(zip(host, traced)):
                for name, x, y in zip(NAMES, a, b):
                    where = f"{schedule} causal={is_causal} {precision} rank {r} {name}"
                    torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=where)


def _every_block(schedule, cu, world, host):
    """Every block the schedule's ranks compute for ``cu``, values on the host or not."""
    layout = dr.LAYOUTS[dr.SCHEDULE_LAYOUT[schedule]]
    docs = Documents(torch.tensor(cu, dtype=torch.int32), cu[-1], cu if host else None)
    local = cu[-1] // world
    for causal in (True, False):
        for rank in range(world):
            if schedule == "llama3":
                plan = _NaturalOrder(rank, world, local, causal, docs)
                rows = plan.placement.exchanged_rows()
                yield from ((block, rows, world * rows) for block, _ in plan.blocks)
                if plan.local is not None:
                    yield plan.local, local, local
                continue
            rows = placement_of(docs, world, local).exchanged_rows()
            for src in range(world):
                for block in layout.ring_blocks(local, rank, src, world, causal, docs):
                    yield block, local, (local if src == rank else rows)


@pytest.mark.parametrize("schedule", ["zigzag", "llama3", "stripe"])
def test_segments_cover_their_blocks_within_their_bounds(schedule):
    """Every block's segments cover its rows and keys, in order, and none is longer than the
    block's bounds (``max_q`` / ``max_k``: PyTorch's flash varlen op reaches only that far into
    a segment, leaving the rest unwritten), values on the host or traced."""
    for name, cu in _mixes(4).items():
        for host in (True, False):
            for block, rows, keys in _every_block(schedule, cu, 4, host):
                seg, where = block.segments, f"{schedule} {name} host={host} {block}"
                assert seg.cu_q[0] == 0 and seg.cu_k[0] == 0, where
                assert seg.cu_q[-1] == block.q.stop - block.q.start <= rows, where
                assert seg.cu_k[-1] == block.k.stop - block.k.start <= keys, where
                q_lengths, k_lengths = seg.cu_q.diff(), seg.cu_k.diff()
                assert q_lengths.min() >= 0 and k_lengths.min() >= 0, where
                assert q_lengths.max() <= seg.max_q and k_lengths.max() <= seg.max_k, where


def test_max_seqlen_bounds_do_not_change_results():
    """``max_seqlen`` only sizes the varlen grids: a loose bound gives the same bits."""
    cu = _mixes(4)["mix"]
    q, k, v, dout = make_inputs(1, 4, 2, cu[-1], 16)
    results = [attention_and_grads(
        lambda a, b, c, m=m: dr.simulate_ring(a, b, c, world_size=4, is_causal=True,
                                              cu_seqlens=torch.tensor(cu), max_seqlen=m),
        q, k, v, dout, torch.bfloat16) for m in (None, 48, cu[-1])]
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


# --- real process groups -------------------------------------------------------------------------

GLOO_CASES = list(itertools.product(sorted(dr.SCHEDULES), (True, False),
                                    ((torch.float32, "fp32"), (torch.bfloat16, "fp32"),
                                     (torch.bfloat16, "exact"))))


# W = 4: one long document cut across the ranks, two short ones whole on each rank
GLOO_DOCUMENTS = _bounds([64, 10, 6, 6, 10, 4, 12, 8, 8])


def _documents_on_ranks(mesh):
    world, rank = mesh.size(), mesh.get_local_rank()
    cu = GLOO_DOCUMENTS
    cu_t = torch.tensor(cu)
    failures = []
    for i, (schedule, causal, (dtype, precision)) in enumerate(GLOO_CASES):
        where = f"rank {rank}/{world} {schedule} causal={causal} {dtype} {precision}"
        layout = dr.SCHEDULE_LAYOUT[schedule]
        q, k, v, dout = make_inputs(2, 4, 2, cu[-1], 16, seed=i)
        reference = attention_and_grads(document_sdpa(causal, cu), q, k, v, dout, torch.float64)
        single = attention_and_grads(document_sdpa(causal, cu), q, k, v, dout, dtype)

        def shard(x, layout=layout):
            return dr.shard_sequence(x, mesh, layout=layout, cu_seqlens=cu_t)

        def ring(a, b, c, schedule=schedule, causal=causal, precision=precision):
            return dr.ring_attention(a, b, c, mesh=mesh, schedule=schedule, is_causal=causal,
                                     precision=precision, cu_seqlens=cu_t)

        got = attention_and_grads(ring, *map(shard, (q, k, v, dout)), dtype)
        # Every rank checks the whole result (its shard's error alone is too few tokens to hold
        # fp32's tolerance: measured up to 1.27x per shard where the whole is <= 1.10x).
        whole = [dr.unshard_sequence(x, mesh, layout=layout, cu_seqlens=cu_t) for x in got]
        try:
            check_ratios(ratios(whole, single, reference), dtype, where)
            sim = attention_and_grads(
                lambda a, b, c, schedule=schedule, causal=causal, precision=precision:
                dr.simulate_ring(a, b, c, world_size=world, schedule=schedule, is_causal=causal,
                                 precision=precision, cu_seqlens=cu_t), q, k, v, dout, dtype)
            for name, a, b in zip(NAMES, got, sim):
                assert torch.equal(a, shard(b)), f"{where}: {name} differs from simulate_ring"
        except AssertionError as failure:
            failures.append(str(failure))
    for layout in sorted(dr.LAYOUTS):
        x = torch.randn(2, cu[-1], 3, generator=torch.Generator().manual_seed(7))
        local = dr.shard_sequence(x, mesh, dim=1, layout=layout, cu_seqlens=cu_t)
        back = dr.unshard_sequence(local, mesh, dim=1, layout=layout, cu_seqlens=cu_t)
        if not torch.equal(back, x):
            failures.append(f"rank {rank}: {layout} shard/unshard with documents is not identity")
        positions = dr.sequence_positions(cu[-1], mesh, layout=layout, cu_seqlens=cu_t)
        natural = dr.LAYOUTS[layout].positions(
            cu[-1] // world, rank, world, _docs(layout, cu, world))
        if not torch.equal(positions, within_document(natural, torch.tensor(cu))):
            failures.append(f"rank {rank}: {layout} positions are not within-document")
    failures += _bytes_sent(mesh, cu_t)
    assert not failures, "\n".join(failures)


def _bytes_sent(mesh, cu):
    """The bytes a rank hands the exchanges (``comm.TRAFFIC``, forward and backward) with the
    placement against the same call without documents: the long part's rows over all rows (the
    short documents' K/V travel nowhere); with every document short, nothing."""
    world, local = mesh.size(), cu[-1].item() // mesh.size()
    long_rows = _placement("zigzag", cu.tolist(), world).long_rows
    q, k, v, dout = (x[:, :, :local].float() for x in make_inputs(1, 4, 2, local, 16))
    failures = []
    for schedule in ("zigzag", "llama3", "stripe"):
        sent = []
        for boundaries in (cu, None):
            TRAFFIC.clear()
            q_, k_, v_ = (x.detach().requires_grad_() for x in (q, k, v))
            dr.ring_attention(q_, k_, v_, mesh=mesh, schedule=schedule, is_causal=True,
                              cu_seqlens=boundaries).backward(dout)
            sent.append(TRAFFIC["bytes"])
        if sent[0] * local != sent[1] * long_rows or not long_rows:
            failures.append(f"{schedule}: {sent[0]} bytes with documents, {sent[1]} without; "
                            f"expected {long_rows}/{local} of it")
    short = torch.tensor(_bounds([4] * (world * local // 4)))
    TRAFFIC.clear()
    dr.ring_attention(q, k, v, mesh=mesh, schedule="zigzag", is_causal=True, cu_seqlens=short)
    if TRAFFIC["bytes"]:
        failures.append(f"short documents only: {TRAFFIC['bytes']} bytes sent, expected none")
    return failures


def test_ring_attention_with_documents_on_4_gloo_ranks():
    run_on_ranks(4, _documents_on_ranks)



def test_auto_runs_zigzag_with_documents_whatever_the_head_counts():
    """auto with strong GQA takes llama3, but with packed documents zigzag (its ring sends only
    the long documents and computes a step in one varlen call; llama3's head groups multiply the
    calls: 0.22 / 0.30 of the varlen ideal per rank against 0.55 / 0.59). The consistency check
    resolves auto the same way, or the ranks would check one schedule and run another."""
    from dtensor_ring import consistency
    from dtensor_ring.schedules import AUTO, SCHEDULES
    q, k = torch.zeros(1, 8, 16, 4), torch.zeros(1, 2, 16, 4)
    cu = torch.tensor([0, 24, 64])
    docs = Documents.of(cu, 40)
    assert AUTO.pick(q, k, 4, True) is SCHEDULES["llama3"]
    assert AUTO.pick(q, k, 4, True, docs=docs) is SCHEDULES["zigzag"]
    fields = dict(schedule="auto", is_causal=True, precision="fp32", scale=0.5, world=4)
    assert "llama3" in consistency.signature(q, k, **fields)
    with_documents = consistency.signature(q, k, cu_seqlens=cu, **fields)
    assert "zigzag" in with_documents and "llama3" not in with_documents


def test_boundaries_are_checked_once_per_tensor_and_again_when_changed(monkeypatch):
    """A model's layers pass the same boundaries tensor: its values are read and checked at the
    first call only, and again when the tensor changes in place or comes with other arguments."""
    from dtensor_ring import documents as documents_module
    checks = []
    real = documents_module.check_boundaries
    monkeypatch.setattr(documents_module, "check_boundaries",
                        lambda values, *a, **kw: (checks.append(values), real(values, *a, **kw)))
    cu, cpu = torch.tensor([0, 8, 16]), torch.device("cpu")
    first = documents(cu, None, 16, 4, "zigzag", cpu, world_size=2)
    assert documents(cu, None, 16, 4, "zigzag", cpu, world_size=2) is first
    assert checks == [[0, 8, 16]]
    with pytest.raises(ValueError, match="must end at the sequence length 32"):
        documents(cu, None, 32, 4, "zigzag", cpu, world_size=2)
    cu[1] = 10  # in place: a new version of the tensor
    with pytest.raises(ValueError, match="document 0 of cu_seqlens has length 10"):
        documents(cu, None, 16, 4, "zigzag", cpu, world_size=2)
    cu[1] = 12
    again = documents(cu, None, 16, 4, "zigzag", cpu, world_size=2)
    assert again.host == [0, 12, 16] and again.max_len == 12
    assert checks == [[0, 8, 16], [0, 8, 16], [0, 10, 16], [0, 12, 16]]

# --- errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("cu,error,match", [
    ([1, 8, 16], ValueError, r"cu_seqlens must start at 0; got cu_seqlens\[0\]=1"),
    ([0, 8, 12], ValueError, r"must end at the sequence length 16; got cu_seqlens\[-1\]=12"),
    ([0, 8, 8, 16], ValueError, r"must increase: document 1 .* has length 0"),
    ([0, 10, 16], ValueError, r"document 0 of cu_seqlens has length 10, which layout 'zigzag' "
                              r"cannot split: every document it cuts across the ranks must have "
                              r"a length that is a multiple of 4 \(here every document up to "
                              r"the last one of at least 4 tokens is cut, and all of them unless "
                              r"the ones after it fill the 2 ranks in row order, each the same "
                              r"number of tokens, with balanced work\); pad the documents with "
                              r"dr.pad_documents\(..., world_size=2\)"),
    (torch.tensor([0.0, 8.0, 16.0]), TypeError, r"cu_seqlens must be an integer tensor; got "
                                                r"dtype torch.float32"),
    (torch.tensor([[0, 8, 16], [0, 4, 16]]), ValueError, r"cu_seqlens must be 1-D \(the same "
                                                         r"boundaries for every batch row\)"),
    ("0,8,16", TypeError, r"cu_seqlens must be a 1-D integer tensor"),
])
def test_bad_boundaries_are_named(cu, error, match):
    q, k, v, _ = make_inputs(1, 2, 2, 16, 8)
    with pytest.raises(error, match=match):
        dr.simulate_ring(q.float(), k.float(), v.float(), world_size=2, schedule="zigzag",
                         cu_seqlens=cu)


def test_bad_max_seqlen_is_named():
    q, k, v, _ = (x.float() for x in make_inputs(1, 2, 2, 16, 8))
    cu = torch.tensor([0, 4, 16])
    with pytest.raises(ValueError, match=r"max_seqlen=8 is below the longest document of "
                                         r"cu_seqlens \(12 tokens\)"):
        dr.simulate_ring(q, k, v, world_size=2, cu_seqlens=cu, max_seqlen=8)
    with pytest.raises(ValueError, match=r"max_seqlen=8 is given without cu_seqlens"):
        dr.simulate_ring(q, k, v, world_size=2, max_seqlen=8)
    with pytest.raises(ValueError, match=r"max_seqlen=0 must be a positive int"):
        dr.simulate_ring(q, k, v, world_size=2, cu_seqlens=cu, max_seqlen=0)


def test_a_backend_without_documents_is_refused():
    q, k, v, _ = (x.float() for x in make_inputs(1, 2, 2, 16, 8))
    with pytest.raises(ValueError, match=r"backend='efficient' cannot run on device=cpu"):
        dr.simulate_ring(q, k, v, world_size=2, cu_seqlens=[0, 4, 16], backend="efficient")


# --- the data pipeline's helper ------------------------------------------------------------------

def test_pad_documents_pads_each_document_to_the_layout_multiple():
    ids = torch.arange(1, 11).view(1, 10)  # documents of 3, 5 and 2 tokens
    labels = ids + 100
    padded = dr.pad_documents(ids, [0, 3, 8, 10], multiple=dr.document_multiple("zigzag", 2),
                              labels=labels, pad_id=0)
    assert padded.cu_seqlens.tolist() == [0, 4, 12, 16]
    assert padded.input_ids.tolist() == [[1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0, 9, 10, 0, 0]]
    assert padded.labels.tolist() == [[101, 102, 103, -100, 104, 105, 106, 107, 108, -100, -100,
                                       -100, 109, 110, -100, -100]]
    assert padded.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]
    # ring takes documents of any length, but its row must split into W equal parts: padding
    # every document to W is a rule pad_documents can meet
    assert [dr.document_multiple(s, 4) for s in ("zigzag", "llama3", "auto", "stripe", "ring")] == (
        [8, 8, 8, 4, 4])
    with pytest.raises(ValueError, match=r"multiple=0 must be a positive int"):
        dr.pad_documents(ids, [0, 10], multiple=0)


def test_pad_documents_places_the_documents_for_the_ranks():
    """``world_size=W``: the documents reordered (those to cut first) and padded so that the
    short ones stay whole on the ranks; every input token once, in order within its document;
    padding tokens ``pad_id`` with labels -100; positions within each document; ``source`` says
    where each token came from; ``length`` fixes the row's length."""
    lengths = [64, 10, 7, 13, 9, 5, 11, 3, 8]
    cu = _bounds(lengths)
    ids = torch.arange(1, cu[-1] + 1).view(1, -1)
    for length in (None, 160):
        padded = dr.pad_documents(ids, cu, world_size=4, length=length, labels=ids + 1000,
                                  pad_id=-1)
        new, source = padded.cu_seqlens.tolist(), padded.source
        assert length is None or new[-1] == length
        real = source >= 0
        assert sorted(source[real].tolist()) == list(range(cu[-1]))
        assert torch.equal(padded.input_ids[0, real], ids[0, source[real]])
        assert torch.equal(padded.labels[0, real], ids[0, source[real]] + 1000)
        assert (padded.input_ids[0, ~real] == -1).all() and (padded.labels[0, ~real] == -100).all()
        assert torch.equal(padded.position_ids[0], within_document(torch.arange(new[-1]),
                                                                   padded.cu_seqlens))
        for lo, hi in zip(new, new[1:]):  # a document's tokens in order, then its padding
            taken = source[lo:hi][source[lo:hi] >= 0]
            assert not len(taken) or torch.equal(taken, torch.arange(taken[0],
                                                                     taken[0] + len(taken)))
        cut = _placement("zigzag", new, 4).cut
        assert cut.count(True) == 1 and new[1] == 64  # the long document first, the others whole
        assert (new[-1] - cu[-1]) / new[-1] <= 0.05 or length is not None


def test_documents_up_to_half_a_ranks_tokens_stay_whole():
    """The cut length is half a rank's tokens: documents of 1000 to 2000 tokens at ~8K tokens per
    rank (chunks of 125 rows or more if cut: the kernels would lose little) stay whole, so their
    K/V travel nowhere; the long one is cut. A document of half a rank's tokens is cut."""
    world = 4
    lengths = [9728, 2000, 1900, 1800, 1700, 1600, 1500, 1400, 1300, 1200, 1100, 1000]
    row = plan_row(lengths + [500] * 12, world)
    cu = [0, *itertools.accumulate(p for _, p in row)]
    local = cu[-1] // world
    assert 8000 <= local <= 8192
    cut = dict(zip((d for d, _ in row), _placement("zigzag", cu, world).cut))
    assert cut[0] and not any(cut[d] for d in range(1, len(lengths)))
    half = placement.cut_length(world, local)
    assert half == local // 2 // (2 * world) * 2 * world
    assert placement.cut_documents(torch.tensor([0, half, 2 * half]), world, local).all()


@pytest.mark.parametrize("kwargs,match", [
    (dict(), r"pass one of world_size \(the ranks that will hold the row\) and multiple; got "
             r"world_size=None, multiple=None"),
    (dict(world_size=2, multiple=4), r"pass one of world_size .* got world_size=2, multiple=4"),
    (dict(world_size=2, length=30), r"length=30 must be a multiple of 2 \* world_size = 4"),
    (dict(world_size=2, length=8), r"length=8 is too short to place these documents on 2 ranks"),
    (dict(multiple=4, length=32), r"length=32 goes with world_size, not multiple"),
    (dict(world_size=0), r"world_size=0 must be a positive int"),
])
def test_pad_documents_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dr.pad_documents(torch.zeros(1, 20), [0, 10, 20], **kwargs)
