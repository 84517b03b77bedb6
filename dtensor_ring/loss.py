"""The loss of a context-parallel model: the mean over the valid labels of the whole batch.

Each rank holds its own tokens. A loss that is a mean over the rank's own valid labels (those that
are not -100) weights each token by 1 / (W x its rank's count), so wherever the -100 labels fall
unevenly over the ranks (padding at documents' ends, masked prompts, separators) the mean of the
ranks' losses is not the batch's loss and the averaged gradients are not its gradients. The fix
is to divide each rank's *sum* by the batch's count, not the rank's own:

    rank loss = sum over the rank's valid labels / (the batch's count / W)

The mean of that over the W ranks is the batch's mean, and averaging the gradients over the W
ranks (``sync_gradients``, FSDP2 or DDP) gives its gradients. Two ways in:

* ``items_per_rank``: the divisor, computed from the whole batch's labels before sharding (no
  communication). ``ContextParallel`` passes it as ``num_items_in_batch`` to a module whose forward
  takes that argument (the repository's Llama; Hugging Face's name for it), and
  ``dtensor_ring.hf.apply`` to a transformers causal LM.
* ``global_mean_loss``: for a loss computed outside the model, from this rank's tokens: the
  divisor from the ranks' counts (one all-reduce of one number).
"""
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from .comm.mesh import resolve_group
from .documents import IGNORE_INDEX


def items_per_rank(labels: torch.Tensor, world: int, num_items=None, ignore_index=IGNORE_INDEX):
    """The divisor of each rank's loss sum: ``num_items`` (what the caller would pass on one
    process; default: the count of ``labels`` that are not ``ignore_index``, over the whole batch)
    / ``world``, as an fp32 tensor on ``labels``' device."""
    if num_items is None:
        num_items = (labels != ignore_index).sum()
    return torch.as_tensor(num_items, dtype=torch.float32, device=labels.device) / world


def global_mean_loss(loss_sum: torch.Tensor, count, mesh) -> torch.Tensor:
    """This rank's share of the mean over the valid labels of every rank of ``mesh``.

    ``loss_sum``: the sum of this rank's token losses (``reduction="sum"``); ``count``: how many
    valid labels it summed (an int or an integer tensor); ``mesh``: the ranks whose gradients are
    averaged -- the context-parallel mesh with ``sync_gradients``, or the flattened data x context
    mesh that FSDP2/DDP average over (the mean is then over the whole global batch, torchtitan's
    normalisation). Returns ``loss_sum * N / (the N ranks' total count)``: its mean over the ranks
    is the mean over all their valid labels, and the gradients averaged over them are that mean's.
    One all-reduce of the count (traceable: ``torch.compile`` keeps it in the graph).

    A collective: every rank of ``mesh`` calls it.

    Args:
        loss_sum (torch.Tensor): the sum of this rank's token losses, a floating-point tensor
            (usually a scalar), on the device the mesh's collectives run on.
        count (int | torch.Tensor): the number of valid labels summed into ``loss_sum``: a
            non-negative int or a one-element integer tensor.
        mesh (DeviceMesh | ProcessGroup): the ranks whose gradients are averaged: a 1-D
            ``DeviceMesh`` (e.g. ``mesh["cp"]``, or a flattened data x context mesh) or a
            ``ProcessGroup``.

    Returns:
        torch.Tensor: ``loss_sum * N / total``, loss_sum's shape, dtype and device
        (differentiable in ``loss_sum``; N: the ranks, total: the sum of their counts; a total
        of 0 gives inf or nan, as a mean over no labels).

    Raises:
        TypeError: ``loss_sum`` not a floating-point tensor; ``count`` not a non-negative int or
            a one-element integer tensor; ``mesh`` not a ``DeviceMesh`` or ``ProcessGroup``.
        ValueError: ``mesh`` a ``DeviceMesh`` of more than one dimension.
    """
    if not isinstance(loss_sum, torch.Tensor) or not loss_sum.dtype.is_floating_point:
        raise TypeError(f"loss_sum must be a floating-point tensor (a sum of token losses); got "
                        f"{type(loss_sum).__name__}"
                        + (f" of dtype {loss_sum.dtype}" if isinstance(loss_sum, torch.Tensor)
                           else ""))
    if isinstance(count, torch.Tensor):
        if count.dtype.is_floating_point or count.dtype.is_complex or count.numel() != 1:
            raise TypeError(f"count must be an int or a one-element integer tensor (the number "
                            f"of valid labels); got a {count.dtype} tensor of shape "
                            f"{tuple(count.shape)}")
    elif isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise TypeError(f"count must be a non-negative int or an integer tensor (the number of "
                        f"valid labels); got {count!r}")
    group = resolve_group(mesh)
    world = dist.get_world_size(group)
    local = torch.as_tensor(count, dtype=torch.int64, device=loss_sum.device).reshape(())
    total = funcol.all_reduce(local, "sum", group)  # int64: exact at any count
    return loss_sum * (world / total.to(loss_sum.dtype))
