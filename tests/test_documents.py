"""Packed documents (``cu_seqlens``): the per-document layouts, every schedule against a float64
reference of each document's own attention, and the errors for bad boundaries.

The reference is the single-device kernel run on each document alone (a block-diagonal mask), in
float64; tolerances as everywhere (``dtensor_ring/numerics.py``: fp32 mode <= 1.25x the
single-device kernel's rel-RMS in bf16), and exact mode <= 1.02x it *per document*. A ring that
ignores the boundaries, or boundaries one chunk off, must fail them.
"""
import itertools

import pytest
import torch

import dtensor_ring as dr
from dist_utils import run_on_ranks
from dtensor_ring.documents import documents, within_document
from dtensor_ring.numerics import (NAMES, attention_and_grads, check_ratios, document_sdpa,
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


def _mixes(world):
    """Document boundaries (multiples of 2W): one chunk per rank each, long documents spanning
    every rank, and a mix of both."""
    unit = 2 * world
    return {"one_chunk_each": list(range(0, 16 * unit + 1, unit)),
            "spanning": [0, 6 * unit, 16 * unit],
            "mix": [0, unit, 3 * unit, 4 * unit, 10 * unit, 11 * unit, 16 * unit]}


def _docs(layout, cu, world):
    seq = cu[-1]
    return documents(torch.tensor(cu), None, seq, dr.LAYOUTS[layout].document_multiple(world),
                     layout, torch.device("cpu"))


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
def test_zigzag_and_stripe_balance_causal_work_per_document(world):
    """Zigzag (and llama3, which holds zigzag shards) gives every rank the same causal work for
    any document mix (chunk r and 2W-1-r of a document together see (2W-1) c^2 + c (c+1) pairs);
    stripe is within 2% of the mean once documents hold at least ~50 tokens per rank (rank r of a
    document with c tokens per rank does c r more than rank 0). Contiguous (``ring``) is not
    balanced, with or without documents."""
    for seed in range(5):
        for name, cu in {"any": _random_mix(world, seed, 1),
                         **_mixes(world)}.items():
            work = _causal_work("zigzag", cu, world)
            assert max(work) == min(work), (world, seed, name, work)
        cu = _random_mix(world, seed, 64)
        work = _causal_work("stripe", cu, world)
        mean = sum(work) / world
        assert max(abs(w - mean) for w in work) <= 0.02 * mean, (world, seed, work)


# --- numerics against float64 ----------------------------------------------------------------------

def _document_errors(got, single, reference, cu):
    """rel-RMS ratio to the single-device kernel, per tensor and per document."""
    worst = {}
    for name, a, s, ref in zip(NAMES, got, single, reference):
        worst[name] = max(rel_rms(a[:, :, lo:hi], ref[:, :, lo:hi]) /
                          rel_rms(s[:, :, lo:hi], ref[:, :, lo:hi])
                          for lo, hi in zip(cu, cu[1:]))
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
    cu = [0, 128, 512, 640, 768]
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


def _documents_on_ranks(mesh):
    world, rank = mesh.size(), mesh.get_local_rank()
    cu = [0, 8 * world, 10 * world, 16 * world]
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
    assert not failures, "\n".join(failures)


def test_ring_attention_with_documents_on_4_gloo_ranks():
    run_on_ranks(4, _documents_on_ranks)


# --- errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("cu,error,match", [
    ([1, 8, 16], ValueError, r"cu_seqlens must start at 0; got cu_seqlens\[0\]=1"),
    ([0, 8, 12], ValueError, r"must end at the sequence length 16; got cu_seqlens\[-1\]=12"),
    ([0, 8, 8, 16], ValueError, r"must increase: document 1 .* has length 0"),
    ([0, 10, 16], ValueError, r"document 0 of cu_seqlens has length 10, which layout 'zigzag' "
                              r"cannot split: every document it cuts across the ranks must have "
                              r"a length that is a multiple of 4 \(here every document up to "
                              r"the last one of at least 8 tokens is cut, and all of them unless "
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
    assert dr.document_multiple("stripe", 4) == 4 and dr.document_multiple("ring", 4) == 1
    with pytest.raises(ValueError, match=r"multiple=0 must be a positive int"):
        dr.pad_documents(ids, [0, 10], multiple=0)
