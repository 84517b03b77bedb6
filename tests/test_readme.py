"""The README's "Use" section is a complete program, and it trains exactly like one process.

The first Python block under "## Use" in README.md is taken as it is and run on 4 CPU processes
started by PyTorch's elastic launcher (what ``torchrun --nproc-per-node=4`` uses; the program's
gloo path). Each rank returns its loss, its synchronised gradients and the batch. Reference: the
same model at the same initial weights on one process in float64, each padded document through it
alone, the loss the mean over the row's valid labels. Tolerance as in test_context_parallel.py:
rel-RMS <= 1e-5 for the loss (the mean of the ranks' losses) and for every gradient on every rank.
The README's data must catch the mistake it shows the fix for: weighting each token by 1 / (W x
its rank's count of valid labels), a mean of per-rank means, misses by more than 100x.
"""
import re
from pathlib import Path

import torch
import torch.nn.functional as F

import dtensor_ring as dr
from dtensor_ring.documents import documents
from dtensor_ring.models import Llama, LlamaConfig
from dtensor_ring.tools.launch import launch
from dtensor_ring.tools.numerics import rel_rms

README = Path(__file__).resolve().parents[1] / "README.md"
FP32_LIMIT = 1e-5
WRONG_FACTOR = 100
WORLD = 4


def readme_program() -> str:
    """The first ```python block of the README's "## Use" section."""
    text = README.read_text()
    section = text[text.index("\n## Use\n"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert blocks, "README.md's Use section has no python block"
    return blocks[0]


def _run_program(code):
    """One rank: the README's program as a script, then what the test compares."""
    torch.set_num_threads(1)
    namespace = {"__name__": "__main__"}
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - the README's own program
    batch, model = namespace["batch"], namespace["model"]
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return dict(loss=namespace["loss"].detach(), grads=grads, world=namespace["world_size"],
                input_ids=batch.input_ids, labels=batch.labels, cu_seqlens=batch.cu_seqlens)


def _reference(ids, labels, cu, weights):
    """float64, one process: each document through the model alone (it is causal, so a padded
    document's valid tokens see what they see in the packed row); the loss is the sum of the
    token losses times ``weights`` (per token of the row)."""
    torch.manual_seed(0)  # the program's initial weights
    model = Llama(LlamaConfig()).double()
    token_loss = torch.cat([
        F.cross_entropy(model(ids[:, a:b]).logits.flatten(0, 1), labels[0, a:b],
                        ignore_index=-100, reduction="none") for a, b in zip(cu, cu[1:])])
    loss = (token_loss * weights).sum()
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def _per_rank_mean_weights(labels, cu, world):
    """Each token's weight in a mean of the ranks' own means (zigzag per document)."""
    valid = (labels[0] != -100).double()
    docs = documents(torch.tensor(cu), None, cu[-1], 2 * world, "zigzag", torch.device("cpu"))
    weights = torch.zeros_like(valid)
    for rank in range(world):
        mine = dr.LAYOUTS["zigzag"].positions(cu[-1] // world, rank, world, docs)
        weights[mine] = valid[mine] / (world * valid[mine].sum())
    return weights


def _worst(loss, grads, reference):
    ref_loss, ref_grads = reference
    per_param = {n: rel_rms(grads[n].double(), g) for n, g in ref_grads.items()}
    worst = max(per_param, key=per_param.get)
    return max(rel_rms(loss, ref_loss), per_param[worst]), worst


def test_readme_program_matches_one_process(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the program's CPU path, on any machine
    ranks = launch(_run_program, WORLD, readme_program())
    assert sorted(ranks) == list(range(WORLD)) and ranks[0]["world"] == WORLD
    first = ranks[0]
    ids, labels, cu = first["input_ids"], first["labels"], first["cu_seqlens"].tolist()
    valid = (labels[0] != -100).double()
    reference = _reference(ids, labels, cu, valid / valid.sum())
    loss = torch.stack([ranks[r]["loss"] for r in range(WORLD)]).double().mean()
    for rank, result in ranks.items():
        assert torch.equal(result["input_ids"], ids) and torch.equal(result["labels"], labels)
        error, worst = _worst(loss, result["grads"], reference)
        assert error <= FP32_LIMIT, f"rank {rank}: {error:.2e} (worst: {worst})"
    per_rank_mean = _reference(ids, labels, cu, _per_rank_mean_weights(labels, cu, WORLD))
    miss, worst = _worst(*per_rank_mean, reference)
    assert miss > WRONG_FACTOR * FP32_LIMIT, f"a per-rank mean is only {miss:.2e} off ({worst})"
