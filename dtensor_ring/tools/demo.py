"""The demo job: train the repository's small Llama with context parallelism (and data parallelism)
and check it against the same model trained on one process.

``python -m dtensor_ring demo`` launches N processes through PyTorch's elastic launcher (gloo on
CPU, NCCL with one GPU each on ``--device cuda``) as a (dp, cp) mesh: ``--dp`` data-parallel groups
of N / dp context-parallel ranks (default dp = 1: all N ranks split every sequence). For each
schedule, the ranks train the model as a training script would compose the two:

    model = parallelize_module(model, mesh["cp"], ContextParallel(schedule))   # sequences
    for block in model.layers:                  # torch.compile per block (unless --no-compile)
        fully_shard(torch.compile(block), mesh=dp_cp)
    fully_shard(model, mesh=dp_cp)              # FSDP2 over all dp x cp ranks

for a few dozen AdamW steps on synthetic batches: each dp group takes its share of the batch, each
cp rank its share of every sequence, and FSDP2 averages the gradients over all ranks. The first
tokens of every sequence cannot be predicted, so their labels are -100 (as a masked prompt's
would be), and they sit on some ranks only: each rank's loss is its sum over its valid labels
divided by the whole batch's count / cp (``ContextParallel`` passes it as the model's
``num_items_in_batch``), so the ranks' mean is the batch's loss and the average of their gradients
its gradient, where a mean over each rank's own labels would be visibly off.

Every step is checked: rank 0 runs the whole batch, at the same weights, through the plain model on
one process and compares the global loss (the mean of the ranks' losses) and the gradients with it.
It prints, per schedule, the last step's two losses, the largest differences seen, the training
speed and a verdict. Everything is fp32, so a correct run differs from the single process only by
float32 rounding (summation order, inductor's fused kernels): ~1e-7 relative in the loss and ~1e-6
in the gradients. ``LOSS_TOLERANCE`` and ``GRAD_TOLERANCE`` sit ten times above that and far below
what a real mistake gives (a model that sees local instead of global RoPE positions is off by
~1e-3 in the gradients from the first step, and by more as it learns to attend by position).
"""
import copy
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

from ..comm.process_group import _all_gather_tensor
from ..documents import IGNORE_INDEX
from ..dtensor import ContextParallel
from ..models import Llama, LlamaConfig
from ..schedules import SCHEDULES
from ..validation import check_int
from .launch import init_from_env, launch
from .numerics import rel_rms

LOSS_TOLERANCE = 1e-5  # |loss_cp - loss_1| / loss_1, worst step
GRAD_TOLERANCE = 1e-5  # ||g_cp - g_1|| / ||g_1|| over all parameters (rel-RMS), worst step
DEVICES = ("cpu", "cuda")
PERIOD = 16  # the synthetic sequences repeat with this period (see _batch)
DATASET_BATCHES = 8  # the synthetic dataset: the steps cycle through this many batches


def _batch(step: int, batch: int, seq: int, vocab: int):
    """Inputs and labels (the next token) of one step: random segments of ``PERIOD`` tokens repeated
    along the sequence, so every token from the second period on is predictable by attending
    ``PERIOD`` tokens back -- across shard boundaries, which only a correct ring gets right. The
    labels inside the first period (random tokens) are -100: nothing predicts them. The steps
    cycle through ``DATASET_BATCHES`` batches, which the model soon learns: the loss falls."""
    gen = torch.Generator().manual_seed(step % DATASET_BATCHES)
    segment = torch.randint(0, vocab, (batch, PERIOD), generator=gen)
    tokens = segment.repeat(1, seq // PERIOD + 1)[:, :seq + 1]
    labels = tokens[:, 1:].clone()
    labels[:, :PERIOD - 1] = IGNORE_INDEX
    return tokens[:, :-1], labels


def _loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=False)
    loss = model(ids, labels=labels).loss
    loss.backward()
    return loss.detach()


def _flat_grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _plain_name(name: str) -> str:
    """A parameter's name in the plain model (without torch.compile's wrapper)."""
    return name.replace("_orig_mod.", "")


def _full_weights_and_grads(model):
    """Every parameter and gradient whole, by plain name (one collective: every rank calls)."""
    names, tensors = [], []
    for name, p in model.named_parameters():
        names.append(_plain_name(name))
        tensors += [p.detach(), p.grad]
    full = _gather_whole(tensors)
    return dict(zip(names, full[0::2])), dict(zip(names, full[1::2]))


