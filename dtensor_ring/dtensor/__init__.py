"""DTensor integration: the SDPA rule on sequence-sharded DTensors, the ``ContextParallel`` style.

Importing this package (``import dtensor_ring`` does) installs the rule for SDPA's aten ops; no
other DTensor op changes, and SDPA on inputs with no sequence sharding behaves as before.

* ``handler.py``      the rule (a DTensor custom-op handler), forward and backward
* ``placements.py``   which q/k/v placements it takes, and the errors for the ones it refuses
* ``sdpa_ops.py``     the SDPA aten ops and their argument / result layouts
* ``local_attention.py``  query sharded, key/value replicated: local attention, no communication
* ``registry.py``     the layout (schedule) of each sequence-sharded mesh dimension
* ``sequence.py``     whole tensors to and from sequence-sharded DTensors in that layout
* ``style.py``        ``ContextParallel`` for ``parallelize_module``
"""
from .handler import install, installed, sdpa_handler
from .registry import (SequenceSharding, clear_sequence_schedule, get_sequence_schedule,
                       set_sequence_schedule)
from .sequence import distribute_sequence, sequence_full_tensor
from .style import ContextParallel, sync_gradients

install()

__all__ = ["ContextParallel", "SequenceSharding", "clear_sequence_schedule",
           "distribute_sequence", "get_sequence_schedule", "install", "installed",
           "sdpa_handler", "sequence_full_tensor", "set_sequence_schedule", "sync_gradients"]
