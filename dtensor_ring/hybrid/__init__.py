"""Hybrid context parallelism on a 2-D mesh (ring ranks, all-to-all ranks): an all-to-all over heads
among the inner ranks (inside a node, over NVLink) and any ring schedule among the outer ranks
(across nodes).

* ``layout.py``    which global tokens rank (i, j) holds (drawn there)
* ``heads.py``     the all-to-all's buffers: sequence shards <-> head groups, GQA
* ``comm.py``      the all-to-all on a process group, traced, and the pair of communicators
* ``schedule.py``  ``Hybrid``: the all-to-all around the outer schedule, overlapped per head piece
* ``ops.py``       the custom ops ``dtensor_ring::hybrid_attention_fwd`` / ``_bwd``
* ``cost.py``      the cost model that picks the split (inner size, outer schedule)

``dr.ring_attention``, ``dr.shard_sequence`` / ``unshard_sequence`` / ``sequence_positions``,
``dr.ContextParallel``, ``dr.simulate_ring(world_size=(outer, inner))`` and the DTensor rule take
the 2-D mesh where they take a 1-D one; nothing here is needed directly.
"""