def _gather_whole(tensors):
    """The whole tensors of FSDP2's dim-0 shards (DTensors ``Shard(0)`` on a 1-D mesh) in one
    all-gather of all of them, not one per tensor (``full_tensor``: two collectives per parameter
    and step, a noticeable share of the demo's time on gloo); other tensors are returned as they
    are."""
    sharded = [i for i, t in enumerate(tensors) if isinstance(t, DTensor)]
    if not sharded:
        return list(tensors)
    mesh = tensors[sharded[0]].device_mesh
    world = mesh.size()
    if mesh.ndim != 1 or any(tensors[i].placements != (Shard(0),) for i in sharded):
        return [t.full_tensor() if isinstance(t, DTensor) else t for t in tensors]
    # Each rank's rows of each tensor: torch.chunk's split of dim 0 (what Shard(0) holds).
    rows = [[len(c) for c in torch.arange(tensors[i].shape[0]).chunk(world)] for i in sharded]
    rows = [r + [0] * (world - len(r)) for r in rows]
    width = [tensors[i].shape[1:].numel() for i in sharded]
    sizes = [sum(r[rank] * w for r, w in zip(rows, width)) for rank in range(world)]
    local = torch.cat([tensors[i].to_local().reshape(-1) for i in sharded])
    local = torch.nn.functional.pad(local, (0, max(sizes) - local.numel()))
    gathered = local.new_empty(world * max(sizes))
    _all_gather_tensor(gathered, local, group=mesh.get_group())
    gathered = gathered.view(world, max(sizes))
    out, offsets = list(tensors), [0] * world
    for i, r, w in zip(sharded, rows, width):
        parts = []
        for rank in range(world):
            parts.append(gathered[rank, offsets[rank]:offsets[rank] + r[rank] * w])
            offsets[rank] += r[rank] * w
        out[i] = torch.cat(parts).view(tensors[i].shape)
    return out


def _progress(schedule, step, steps, loss=None, note=""):
    """One line on rank 0's stderr, redrawn in place (no loss before the first step)."""
    done = 24 * step // steps
    shown = "" if loss is None else f"loss {loss:6.3f}"
    sys.stderr.write(f"\r  {schedule:7} [{'#' * done}{'.' * (24 - done)}] {step:3}/{steps} "
                     f"{shown:11} {note:<24}")
    if step == steps:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _data_and_context(mesh):
    """(the whole mesh as a (dp, cp) mesh or a 1-D cp one, dp size, this rank's dp index)."""
    if mesh.ndim == 1:
        return mesh, 1, 0
    return mesh, mesh.size(0), mesh.get_local_rank(0)


def build_model(single, mesh, schedule, *, compile_model, style_options=None):
    """``single``'s copy, trained as the module docstring shows: ContextParallel on the cp
    dimension, each block compiled (``compile_model``), FSDP2 over all ranks of ``mesh``."""
    cp_mesh = mesh if mesh.ndim == 1 else mesh["cp"]
    model = parallelize_module(copy.deepcopy(single), cp_mesh,
                               ContextParallel(schedule, **(style_options or {})))
    all_ranks = mesh if mesh.ndim == 1 else mesh._flatten("dp_cp")
    for i, block in enumerate(list(model.layers)):
        if compile_model:
            block = model.layers[i] = torch.compile(block)
        fully_shard(block, mesh=all_ranks)
    return fully_shard(model, mesh=all_ranks)


