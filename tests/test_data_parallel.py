"""Data parallel x context parallel on 4 gloo ranks, a (dp=2, cp=2) mesh: ``ContextParallel`` on
``mesh["cp"]`` and the gradients averaged over all four ranks by FSDP2 (``fully_shard`` on the
flattened dp x cp mesh, per block and at the root) or DDP, eagerly and with each block compiled
(inductor) and checkpointed selectively (``dr.save_ring_attention_context``).

Each dp group trains on its own half of the global batch and each cp rank holds its own tokens of
it. The labels hold -100 runs that give the four ranks different counts of valid labels, so the
loss is the mean over the whole global batch's valid labels only if every rank divides its sum by
that count / 4 (torchtitan's normalisation): the models are given ``num_items_in_batch`` = the
global count / dp (what one would pass to DDP without context parallelism; ``ContextParallel``
divides it by cp), or the loss is computed outside the model with ``dr.global_mean_loss`` over the
dp x cp mesh. Averaging gradients over dp x cp then gives the whole batch's. Reference: the model
on one process on the global batch, in float64; tolerance as in ``test_context_parallel.py``,
rel-RMS <= 1e-5 for the loss and every parameter's gradient (fp32 on one process is ~1e-7 from
float64). Realistic mistakes must miss it by 100x: DDP over the dp dimension only (the gradients
are then the cp rank's own tokens'), and each rank's loss the mean over its own valid labels.
``sync_gradients`` (buckets of fp32 gradients, one all-reduce each)
gives the same averaged gradients over cp as a single ``all_reduce`` per parameter. The test
model is ``tests/rope_model.py`` (written for the tests, not by the package) and the repository's
Llama. A rank with another schedule on the cp dimension raises a ValueError naming group and
global ranks. Every rank asserts.
"""
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

import dtensor_ring as dr
from dtensor_ring import dtensor as drt
from dtensor_ring.models import Llama, LlamaConfig
from dtensor_ring.tools.numerics import rel_rms
from dist_utils import run_on_ranks
from dtensor_helpers import CollectiveLog, expect_error
from rope_model import RopeTransformer

FP32_LIMIT = 1e-5
WRONG_FACTOR = 100
BATCH, SEQ = 2, 32  # per dp group: the global batch has 2 * BATCH sequences


def _seeded(make):
    torch.manual_seed(0)
    return make()


def _global_batch(vocab, dp):
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (dp * BATCH, SEQ), generator=gen)
    labels = torch.randint(0, vocab, (dp * BATCH, SEQ), generator=gen)
    labels[0, :11] = -100   # a masked prompt, mostly on cp rank 0 (zigzag and stripe alike)
    labels[1, 20:32] = -100  # a masked tail
    labels[-1, 5:9] = -100  # the other dp group: fewer
    return ids, labels


def _loss(output):
    return output.loss if hasattr(output, "loss") else output[1]


def _logits(output):
    return output.logits if hasattr(output, "logits") else output[0]


def _rank_loss(how, mesh, dp_cp, schedule, count):
    """``rank_loss(model, ids, labels)``: this rank's loss on its dp group's batch, normalised
    as ``how`` says: "model" (the model's own loss, given the global batch's ``count`` / dp as
    DDP without context parallelism would be), "global_mean_loss" (``dr.global_mean_loss`` over
    dp x cp on the local logits) or "per-rank mean" (the mistake: the mean over this rank's own
    valid labels)."""
    def rank_loss(model, ids, labels):
        if how == "model":
            return _loss(model(ids, labels=labels, num_items_in_batch=count / mesh.size(0)))
        logits = _logits(model(ids))
        mine = dr.shard_sequence(labels, mesh["cp"], dim=1, layout=dr.SCHEDULE_LAYOUT[schedule])
        total = F.cross_entropy(logits.flatten(0, 1).float(), mine.flatten(), reduction="sum")
        if how == "global_mean_loss":
            return dr.global_mean_loss(total, (mine != -100).sum(), dp_cp)
        return total / (mine != -100).sum()
    return rank_loss


def _blocks(model):
    return model.layers if isinstance(model, Llama) else model.blocks


def _reference(base, ids, labels):
    model = copy.deepcopy(base).double()
    loss = _loss(model(ids, labels=labels))
    loss.backward()
    return loss.detach(), {n: p.grad.detach() for n, p in model.named_parameters()}


def _step(model, ids, labels, world_group, rank_loss):
    """One forward/backward on this dp group's batch; the global loss (mean over all ranks) and
    every parameter's full gradient, by name."""
    loss = rank_loss(model, ids, labels)
    loss.backward()
    total = loss.detach().double().clone()
    dist.all_reduce(total, group=world_group)
    grads = {}
    for name, p in model.named_parameters():
        grads[_plain_name(name)] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
    return total / dist.get_world_size(world_group), grads


def _plain_name(name):
    """The parameter's name in the unwrapped model (without DDP's, compile's, checkpoint's)."""
    name = name[len("module."):] if name.startswith("module.") else name
    for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def _prepare(base, mesh, dp_cp, schedule, how, compiled):
    model = parallelize_module(copy.deepcopy(base), mesh["cp"], dr.ContextParallel(schedule))
    blocks = _blocks(model)
    if compiled:
        for i, block in enumerate(list(blocks)):
            blocks[i] = torch.compile(checkpoint_wrapper(
                block, context_fn=dr.save_ring_attention_context), fullgraph=True)
    if how == "fsdp2":
        for block in blocks:
            fully_shard(block, mesh=dp_cp)
        return fully_shard(model, mesh=dp_cp)
    group = mesh.get_group("dp") if how == "ddp over dp only" else dist.group.WORLD
    return DDP(model, process_group=group)


