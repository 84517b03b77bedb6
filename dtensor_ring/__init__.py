"""dtensor_ring: ring attention (ring, zigzag, stripe, llama3) for sequence-sharded PyTorch models.

Importing it registers the DTensor SDPA rule and the compile pass. The public names (``__all__``;
each function's and class's docstring gives its Args, Returns and Raises):

* ``ring_attention``, ``simulate_ring``: attention over the whole sequence, on real ranks from
  this rank's shards, or on W simulated ranks in one process;
* ``shard_sequence``, ``unshard_sequence``, ``sequence_positions``: a whole sequence to this
  rank's shard in a layout and back, and the positions of this rank's tokens;
* ``pad_documents``, ``document_multiple``: packed documents padded (and placed) for a layout;
* ``ContextParallel``: the ``parallelize_module`` style that runs a model's SDPA as the ring;
* ``global_mean_loss``: a rank's loss normalised by the valid labels of every rank;
* ``save_ring_attention``, ``save_ring_attention_context``: the activation-checkpointing
  policy that saves the ring's outputs;
* ``BACKENDS``: dict[str, BlockKernel], the fp32 block kernels by their ``backend=`` name
  (``"auto"`` picks among them; exact mode's are ``kernels.EXACT_BACKENDS``);
* ``LAYOUTS``: dict[str, Layout], the layouts by name (``"contiguous"``, ``"zigzag"``,
  ``"stripe"``): the ``layout=`` of the sharding functions;
* ``SCHEDULES``: dict[str, schedule], the schedules by name (``"ring"``, ``"zigzag"``,
  ``"stripe"``, ``"llama3"``; ``schedule="auto"`` picks zigzag or llama3 per call);
* ``SCHEDULE_LAYOUT``: dict[str, str], each schedule's layout name, ``"auto"`` included: the
  layout ``ring_attention``'s shards must be in.

``dtensor_ring.hf.apply`` (imported on its own: it needs transformers) puts context parallelism on
a Hugging Face causal LM.
"""
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
