"""Helpers for the DTensor rule and ContextParallel tests: lifting local shards to DTensors, cutting
a whole tensor into this rank's shard for any (tp, cp) placement, recording collectives."""
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from dtensor_ring.comm import ProcessGroupComm
from dtensor_ring.layouts import get_layout

ALL_GATHERS = ("allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_",
               "allgather_coalesced_")


def local_shard(x, mesh, placements, layout):
    """This rank's shard of the whole tensor ``x`` under ``placements`` on ``mesh``, where a
    Shard(2) (sequence) follows ``layout`` and any other Shard splits evenly in order."""
    for index, placement in enumerate(placements):
        if not isinstance(placement, Shard):
            continue
        size, rank = mesh.size(index), mesh.get_local_rank(index)
        if placement.dim == 2:
            positions = get_layout(layout).positions(x.shape[2] // size, rank, size)
            x = x.index_select(2, positions)
        else:
            x = x.chunk(size, dim=placement.dim)[rank]
    return x


def dtensor_sdpa(mesh, placements, kv_placements=None, **kwargs):
    """fn(q, k, v) on local leaves -> SDPA on DTensors placed so -> local output."""
    kv_placements = placements if kv_placements is None else kv_placements

    def fn(q, k, v):
        q = DTensor.from_local(q, mesh, placements, run_check=False)
        k, v = (DTensor.from_local(x, mesh, kv_placements, run_check=False) for x in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
        assert tuple(out.placements) == tuple(placements), out.placements
        return out.to_local()
    return fn


class CollectiveLog(TorchDispatchMode):
    """Every c10d op that runs (after DTensor has turned its redistributions into them), with the
    element count of its input, so a test can tell *what* was all-gathered.

    The schedules communicate inside the ``dtensor_ring::ring_attention_*`` custom ops, below this
    mode's reach, so their communicator's operations are recorded too (as "allgather_",
    "ring_shift" and "reduce_scatter" with the local input's element count).
    """

    def __init__(self):
        super().__init__()
        self.calls = []
        self._saved = {}

    def __enter__(self):
        for method, name in (("all_gather", "allgather_"), ("send_recv_next", "ring_shift"),
                             ("reduce_scatter", "reduce_scatter")):
            original = getattr(ProcessGroupComm, method)
            self._saved[method] = original

            def recorded(comm, tensor, *rest, original=original, name=name):  # shift: a list
                tensors = tensor if isinstance(tensor, (list, tuple)) else [tensor]
                self.calls.append((name, [t.numel() for t in tensors]))
                return original(comm, tensor, *rest)
            setattr(ProcessGroupComm, method, recorded)
        return super().__enter__()

    def __exit__(self, *exc):
        for method, original in self._saved.items():
            setattr(ProcessGroupComm, method, original)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        if func.namespace == "c10d":
            name = func._overloadpacket.__name__
            sizes = [a.numel() for a in args if isinstance(a, torch.Tensor)]
            sizes += [t.numel() for a in args if isinstance(a, (list, tuple)) for t in a
                      if isinstance(t, torch.Tensor)]
            self.calls.append((name, sizes))
        return func(*args, **(kwargs or {}))

    def gathered_elements(self):
        """Elements all-gathered (each call's smallest tensor argument: the local input)."""
        return sum(min(sizes) for name, sizes in self.calls if name in ALL_GATHERS)

    def names(self):
        return [name for name, _ in self.calls]


def expect_error(failures, where, exc_type, fn, *fragments):
    """Record in ``failures`` unless ``fn()`` raises ``exc_type`` whose message has ``fragments``
    (collected rather than raised, so one rank reports every bad case at once)."""
    try:
        fn()
    except exc_type as error:
        missing = [f for f in fragments if f not in str(error)]
        if missing:
            failures.append(f"{where}: message lacks {missing}: {error}")
        return
    except Exception as error:  # noqa: BLE001 - report the wrong kind
        failures.append(f"{where}: expected {exc_type.__name__}, got {type(error).__name__}: "
                        f"{error}")
        return
    failures.append(f"{where}: expected {exc_type.__name__}, nothing raised")