def _case(mesh, dp_cp, failures, where, make, schedule, how, compiled=False, wrong=False,
          loss="model"):
    base = _seeded(make)
    vocab = base.cfg.vocab_size if isinstance(base, Llama) else base.vocab
    ids, labels = _global_batch(vocab, mesh.size(0))
    ref_loss, ref_grads = _reference(base, ids, labels)
    names = list(ref_grads)
    mine = slice(mesh.get_local_rank("dp") * BATCH, (mesh.get_local_rank("dp") + 1) * BATCH)
    model = _prepare(base, mesh, dp_cp, schedule, how, compiled)
    rank_loss = _rank_loss(loss, mesh, dp_cp, schedule, (labels != -100).sum())
    loss, grads = _step(model, ids[mine], labels[mine], dist.group.WORLD, rank_loss)
    per_param = {n: rel_rms(grads[n], ref_grads[n]) for n in names}
    worst = max(per_param, key=per_param.get)
    error = max(rel_rms(loss, ref_loss), per_param[worst])
    if wrong:
        if not error > WRONG_FACTOR * FP32_LIMIT:
            failures.append(f"{where}: a wrong setup passed ({error:.2e})")
    elif not error <= FP32_LIMIT:
        failures.append(f"{where}: loss {rel_rms(loss, ref_loss):.2e}, worst gradient {worst} "
                        f"{per_param[worst]:.2e} > {FP32_LIMIT}")


def _sync_gradients(mesh, failures, where):
    """Buckets of 1 MiB: the Llama's 1M fp32 gradients (4 MiB) in more than one all-reduce, fewer
    than one per parameter; the same averages as an all_reduce per parameter."""
    model = parallelize_module(_seeded(Llama), mesh["cp"], dr.ContextParallel("zigzag"))
    ids, labels = _global_batch(model.cfg.vocab_size, 1)
    model(ids, labels=labels).loss.backward()
    expected = []
    for p in model.parameters():
        total = p.grad.clone()
        dist.all_reduce(total, group=mesh.get_group("cp"))
        expected.append(total / mesh.size(1))
    with CollectiveLog() as log:
        drt.sync_gradients(model, mesh["cp"], bucket_mb=1)
    calls = log.names().count("allreduce_")
    n_params = len(expected)
    if not 1 < calls < n_params:
        failures.append(f"{where} sync_gradients: {calls} all-reduces for {n_params} parameters")
    worst = max(rel_rms(p.grad, e) for p, e in zip(model.parameters(), expected))
    if not worst <= 1e-7:
        failures.append(f"{where} sync_gradients: differs from per-parameter all_reduce {worst}")
    expect_error(failures, f"{where} sync_gradients bucket_mb=0", ValueError,
                 lambda: drt.sync_gradients(model, mesh["cp"], bucket_mb=0), "bucket_mb=0")


def _schedules_differ(mesh, failures, where):
    """The cp groups of the 2-D mesh (global ranks 0, 1 and 2, 3): group ranks named, and the
    global ones where they differ."""
    cp_rank, dp_rank = mesh.get_local_rank("cp"), mesh.get_local_rank("dp")
    q = torch.randn(1, 2, 8 + 4 * dp_rank, 8)
    fragments = ["'zigzag' on rank 0", "'stripe' on rank 1"]
    if dp_rank == 1:
        fragments = ["'zigzag' on rank 0 (global 2)", "'stripe' on rank 1 (global 3)"]
    expect_error(failures, f"{where} schedules differ on cp", ValueError,
                 lambda: dr.ring_attention(q, q, q, mesh=mesh["cp"], is_causal=True,
                                           schedule="stripe" if cp_rank else "zigzag"),
                 *fragments)


def _four_ranks(mesh):
    rank, failures = dist.get_rank(), []
    where = f"rank {rank} (dp {mesh.get_local_rank('dp')}, cp {mesh.get_local_rank('cp')})"
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp")  # FSDP2 and DDP average over all four ranks
    rope, llama = RopeTransformer, lambda: Llama(LlamaConfig())
    cases = [("fsdp2", rope, "zigzag", "model"), ("fsdp2", llama, "llama3", "global_mean_loss"),
             ("ddp", rope, "stripe", "model")]
    for how, make, schedule, loss in cases:
        _case(mesh, dp_cp, failures, f"{where} {how} {make.__name__} {schedule} {loss}", make,
              schedule, how, loss=loss)
    _case(mesh, dp_cp, failures, f"{where} DDP over dp only", rope, "zigzag", "ddp over dp only",
          wrong=True)
    _case(mesh, dp_cp, failures, f"{where} per-rank mean", llama, "zigzag", "fsdp2", wrong=True,
          loss="per-rank mean")
    _sync_gradients(mesh, failures, where)
    _schedules_differ(mesh, failures, where)
    # Compiled per block, checkpointed selectively: the same block graph for FSDP2 and DDP.
    for how in ("fsdp2", "ddp"):
        _case(mesh, dp_cp, failures, f"{where} {how} compiled", rope, "zigzag", how,
              compiled=True)
    assert not failures, "\n".join(failures)


def test_fsdp2_and_ddp_over_data_and_context_match_one_process():
    run_on_ranks(4, _four_ranks, mesh_shape=(2, 2), mesh_dim_names=("dp", "cp"))