def train_schedule(mesh, schedule, *, steps, batch, seq, compile_model, device, lr=3e-3,
                   style_options=None):
    """Train the model on ``mesh`` (1-D: context parallel only; 2-D ("dp", "cp")) and check every
    step against the single-process model; returns the figures of one row (rank 0 compares; the
    other ranks return their timings only).

    Every step, rank 0 loads the model's current weights into the single-process model and runs
    the whole batch through it, so the two losses and gradients differ only by what this step's
    parallelism added (no drift of two separate trainings). ``style_options`` go to
    ``ContextParallel`` (the tests use them to break the model on purpose).
    """
    mesh, dp, dp_rank = _data_and_context(mesh)
    torch.manual_seed(0)
    single = Llama(LlamaConfig()).to(device)
    model = build_model(single, mesh, schedule, compile_model=compile_model,
                        style_options=style_options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    world = dist.get_world_size()
    rank0 = dist.get_rank() == 0
    mine = slice(dp_rank * batch // dp, (dp_rank + 1) * batch // dp)  # this dp group's sequences
    loss_gap = grad_gap = first_step_s = train_s = 0.0
    ref_loss = None
    for step in range(steps):
        ids, labels = (x.to(device) for x in _batch(step, batch, seq, single.cfg.vocab_size))
        if rank0 and step == 0 and compile_model:
            _progress(schedule, 0, steps, note="compiling ...")
        start = time.perf_counter()
        loss = _loss_and_grads(model, ids[mine], labels[mine])  # FSDP2 averages the gradients
        dist.all_reduce(loss)
        loss /= world
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if step == 0:
            first_step_s = seconds
        else:
            train_s += seconds
        weights, grads = _full_weights_and_grads(model)
        if rank0:
            single.load_state_dict(weights)
            ref_loss = _loss_and_grads(single, ids, labels)
            loss_gap = max(loss_gap, abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
            flat = torch.cat([grads[n].flatten() for n, _ in single.named_parameters()])
            grad_gap = max(grad_gap, rel_rms(flat, _flat_grads(single)))
            _progress(schedule, step + 1, steps, loss.item())
        optimizer.step()
    tokens = batch * seq * (steps - 1)
    return dict(schedule=schedule, loss=loss.item(),
                single_loss=ref_loss.item() if rank0 else float("nan"),
                loss_gap=loss_gap, grad_gap=grad_gap, first_step_s=first_step_s,
                tokens_per_s=tokens / train_s if train_s else float("nan"))


def verdict(row) -> str:
    if row["loss_gap"] <= LOSS_TOLERANCE and row["grad_gap"] <= GRAD_TOLERANCE:
        return "ok: matches the single-process model"
    return (f"MISMATCH: differs from the single-process model beyond float32 rounding "
            f"(tolerances {LOSS_TOLERANCE:.0e} loss, {GRAD_TOLERANCE:.0e} grads)")


def _rank_main(schedules, steps, batch, seq, compile_model, device_type, dp):
    backend = "nccl" if device_type == "cuda" else "gloo"
    init_from_env(backend)
    if device_type == "cuda":
        device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    world = dist.get_world_size()
    mesh = init_device_mesh(device_type, (dp, world // dp), mesh_dim_names=("dp", "cp"))
    rows = []
    for schedule in schedules:
        row = train_schedule(mesh, schedule, steps=steps, batch=batch, seq=seq,
                             compile_model=compile_model, device=device)
        # The slowest rank's timings (the rest is rank 0's comparison).
        slowest = torch.tensor([row["first_step_s"], -row["tokens_per_s"]], dtype=torch.float64,
                               device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        row.update(first_step_s=slowest[0].item(), tokens_per_s=-slowest[1].item())
        rows.append(row)
    dist.destroy_process_group()
    # rank 0's rows carry the comparison with the single-process model.
    return rows


def _check_args(nproc, dp, schedules, steps, batch, seq, device):
    if device not in DEVICES:
        raise ValueError(f"device={device!r} is not supported; valid: {list(DEVICES)}")
    if device == "cuda" and torch.cuda.device_count() < nproc:
        raise ValueError(f"nproc={nproc} needs {nproc} GPUs with device='cuda'; this machine has "
                         f"{torch.cuda.device_count()}")
    unknown = [s for s in schedules if s not in SCHEDULES and s != "auto"]
    if unknown:
        raise ValueError(f"schedule {unknown} unknown; valid: {['auto', *sorted(SCHEDULES)]}")
    check_int(steps, "steps", 2, "an int >= 2 (the first step is the warm-up)")
    check_int(dp, "dp", 1, "a positive int dividing nproc")
    if nproc % dp:
        raise ValueError(f"dp={dp} must divide nproc={nproc} (nproc / dp ranks split each "
                         "sequence)")
    check_int(batch, "batch", 1, "a positive int")
    if batch % dp:
        raise ValueError(f"batch={batch} must be divisible by dp={dp} (each data-parallel group "
                         "takes batch / dp sequences)")
    # Every layout splits the sequence into at most 2 * cp equal chunks.
    cp = nproc // dp
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < PERIOD or seq % (2 * cp):
        raise ValueError(f"seq={seq!r} must be an int >= {PERIOD} divisible by 2 * (nproc / dp) "
                         f"= {2 * cp}")


def run_demo(nproc=4, schedules=tuple(sorted(SCHEDULES)), steps=30, batch=2, seq=256,
             compile_model=True, device="cpu", dp=1):
    """Launch the demo, print its table; returns the rows and whether every schedule matched."""
    _check_args(nproc, dp, schedules, steps, batch, seq, device)
    backend = "nccl" if device == "cuda" else "gloo"
    how = "torch.compile per block" if compile_model else "eager"
    print(f"dtensor_ring demo: {nproc} {device.upper()} processes ({backend}) as dp={dp} x "
          f"cp={nproc // dp}, Llama "
          f"({sum(p.numel() for p in Llama(LlamaConfig()).parameters()) / 1e6:.1f}M parameters), "
          f"{batch} sequences of {seq} tokens, {steps} AdamW steps, FSDP2, {how}")
    print("Each schedule trains the model with context parallelism; every step is checked against "
          "the same model on one process.")
    rows = launch(_rank_main, nproc, tuple(schedules), steps, batch, seq, compile_model, device,
                  dp)[0]
    print(f"{'schedule':9} {'loss':>7} {'1-proc':>7} {'loss diff':>9} {'grad diff':>9} "
          f"{'tokens/s':>8} {'1st step s':>10}  verdict")
    verdicts = []
    for row in rows:
        verdicts.append(verdict(row))
        print(f"{row['schedule']:9} {row['loss']:7.4f} {row['single_loss']:7.4f} "
              f"{row['loss_gap']:9.1e} {row['grad_gap']:9.1e} {row['tokens_per_s']:8.0f} "
              f"{row['first_step_s']:10.1f}  {verdicts[-1]}")
    print("1-proc: the same batch at the same weights on one process. loss diff: the worst step's\n"
          "|loss - 1-proc| / 1-proc; grad diff: the worst step's rel-RMS difference of all\n"
          "gradients; 1st step s: includes compiling.")
    return rows, all(v.startswith("ok") for v in verdicts)
