"""Packed documents in a model: ``ContextParallel`` (eager and compiled) and the Hugging Face
adapter, on 4 gloo ranks, against the same model on one process with a block-diagonal causal mask.

The batch is packed as Hugging Face's ``DataCollatorWithFlattening`` packs it: one row, documents
back to back, ``position_ids`` restarting at 0 at each document (or, for ``ContextParallel``, an
explicit ``cu_seqlens=`` keyword instead). The one-process reference runs the unsharded model with
each SDPA call masked block-diagonally (attention within each document, causal), in float64 for
the tolerance and in fp32 as the model itself. Tolerance (as in test_context_parallel.py): fp32
rel-RMS <= 1e-5 for the loss and every parameter's gradient. The labels hold -100 runs (a masked
prompt, a masked span) that fall unevenly on the ranks in every layout, so the loss must be the
mean over the whole batch's valid labels, not a mean of per-rank means. Wrong answers must miss the
tolerance by 100x: the style told to ignore documents (``documents=False``: attention across
documents), and the same model with a per-rank mean (a forward without ``num_items_in_batch``).
Under ``torch.compile`` a new batch with other boundaries must not recompile (Dynamo's counters).
Every rank asserts.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.parallel import parallelize_module
from torch.overrides import TorchFunctionMode

import dtensor_ring as dr
from dist_utils import run_on_ranks
from dtensor_ring.dtensor import sync_gradients
from dtensor_ring.models import Llama, LlamaConfig
from dtensor_ring.tools.numerics import rel_rms

FP32_LIMIT = 1e-5
WRONG_FACTOR = 100
SEQ = 128


class BlockDiagonalSdpa(TorchFunctionMode):
    """One process: SDPA restricted to each document (causal within it)."""

    def __init__(self, cu_seqlens):
        super().__init__()
        ids = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1),
                                      torch.tensor(cu_seqlens).diff())
        self.same = ids[:, None] == ids[None, :]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention:
            causal = kwargs.pop("is_causal", False)
            seq = args[0].shape[2]
            mask = self.same & torch.ones(seq, seq, dtype=torch.bool).tril() if causal else (
                self.same)
            return func(*args, attn_mask=mask.to(args[0].device), **kwargs)
        return func(*args, **kwargs)


def _positions(cu):
    return torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])]).unsqueeze(0)


def _batch(seed, vocab):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, SEQ), generator=gen)
    labels = torch.randint(0, vocab, (1, SEQ), generator=gen)
    labels[:, :24] = -100    # a masked prompt: its tokens sit on some ranks more than others
    labels[:, 90:97] = -100  # a masked span in the middle
    return ids, labels


class PerRankMean(Llama):
    """The Llama with the loss a model gets without ``num_items_in_batch``: each rank's mean over
    its own valid labels (the mistake the test data must catch)."""

    def forward(self, input_ids, position_ids=None, labels=None):
        return super().forward(input_ids, position_ids, labels)


def _grads(model):
    return {n: p.grad.double() for n, p in model.named_parameters()}


def _single(model, cu, ids, labels):
    model.zero_grad()
    with BlockDiagonalSdpa(cu):
        loss = model(ids, position_ids=_positions(cu).to(ids.device), labels=labels).loss
    loss.backward()
    return loss.detach().double(), _grads(model)


def _sharded(model, mesh, ids, labels, module=None, **inputs):
    """Mean of the ranks' losses and cp-averaged gradients; ``module``: the one that holds the
    parameters (``model``, or what ``torch.compile`` wrapped)."""
    module = module or model
    module.zero_grad()
    loss = model(ids, labels=labels, **inputs).loss
    loss.backward()
    sync_gradients(module, mesh)
    total = loss.detach().double()
    dist.all_reduce(total, group=mesh.get_group())
    return total / mesh.size(), _grads(module)


def _error(result, reference):
    per_param = {n: rel_rms(result[1][n], g) for n, g in reference[1].items()}
    return max(rel_rms(result[0], reference[0]), max(per_param.values()))


# Documents of 16, 48, 8, 40 and 16 tokens (multiples of 2W = 8), every one cut across the
# ranks (a long one comes last: layouts/placement.py); then one of 64 tokens cut and eight short
# ones whole, two on each rank (as dr.pad_documents(..., world_size=4) places them).
PLACED = [0, 64, 74, 80, 86, 96, 100, 112, 120, 128]
BOUNDARIES = ([0, 16, 64, 72, 112, 128], PLACED)


def _style(mesh, failures, label):
    torch.manual_seed(0)
    base = Llama(LlamaConfig())
    for schedule in sorted(dr.SCHEDULES):
        for b, cu in enumerate(BOUNDARIES):
            where = f"{label} {schedule} cu={cu}"
            ids, labels = _batch(b, base.cfg.vocab_size)
            reference = _single(copy.deepcopy(base).double(), cu, ids, labels)
            model = parallelize_module(copy.deepcopy(base), mesh, dr.ContextParallel(schedule))
            by_positions = _sharded(model, mesh, ids, labels, position_ids=_positions(cu))
            by_boundaries = _sharded(model, mesh, ids, labels, cu_seqlens=torch.tensor(cu))
            for how, result in (("position_ids", by_positions), ("cu_seqlens", by_boundaries)):
                if not _error(result, reference) <= FP32_LIMIT:
                    failures.append(f"{where} ({how}): {_error(result, reference):.2e}")
            across = parallelize_module(copy.deepcopy(base), mesh,
                                        dr.ContextParallel(schedule, documents=False))
            wrong = _error(_sharded(across, mesh, ids, labels, position_ids=_positions(cu)),
                           reference)
            if not wrong > WRONG_FACTOR * FP32_LIMIT:
                failures.append(f"{where}: attention across documents passed ({wrong:.2e})")
            per_rank = PerRankMean(base.cfg)
            per_rank.load_state_dict(base.state_dict())
            per_rank = parallelize_module(per_rank, mesh, dr.ContextParallel(schedule))
            wrong = _error(_sharded(per_rank, mesh, ids, labels, cu_seqlens=torch.tensor(cu)),
                           reference)
            if not wrong > WRONG_FACTOR * FP32_LIMIT:
                failures.append(f"{where}: a mean of per-rank means passed ({wrong:.2e})")


def _compiled(mesh, failures, label):
    """The style under torch.compile, trained for a few steps on batches with other boundaries:
    every step matches the one-process model, and after the first step nothing is compiled
    again (Dynamo's count of graphs)."""
    from torch._dynamo.utils import counters  # noqa: PLC0415

    torch.manual_seed(0)
    base = Llama(LlamaConfig())
    single = copy.deepcopy(base)
    module = parallelize_module(copy.deepcopy(base), mesh, dr.ContextParallel("zigzag"))
    model = torch.compile(module)
    opt_single = torch.optim.AdamW(single.parameters(), lr=3e-3)
    opt_model = torch.optim.AdamW(module.parameters(), lr=3e-3)
    # Other boundaries and counts of documents, the longest one's bucket (a power of two,
    # packed.py) the same: 64; the second places eight short documents whole.
    steps = [[0, 16, 64, 72, 112, 128], PLACED, [0, 8, 16, 72, 128]]
    for step, cu in enumerate(steps):
        ids, labels = _batch(step, base.cfg.vocab_size)
        if step == 1:
            graphs_before = counters["stats"]["unique_graphs"]
        reference = _single(single, cu, ids, labels)
        result = _sharded(model, mesh, ids, labels, module, position_ids=_positions(cu))
        if not _error(result, reference) <= FP32_LIMIT:
            failures.append(f"{label} compiled step {step} cu={cu}: "
                            f"{_error(result, reference):.2e}")
        opt_single.step()
        opt_model.step()
    recompiles = counters["stats"]["unique_graphs"] - graphs_before
    if recompiles:
        failures.append(f"{label} compiled: {recompiles} graphs compiled again for new "
                        "boundaries")


def _padded(mesh, failures, label):
    """Documents of any lengths (37, 70, 21), padded by ``dr.pad_documents`` to
    ``dr.document_multiple(schedule, W)`` with -100 labels on the padding: a row every schedule
    takes (ring's too: the row must split into W parts), equal to the one-process model."""
    torch.manual_seed(0)
    base = Llama(LlamaConfig())
    cu = torch.tensor([0, 37, 107, 128])
    ids, labels = _batch(4, base.cfg.vocab_size)
    for schedule in sorted(dr.SCHEDULES):
        batch = dr.pad_documents(ids, cu, labels=labels,
                                 multiple=dr.document_multiple(schedule, mesh.size()))
        padded_cu = batch.cu_seqlens.tolist()
        reference = _single(copy.deepcopy(base).double(), padded_cu, batch.input_ids,
                            batch.labels)
        model = parallelize_module(copy.deepcopy(base), mesh, dr.ContextParallel(schedule))
        result = _sharded(model, mesh, batch.input_ids, batch.labels,
                          cu_seqlens=batch.cu_seqlens)
        if not _error(result, reference) <= FP32_LIMIT:
            failures.append(f"{label} {schedule} padded documents {padded_cu}: "
                            f"{_error(result, reference):.2e}")


def _mid_document(mesh, failures, label):
    """Position ids that do not start at 0 -- a row that starts inside a document (100, 101,
    ...), then documents restarting at 0 -- split where the positions jump, as transformers
    splits them; the positions are the model's as given. A row counting up by one from 100
    throughout is one document: plain causal attention at those positions."""
    torch.manual_seed(0)
    base = Llama(LlamaConfig())
    ids, labels = _batch(5, base.cfg.vocab_size)
    cu = BOUNDARIES[0]
    jumping = _positions(cu)
    jumping[0, :cu[1]] += 100
    for positions, documents in ((jumping, cu), (torch.arange(100, 100 + SEQ)[None], [0, SEQ])):
        single = copy.deepcopy(base).double()
        with BlockDiagonalSdpa(documents):
            loss = single(ids, position_ids=positions, labels=labels).loss
        loss.backward()
        reference = loss.detach(), _grads(single)
        model = parallelize_module(copy.deepcopy(base), mesh, dr.ContextParallel("zigzag"))
        result = _sharded(model, mesh, ids, labels, position_ids=positions)
        if not _error(result, reference) <= FP32_LIMIT:
            failures.append(f"{label} position_ids from {positions[0, :3].tolist()}, "
                            f"documents {documents}: {_error(result, reference):.2e}")


def _four_ranks(mesh):
    failures = []
    label = f"rank {mesh.get_local_rank()}/{mesh.size()}"
    _style(mesh, failures, label)
    _padded(mesh, failures, label)
    _mid_document(mesh, failures, label)
    _compiled(mesh, failures, label)
    assert not failures, "\n".join(failures)


def test_context_parallel_trains_on_packed_documents():
    run_on_ranks(4, _four_ranks)


def _style_errors(mesh):
    model = parallelize_module(Llama(LlamaConfig()), mesh, dr.ContextParallel("zigzag"))
    ids, labels = _batch(0, 512)
    too_short = (r"has length 10, which layout 'zigzag' cannot split: every document it cuts "
                 r"across the ranks must have a length that is a multiple of 4")
    cases = [  # each error names the argument the documents came from
        (dict(position_ids=_positions([0, 10, 128])), r"document 0 of position_ids " + too_short),
        (dict(cu_seqlens=torch.tensor([0, 10, 128])), r"document 0 of cu_seqlens " + too_short),
        (dict(cu_seq_lens_q=torch.tensor([0, 10, 128]), cu_seq_lens_k=torch.tensor([0, 10, 128]),
              max_length_q=118, max_length_k=118), r"document 0 of cu_seq_lens_q " + too_short),
        (dict(cu_seq_lens_q=torch.tensor([0, 64, 128]), cu_seq_lens_k=torch.tensor([0, 32, 128])),
         r"cu_seq_lens_k differs from cu_seq_lens_q \(\[0, 32, 128\] vs \[0, 64, 128\]\); "
         r"context parallelism runs self-attention"),
        (dict(position_ids=torch.cat([_positions([0, 64, 128]), _positions([0, 32, 128])])),
         r"position_ids of batch row 1 pack documents differently from row 0"),
        (dict(cu_seqlens=torch.tensor([0, 64, 120])), r"must end at the sequence length 128"),
    ]
    for inputs, match in cases:
        batch = ids.expand(inputs.get("position_ids", ids).shape[0], -1)
        with pytest.raises(ValueError, match=match):
            model(batch, **inputs)


def test_context_parallel_document_errors():
    run_on_ranks(2, _style_errors)
