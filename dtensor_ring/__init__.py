"""dtensor_ring: ring attention (ring, zigzag, stripe, llama3) for sequence-sharded PyTorch models."""
from .attention import ring_attention, simulate_ring
from .checkpointing import save_ring_attention, save_ring_attention_context
from . import flops  # noqa: F401 - FlopCounterMode formulas for the ring's ops
from .documents import pad_documents
from .dtensor import ContextParallel  # installs the DTensor SDPA rule
from .kernels import BACKENDS
from .loss import global_mean_loss
from .layouts import LAYOUTS
from .schedules import SCHEDULES, get_schedule
from .sharding import document_multiple, sequence_positions, shard_sequence, unshard_sequence

SCHEDULE_LAYOUT = {name: get_schedule(name).layout.name for name in ("auto", *SCHEDULES)}

# The compile pass: torch.compile(model) expands ring attention into explicit, overlapped steps.
from . import passes  # noqa: E402 - needs the runtime above; installed as dtensor_ring.passes
from .installation import install, uninstall  # noqa: E402 - the rule's and the pass's switch

install()

__all__ = ["BACKENDS", "ContextParallel", "LAYOUTS", "SCHEDULES", "SCHEDULE_LAYOUT",
           "document_multiple", "global_mean_loss", "install", "pad_documents", "ring_attention",
           "save_ring_attention", "save_ring_attention_context", "sequence_positions",
           "shard_sequence", "simulate_ring", "uninstall", "unshard_sequence"]
