"""Expect tests of the compile pass: the ring-attention node of a traced graph expanded into its
schedule's steps, for every schedule, causal and not, forward and backward.

One process, a fake process group of 4 ranks as rank 1 (zigzag's rank 1 meets every kind of step).
Rendering (tests/graph_render.py): collectives, waits and attention kernels in graph order, the
elementwise/view ops between them folded into counts. Refresh with EXPECTTEST_ACCEPT=1.
"""
import expecttest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import dtensor_ring  # noqa: F401 - registers the ops
from dtensor_ring import ops
from dtensor_ring.hybrid import ops as hybrid_ops
from dtensor_ring.mesh import resolve_mesh
from dtensor_ring.passes import COUNTERS, expand_ring_attention
from graph_render import render

Q = torch.randn(1, 4, 16, 8)
KV = torch.randn(1, 2, 16, 8)
LSE = torch.randn(1, 4, 16)
CU = torch.tensor([0, 16, 24, 64], dtype=torch.int32)  # documents of 16, 8 and 40 tokens


def expanded(schedule, is_causal, backward, documents=False, window=(-1, -1)):
    """The rendered graph of one ring-attention op after the pass; with ``documents``, packed
    documents whose boundaries are a graph input (so new boundaries need no new graph); with
    ``window``, a sliding window (a constant of the node)."""
    group = dist.group.WORLD.group_name
    options = (group, schedule, is_causal, 0.25, "cpu_flash", "fp32")
    if backward:
        gm = make_fx(lambda d, q, k, v, o, lse, cu: ops.ring_attention_bwd(
            d, q, k, v, o, lse, *options, cu if documents else None, 64 if documents else 0,
            *window),
            tracing_mode="fake")(Q, Q, KV, KV, Q, LSE, CU)
    else:
        gm = make_fx(lambda q, k, v, cu: ops.ring_attention_fwd(
            q, k, v, *options, cu if documents else None, 64 if documents else 0, *window),
            tracing_mode="fake")(Q, KV, KV, CU)
    before = sum(COUNTERS.values())
    assert expand_ring_attention(gm.graph) == 1
    assert sum(COUNTERS.values()) == before + 1
    assert not any("ring_attention" in str(n.target) for n in gm.graph.nodes)
    boundaries = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    assert bool(boundaries.users) == documents  # the expansion reads them from the input
    return render(gm.graph)


def expanded_hybrid(backward):
    """The rendered graph of one hybrid node (2 x 2 mesh, zigzag ring; 8/4 heads: two pieces
    per inner rank) after the pass; each collective says which group it runs on."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp_ring", "cp_a2a"))
    seq_mesh = resolve_mesh(mesh)
    groups = tuple(g.group_name for g in (seq_mesh.outer, seq_mesh.inner, seq_mesh.whole))
    options = (*groups, "zigzag", True, 0.25, "cpu_flash", "fp32", None, 0)
    q, kv = torch.randn(1, 8, 8, 8), torch.randn(1, 4, 8, 8)
    if backward:
        gm = make_fx(lambda d, a, b, c, o, lse: hybrid_ops.hybrid_attention_bwd(
            d, a, b, c, o, lse, *options), tracing_mode="fake")(
                q, q, kv, kv, q, torch.randn(1, 8, 8))
    else:
        gm = make_fx(lambda a, b, c: hybrid_ops.hybrid_attention_fwd(a, b, c, *options),
                     tracing_mode="fake")(q, kv, kv)
    assert expand_ring_attention(gm.graph) == 1
    assert not any("attention" in str(n.target) and "dtensor_ring" in str(n.target)
                   for n in gm.graph.nodes)
    return render(gm.graph, {groups[0]: "ring", groups[1]: "a2a"})


class RingExpandTest(expecttest.TestCase):
    @classmethod
    def setUpClass(cls):
        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)

    @classmethod
    def tearDownClass(cls):
        dist.destroy_process_group()

    # Sliding windows (schedules/windowed.py): 16 tokens per rank, rank 1 of 4. Causal with 3
    # keys before each query, rank 1 needs the last 3 rows of rank 0 and rank 2 the last 3 of
    # rank 1: one offset of the ring's three, 3 rows of K and of V each way (flattened: 2 kv
    # heads x 3 rows x 8 = 48 elements); offsets 2 and 3 reach no query and are skipped, with
    # no collective at all. Its blocks: the own band, and a triangle of rank 0's rows.
    def test_ring_window_skips_the_steps_out_of_reach(self):
        self.assertExpectedInline(expanded("ring", True, False, window=(3, -1)), """\
  (2 ops)
send_recv(1x2x3x8, 1x2x3x8, offset 1)
  (18 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x16x8, 1x2x16x8, 1x2x16x8, mask)
  (11 ops)
wait(1x2x3x8, 1x2x3x8)
  (17 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x3x8, 1x2x3x8, 1x2x3x8, mask)
  (39 ops)""")

    def test_ring_window_backward_returns_dk_dv_to_their_owner(self):
        self.assertExpectedInline(expanded("ring", True, True, window=(3, -1)), """\
  (2 ops)
send_recv(1x2x3x8, 1x2x3x8, offset 1)
  (21 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x8x8, 1x4x8x8, 1x2x8x8, 1x2x8x8, 1x4x8x8, 1x4x8, mask)
  (3 ops)
wait(1x2x3x8, 1x2x3x8)
  (24 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x3x8, 1x4x3x8, 1x2x3x8, 1x2x3x8, 1x4x3x8, 1x4x3, mask)
  (7 ops)
send_recv(1x2x3x8, 1x2x3x8, offset -1)
  (21 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x8x8, 1x4x8x8, 1x2x11x8, 1x2x11x8, 1x4x8x8, 1x4x8, mask)
  (35 ops)
wait(1x2x3x8, 1x2x3x8)
  (66 ops)""")

    # zigzag: chunk 1 (rank 1's first half) needs chunk 0, rank 0's first half; chunk 6 (its
    # second half) needs chunk 5, rank 2's second half: offsets 1 and 3 (= -1); offset 2 skipped.
    def test_zigzag_window_exchanges_with_both_neighbours(self):
        self.assertExpectedInline(expanded("zigzag", True, False, window=(3, -1)), """\
  (2 ops)
send_recv(1x2x3x8, 1x2x3x8, offset 1)
  (20 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x8x8, 1x2x8x8, 1x2x8x8, mask)
  (35 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x8x8, 1x2x8x8, 1x2x8x8, mask)
  (17 ops)
wait(1x2x3x8, 1x2x3x8)
  (4 ops)
send_recv(1x2x3x8, 1x2x3x8, offset 3)
  (15 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x3x8, 1x2x3x8, 1x2x3x8, mask)
  (11 ops)
wait(1x2x3x8, 1x2x3x8)
  (17 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x3x8, 1x2x3x8, 1x2x3x8, mask)
  (63 ops)""")

    def test_ring_causal_forward(self):
        self.assertExpectedInline(expanded("ring", True, False), """\
send_recv_next(1x2x16x8, 1x2x16x8)
  (3 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x16x8, 1x2x16x8, 1x2x16x8, causal)
  (3 ops)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (3 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x16x8, 1x2x16x8, 1x2x16x8, full)
  (30 ops)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
wait(1x2x16x8, 1x2x16x8)""")

    def test_ring_causal_backward(self):
        self.assertExpectedInline(expanded("ring", True, True), """\
send_recv_next(1x2x16x8, 1x2x16x8)
  (6 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x8x8, 1x4x8x8, 1x2x8x8, 1x2x8x8, 1x4x8x8, 1x4x8, causal)
  (3 ops)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (10 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x16x8, 1x4x16x8, 1x2x16x8, 1x2x16x8, 1x4x16x8, 1x4x16, full)
  (7 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
wait(1x2x16x8, 1x2x16x8)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (18 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x8x8, 1x4x8x8, 1x2x16x8, 1x2x16x8, 1x4x8x8, 1x4x8, mask)
  (33 ops)
wait(1x2x16x8, 1x2x16x8)
  (42 ops)""")

    def test_ring_full_forward(self):
        self.assertExpectedInline(expanded("ring", False, False), """\
send_recv_next(1x2x16x8, 1x2x16x8)
  (3 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x16x8, 1x2x16x8, 1x2x16x8, full)
  (3 ops)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (3 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x16x8, 1x2x16x8, 1x2x16x8, full)
  (2 ops)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (3 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x16x8, 1x2x16x8, 1x2x16x8, full)
  (2 ops)
wait(1x2x16x8, 1x2x16x8)
  (5 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x16x8, 1x2x16x8, 1x2x16x8, full)
  (78 ops)""")

    def test_ring_full_backward(self):
        self.assertExpectedInline(expanded("ring", False, True), """\
send_recv_next(1x2x16x8, 1x2x16x8)
  (6 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x16x8, 1x4x16x8, 1x2x8x8, 1x2x8x8, 1x4x16x8, 1x4x16, full)
  (3 ops)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (10 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x16x8, 1x4x16x8, 1x2x16x8, 1x2x16x8, 1x4x16x8, 1x4x16, full)
  (7 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (6 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x16x8, 1x4x16x8, 1x2x16x8, 1x2x16x8, 1x4x16x8, 1x4x16, full)
  (21 ops)
wait(1x2x16x8, 1x2x16x8)
  (8 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
wait(1x2x16x8, 1x2x16x8)
  (8 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x16x8, 1x4x16x8, 1x2x16x8, 1x2x16x8, 1x4x16x8, 1x4x16, full)
  (3 ops)
wait(1x2x16x8, 1x2x16x8)
  (8 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (6 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x16x8, 1x4x16x8, 1x2x8x8, 1x2x8x8, 1x4x16x8, 1x4x16, full)
  (28 ops)
wait(1x2x16x8, 1x2x16x8)
  (46 ops)""")

    def test_zigzag_causal_forward(self):
        self.assertExpectedInline(expanded("zigzag", True, False), """\
send_recv_next(1x2x16x8, 1x2x16x8)
  (3 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x16x8, 1x2x16x8, 1x2x16x8, causal)
  (3 ops)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (3 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x16x8, 1x2x8x8, 1x2x8x8, full)
  (2 ops)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (3 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x8x8, 1x2x16x8, 1x2x16x8, full)
  (2 ops)
wait(1x2x16x8, 1x2x16x8)
  (5 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x8x8, 1x2x16x8, 1x2x16x8, full)
  (78 ops)""")

    def test_zigzag_causal_backward(self):
        self.assertExpectedInline(expanded("zigzag", True, True), """\
send_recv_next(1x2x16x8, 1x2x16x8)
  (6 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x8x8, 1x4x8x8, 1x2x8x8, 1x2x8x8, 1x4x8x8, 1x4x8, causal)
  (3 ops)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (10 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x16x8, 1x4x16x8, 1x2x8x8, 1x2x8x8, 1x4x16x8, 1x4x16, full)
  (11 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (6 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x8x8, 1x4x8x8, 1x2x16x8, 1x2x16x8, 1x4x8x8, 1x4x8, full)
  (25 ops)
wait(1x2x16x8, 1x2x16x8)
  (8 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
wait(1x2x16x8, 1x2x16x8)
  (8 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x8x8, 1x4x8x8, 1x2x16x8, 1x2x16x8, 1x4x8x8, 1x4x8, full)
  (3 ops)
wait(1x2x16x8, 1x2x16x8)
  (8 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (18 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x8x8, 1x4x8x8, 1x2x16x8, 1x2x16x8, 1x4x8x8, 1x4x8, mask)
  (32 ops)
wait(1x2x16x8, 1x2x16x8)
  (42 ops)""")

    def test_zigzag_full_forward(self):
        self.assertExpectedInline(expanded("zigzag", False, False), """\
send_recv_next(1x2x16x8, 1x2x16x8)
  (3 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x16x8, 1x2x16x8, 1x2x16x8, full)
  (3 ops)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (3 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x16x8, 1x2x16x8, 1x2x16x8, full)
  (2 ops)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (3 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x16x8, 1x2x16x8, 1x2x16x8, full)
  (2 ops)
wait(1x2x16x8, 1x2x16x8)
  (5 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x16x8, 1x2x16x8, 1x2x16x8, full)
  (78 ops)""")

    def test_zigzag_full_backward(self):
        self.assertExpectedInline(expanded("zigzag", False, True), """\
send_recv_next(1x2x16x8, 1x2x16x8)
  (6 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x16x8, 1x4x16x8, 1x2x8x8, 1x2x8x8, 1x4x16x8, 1x4x16, full)
  (3 ops)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (10 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x16x8, 1x4x16x8, 1x2x16x8, 1x2x16x8, 1x4x16x8, 1x4x16, full)
  (7 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (6 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x16x8, 1x4x16x8, 1x2x16x8, 1x2x16x8, 1x4x16x8, 1x4x16, full)
  (21 ops)
wait(1x2x16x8, 1x2x16x8)
  (8 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
wait(1x2x16x8, 1x2x16x8)
  (8 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x16x8, 1x4x16x8, 1x2x16x8, 1x2x16x8, 1x4x16x8, 1x4x16, full)
  (3 ops)
wait(1x2x16x8, 1x2x16x8)
  (8 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (6 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x16x8, 1x4x16x8, 1x2x8x8, 1x2x8x8, 1x4x16x8, 1x4x16, full)
  (28 ops)
wait(1x2x16x8, 1x2x16x8)
  (46 ops)""")

    def test_stripe_causal_forward(self):
        self.assertExpectedInline(expanded("stripe", True, False), """\
send_recv_next(1x2x16x8, 1x2x16x8)
  (3 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x16x8, 1x2x16x8, 1x2x16x8, causal)
  (3 ops)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (3 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x16x8, 1x2x16x8, 1x2x16x8, causal)
  (2 ops)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (3 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x15x8, 1x2x15x8, 1x2x15x8, causal)
  (2 ops)
wait(1x2x16x8, 1x2x16x8)
  (5 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x15x8, 1x2x15x8, 1x2x15x8, causal)
  (78 ops)""")

    def test_stripe_causal_backward(self):
        self.assertExpectedInline(expanded("stripe", True, True), """\
send_recv_next(1x2x16x8, 1x2x16x8)
  (6 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x8x8, 1x4x8x8, 1x2x8x8, 1x2x8x8, 1x4x8x8, 1x4x8, causal)
  (3 ops)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (10 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x16x8, 1x4x16x8, 1x2x16x8, 1x2x16x8, 1x4x16x8, 1x4x16, causal)
  (7 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (6 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x15x8, 1x4x15x8, 1x2x15x8, 1x2x15x8, 1x4x15x8, 1x4x15, causal)
  (25 ops)
wait(1x2x16x8, 1x2x16x8)
  (8 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
wait(1x2x16x8, 1x2x16x8)
  (8 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x15x8, 1x4x15x8, 1x2x15x8, 1x2x15x8, 1x4x15x8, 1x4x15, causal)
  (3 ops)
wait(1x2x16x8, 1x2x16x8)
  (8 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (18 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x8x8, 1x4x8x8, 1x2x16x8, 1x2x16x8, 1x4x8x8, 1x4x8, mask)
  (32 ops)
wait(1x2x16x8, 1x2x16x8)
  (42 ops)""")

    def test_stripe_full_forward(self):
        self.assertExpectedInline(expanded("stripe", False, False), """\
send_recv_next(1x2x16x8, 1x2x16x8)
  (3 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x16x8, 1x2x16x8, 1x2x16x8, full)
  (3 ops)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (3 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x16x8, 1x2x16x8, 1x2x16x8, full)
  (2 ops)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (3 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x16x8, 1x2x16x8, 1x2x16x8, full)
  (2 ops)
wait(1x2x16x8, 1x2x16x8)
  (5 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x16x8, 1x2x16x8, 1x2x16x8, full)
  (78 ops)""")

    def test_stripe_full_backward(self):
        self.assertExpectedInline(expanded("stripe", False, True), """\
send_recv_next(1x2x16x8, 1x2x16x8)
  (6 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x16x8, 1x4x16x8, 1x2x8x8, 1x2x8x8, 1x4x16x8, 1x4x16, full)
  (3 ops)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (10 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x16x8, 1x4x16x8, 1x2x16x8, 1x2x16x8, 1x4x16x8, 1x4x16, full)
  (7 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (6 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x16x8, 1x4x16x8, 1x2x16x8, 1x2x16x8, 1x4x16x8, 1x4x16, full)
  (21 ops)
wait(1x2x16x8, 1x2x16x8)
  (8 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
wait(1x2x16x8, 1x2x16x8)
  (8 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x16x8, 1x4x16x8, 1x2x16x8, 1x2x16x8, 1x4x16x8, 1x4x16, full)
  (3 ops)
wait(1x2x16x8, 1x2x16x8)
  (8 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (6 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x16x8, 1x4x16x8, 1x2x8x8, 1x2x8x8, 1x4x16x8, 1x4x16, full)
  (28 ops)
wait(1x2x16x8, 1x2x16x8)
  (46 ops)""")

    def test_zigzag_causal_forward_with_documents(self):
        """One varlen block per step (the CPU kernel takes the segments as a mask), each
        exchange posted before the block it overlaps, as without documents."""
        self.assertExpectedInline(expanded("zigzag", True, False, documents=True), """\
send_recv_next(1x2x16x8, 1x2x16x8)
  (229 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x16x8, 1x2x16x8, 1x2x16x8, mask)
  (11 ops)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (18 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x16x8, 1x2x16x8, 1x2x16x8, mask)
  (11 ops)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (18 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x16x8, 1x2x16x8, 1x2x16x8, mask)
  (11 ops)
wait(1x2x16x8, 1x2x16x8)
  (20 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x16x8, 1x2x16x8, 1x2x16x8, mask)
  (87 ops)""")

    def test_zigzag_causal_backward_with_documents(self):
        self.assertExpectedInline(expanded("zigzag", True, True, documents=True), """\
send_recv_next(1x2x16x8, 1x2x16x8)
  (128 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x8x8, 1x4x8x8, 1x2x8x8, 1x2x8x8, 1x4x8x8, 1x4x8, mask)
  (3 ops)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (68 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x16x8, 1x4x16x8, 1x2x16x8, 1x2x16x8, 1x4x16x8, 1x4x16, mask)
  (7 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
wait(1x2x16x8, 1x2x16x8)
  (2 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (63 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x16x8, 1x4x16x8, 1x2x16x8, 1x2x16x8, 1x4x16x8, 1x4x16, mask)
  (23 ops)
wait(1x2x16x8, 1x2x16x8)
  (8 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
wait(1x2x16x8, 1x2x16x8)
  (46 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x16x8, 1x4x16x8, 1x2x16x8, 1x2x16x8, 1x4x16x8, 1x4x16, mask)
  (3 ops)
wait(1x2x16x8, 1x2x16x8)
  (8 ops)
send_recv_next(1x2x16x8, 1x2x16x8)
  (39 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x4x8x8, 1x4x8x8, 1x2x16x8, 1x2x16x8, 1x4x8x8, 1x4x8, mask)
  (30 ops)
wait(1x2x16x8, 1x2x16x8)
  (42 ops)""")

    def test_llama3_causal_forward_with_documents(self):
        self.assertExpectedInline(expanded("llama3", True, False, documents=True), """\
  (4 ops)
all_gather(2x1x1x16x8)
  (242 ops)
_scaled_dot_product_flash_attention_for_cpu(1x4x16x8, 1x2x16x8, 1x2x16x8, mask)
  (15 ops)
wait(4x2x1x1x16x8)
  (5 ops)
all_gather(2x1x1x16x8)
  (139 ops)
_scaled_dot_product_flash_attention_for_cpu(1x2x16x8, 1x1x64x8, 1x1x64x8, mask)
  (75 ops)
_scaled_dot_product_flash_attention_for_cpu(1x2x16x8, 1x1x64x8, 1x1x64x8, mask)
  (39 ops)
wait(4x2x1x1x16x8)
  (45 ops)
_scaled_dot_product_flash_attention_for_cpu(1x2x16x8, 1x1x64x8, 1x1x64x8, mask)
  (75 ops)
_scaled_dot_product_flash_attention_for_cpu(1x2x16x8, 1x1x64x8, 1x1x64x8, mask)
  (39 ops)""")

    def test_llama3_causal_forward(self):
        self.assertExpectedInline(expanded("llama3", True, False), """\
  (4 ops)
all_gather(2x1x1x16x8)
  (2 ops)
wait(4x2x1x1x16x8)
  (5 ops)
all_gather(2x1x1x16x8)
  (59 ops)
_scaled_dot_product_flash_attention_for_cpu(1x2x8x8, 1x1x16x8, 1x1x16x8, mask)
  (35 ops)
_scaled_dot_product_flash_attention_for_cpu(1x2x8x8, 1x1x56x8, 1x1x56x8, mask)
  (14 ops)
wait(4x2x1x1x16x8)
  (56 ops)
_scaled_dot_product_flash_attention_for_cpu(1x2x8x8, 1x1x16x8, 1x1x16x8, mask)
  (39 ops)
_scaled_dot_product_flash_attention_for_cpu(1x2x8x8, 1x1x56x8, 1x1x56x8, mask)
  (14 ops)""")

    def test_llama3_causal_backward(self):
        self.assertExpectedInline(expanded("llama3", True, True), """\
  (7 ops)
all_gather(2x1x1x16x8)
wait(4x2x1x1x16x8)
  (5 ops)
all_gather(2x1x1x16x8)
  (64 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x2x8x8, 1x2x8x8, 1x1x16x8, 1x1x16x8, 1x2x8x8, 1x2x8, mask)
  (49 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x2x8x8, 1x2x8x8, 1x1x56x8, 1x1x56x8, 1x2x8x8, 1x2x8, mask)
  (107 ops)
reduce_scatter(4x2x1x1x16x8)
wait(4x2x1x1x16x8)
  (65 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x2x8x8, 1x2x8x8, 1x1x16x8, 1x1x16x8, 1x2x8x8, 1x2x8, mask)
  (49 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x2x8x8, 1x2x8x8, 1x1x56x8, 1x1x56x8, 1x2x8x8, 1x2x8, mask)
  (104 ops)
wait(2x1x1x16x8)
  (24 ops)
reduce_scatter(4x2x1x1x16x8)
wait(2x1x1x16x8)
  (21 ops)""")

    def test_llama3_full_forward(self):
        self.assertExpectedInline(expanded("llama3", False, False), """\
  (4 ops)
all_gather(2x1x1x16x8)
  (2 ops)
wait(4x2x1x1x16x8)
  (5 ops)
all_gather(2x1x1x16x8)
  (47 ops)
_scaled_dot_product_flash_attention_for_cpu(1x2x16x8, 1x1x64x8, 1x1x64x8, full)
  (8 ops)
wait(4x2x1x1x16x8)
  (44 ops)
_scaled_dot_product_flash_attention_for_cpu(1x2x16x8, 1x1x64x8, 1x1x64x8, full)
  (12 ops)""")

    def test_llama3_full_backward(self):
        self.assertExpectedInline(expanded("llama3", False, True), """\
  (7 ops)
all_gather(2x1x1x16x8)
wait(4x2x1x1x16x8)
  (5 ops)
all_gather(2x1x1x16x8)
  (52 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x2x16x8, 1x2x16x8, 1x1x64x8, 1x1x64x8, 1x2x16x8, 1x2x16, full)
  (86 ops)
reduce_scatter(4x2x1x1x16x8)
wait(4x2x1x1x16x8)
  (53 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x2x16x8, 1x2x16x8, 1x1x64x8, 1x1x64x8, 1x2x16x8, 1x2x16, full)
  (83 ops)
wait(2x1x1x16x8)
  (24 ops)
reduce_scatter(4x2x1x1x16x8)
wait(2x1x1x16x8)
  (21 ops)""")


class PassPlumbingTest(expecttest.TestCase):
    @classmethod
    def setUpClass(cls):
        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)

    @classmethod
    def tearDownClass(cls):
        dist.destroy_process_group()

    def test_hybrid_forward(self):
        """Both levels: piece 0's q/k/v all-to-all, piece 1's posted before piece 0's ring (its
        K/V shift on the ring group, its blocks), piece 0's output sent back while piece 1 is
        attended, piece 1's output last."""
        self.assertExpectedInline(expanded_hybrid(False), """\
  (4 ops)
all_to_all(2x8x1x2x8) @a2a
  (4 ops)
all_to_all(2x8x1x1x8) @a2a
  (4 ops)
all_to_all(2x8x1x1x8) @a2a
wait(2x8x1x2x8)
  (3 ops)
wait(2x8x1x1x8)
  (3 ops)
wait(2x8x1x1x8)
  (7 ops)
all_to_all(2x8x1x2x8) @a2a
  (4 ops)
all_to_all(2x8x1x1x8) @a2a
  (4 ops)
all_to_all(2x8x1x1x8) @a2a
send_recv_next(1x1x16x8, 1x1x16x8) @ring
  (3 ops)
_scaled_dot_product_flash_attention_for_cpu(1x2x16x8, 1x1x16x8, 1x1x16x8, causal)
  (3 ops)
wait(1x1x16x8, 1x1x16x8)
  (5 ops)
_scaled_dot_product_flash_attention_for_cpu(1x2x8x8, 1x1x16x8, 1x1x16x8, full)
  (36 ops)
all_to_all(2x1x2x8x8) @a2a
  (3 ops)
all_to_all(2x1x2x8) @a2a
wait(2x8x1x2x8)
  (3 ops)
wait(2x8x1x1x8)
  (3 ops)
wait(2x8x1x1x8)
  (3 ops)
send_recv_next(1x1x16x8, 1x1x16x8) @ring
  (3 ops)
_scaled_dot_product_flash_attention_for_cpu(1x2x16x8, 1x1x16x8, 1x1x16x8, causal)
  (3 ops)
wait(1x1x16x8, 1x1x16x8)
  (5 ops)
_scaled_dot_product_flash_attention_for_cpu(1x2x8x8, 1x1x16x8, 1x1x16x8, full)
  (31 ops)
wait(2x1x2x8x8)
  (8 ops)
wait(2x1x2x8)
  (11 ops)
all_to_all(2x1x2x8x8) @a2a
  (3 ops)
all_to_all(2x1x2x8) @a2a
wait(2x1x2x8x8)
  (8 ops)
wait(2x1x2x8)
  (8 ops)""")

    def test_hybrid_backward(self):
        self.assertExpectedInline(expanded_hybrid(True), """\
  (5 ops)
all_to_all(2x8x1x2x8) @a2a
  (4 ops)
all_to_all(2x8x1x2x8) @a2a
  (4 ops)
all_to_all(2x8x1x1x8) @a2a
  (4 ops)
all_to_all(2x8x1x1x8) @a2a
  (4 ops)
all_to_all(2x8x1x2x8) @a2a
  (4 ops)
all_to_all(2x8x1x2x1) @a2a
wait(2x8x1x2x8)
  (3 ops)
wait(2x8x1x2x8)
  (3 ops)
wait(2x8x1x1x8)
  (3 ops)
wait(2x8x1x1x8)
  (3 ops)
wait(2x8x1x2x8)
  (3 ops)
wait(2x8x1x2x1)
  (7 ops)
all_to_all(2x8x1x2x8) @a2a
  (4 ops)
all_to_all(2x8x1x2x8) @a2a
  (4 ops)
all_to_all(2x8x1x1x8) @a2a
  (4 ops)
all_to_all(2x8x1x1x8) @a2a
  (4 ops)
all_to_all(2x8x1x2x8) @a2a
  (4 ops)
all_to_all(2x8x1x2x1) @a2a
  (2 ops)
send_recv_next(1x1x16x8, 1x1x16x8) @ring
  (6 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x2x8x8, 1x2x8x8, 1x1x8x8, 1x1x8x8, 1x2x8x8, 1x2x8, causal)
  (3 ops)
wait(1x1x16x8, 1x1x16x8)
  (12 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x2x8x8, 1x2x8x8, 1x1x16x8, 1x1x16x8, 1x2x8x8, 1x2x8, full)
  (7 ops)
send_recv_next(1x1x16x8, 1x1x16x8) @ring
  (18 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x2x8x8, 1x2x8x8, 1x1x16x8, 1x1x16x8, 1x2x8x8, 1x2x8, mask)
  (35 ops)
wait(1x1x16x8, 1x1x16x8)
  (48 ops)
all_to_all(2x1x2x8x8) @a2a
  (2 ops)
all_to_all(2x1x1x8x8) @a2a
  (2 ops)
all_to_all(2x1x1x8x8) @a2a
wait(2x8x1x2x8)
  (3 ops)
wait(2x8x1x2x8)
  (3 ops)
wait(2x8x1x1x8)
  (3 ops)
wait(2x8x1x1x8)
  (3 ops)
wait(2x8x1x2x8)
  (3 ops)
wait(2x8x1x2x1)
  (5 ops)
send_recv_next(1x1x16x8, 1x1x16x8) @ring
  (6 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x2x8x8, 1x2x8x8, 1x1x8x8, 1x1x8x8, 1x2x8x8, 1x2x8, causal)
  (3 ops)
wait(1x1x16x8, 1x1x16x8)
  (12 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x2x8x8, 1x2x8x8, 1x1x16x8, 1x1x16x8, 1x2x8x8, 1x2x8, full)
  (7 ops)
send_recv_next(1x1x16x8, 1x1x16x8) @ring
  (18 ops)
_scaled_dot_product_flash_attention_for_cpu_backward(1x2x8x8, 1x2x8x8, 1x1x16x8, 1x1x16x8, 1x2x8x8, 1x2x8, mask)
  (35 ops)
wait(1x1x16x8, 1x1x16x8)
  (42 ops)
wait(2x1x2x8x8)
  (8 ops)
wait(2x1x1x8x8)
  (8 ops)
wait(2x1x1x8x8)
  (11 ops)
all_to_all(2x1x2x8x8) @a2a
  (2 ops)
all_to_all(2x1x1x8x8) @a2a
  (2 ops)
all_to_all(2x1x1x8x8) @a2a
wait(2x1x2x8x8)
  (8 ops)
wait(2x1x1x8x8)
  (8 ops)
wait(2x1x1x8x8)
  (8 ops)""")

    def test_graph_without_ring_attention_is_untouched(self):
        def plain(q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v).relu() @ q.mT

        gm = make_fx(plain, tracing_mode="fake")(Q, Q, Q)
        before, skipped = gm.code, COUNTERS["graphs_without_ring_attention"]
        self.assertEqual(expand_ring_attention(gm.graph), 0)
        gm.recompile()
        self.assertEqual(gm.code, before)
        self.assertEqual(COUNTERS["graphs_without_ring_attention"], skipped + 1)

    def test_cache_key_names_the_process_groups(self):
        # The same rank and graph in a world of another size (a run on 2 GPUs after one on 4):
        # another key, or inductor's on-disk cache hands back the other world's expansion.
        from dtensor_ring.passes import RingExpandPass

        four = RingExpandPass().uuid()
        dist.destroy_process_group()
        try:
            dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
            two = RingExpandPass().uuid()
            self.assertNotEqual(two, four)
            dist.new_group([0, 1])  # a subgroup (a mesh dimension): another key again
            self.assertNotEqual(RingExpandPass().uuid(), two)
        finally:
            dist.destroy_process_group()
            dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
        self.assertEqual(RingExpandPass().uuid(), four)

    def test_ring_shifts_are_posted_in_one_chain(self):
        # NCCL pairs sends and receives in the order they are posted, and inductor orders each
        # rank's graph on its own: every post takes the previous post's handle, across the ring
        # nodes of a graph too (two independent attentions here), so no rank can reorder them.
        group = dist.group.WORLD.group_name

        def two(q, k, v, q2, k2, v2):
            return [ops.ring_attention_fwd(a, b, c, group, "zigzag", True, 0.25, "cpu_flash",
                                           "fp32", None, 0, -1, -1)[0] for a, b, c in
                    ((q, k, v), (q2, k2, v2))]

        gm = make_fx(two, tracing_mode="fake")(Q, KV, KV, Q.clone(), KV.clone(), KV.clone())
        expand_ring_attention(gm.graph)
        posts = [n for n in gm.graph.nodes
                 if n.target is torch.ops.dtensor_ring.post_exchange.default]
        self.assertEqual(len(posts), 6)  # 3 shifts per zigzag forward at W = 4
        self.assertEqual([p.args[1] for p in posts], [None, *posts[:-1]])

    def test_cache_key_names_the_source(self):
        # Inductor's on-disk cache outlives the process: an expansion traced by another version
        # of the code must not come back. The key hashes every file the expansion traces.
        import tempfile
        from pathlib import Path

        from dtensor_ring.passes import RingExpandPass
        from dtensor_ring.passes.ring_expand import source_key

        self.assertIn(source_key(), RingExpandPass().uuid())
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "schedule.py"
            path.write_text("STEPS = 3\n")
            before = source_key.__wrapped__((folder,))
            path.write_text("STEPS = 4\n")
            self.assertNotEqual(source_key.__wrapped__((folder,)), before)
            path.write_text("STEPS = 3\n")
            self.assertEqual(source_key.__wrapped__((folder,)), before)

    def test_install_keeps_a_users_pass_and_runs_it_after_ours(self):
        import torch._inductor.config as inductor_config
        from torch._inductor.custom_graph_pass import CustomGraphPass

        from dtensor_ring.passes import ComposedPass, RingExpandPass, install

        seen = []

        class UsersPass(CustomGraphPass):
            def __call__(self, graph):
                seen.append(any("ring_attention" in str(n.target) for n in graph.nodes))

            def uuid(self):
                return "users-pass-v1"

        saved = inductor_config.post_grad_custom_pre_pass
        try:
            inductor_config.post_grad_custom_pre_pass = UsersPass()
            install()
            install()  # idempotent
            composed = inductor_config.post_grad_custom_pre_pass
            self.assertIsInstance(composed, ComposedPass)
            self.assertEqual([type(p) for p in composed.passes], [RingExpandPass, UsersPass])
            self.assertIn("rank1", RingExpandPass().uuid())  # rank-specific graphs, rank-specific key
            self.assertIsNotNone(composed.uuid())
            gm = make_fx(lambda q, k, v: ops.ring_attention_fwd(
                q, k, v, dist.group.WORLD.group_name, "zigzag", True, 0.25, "cpu_flash", "fp32",
                None, 0, -1, -1),
                tracing_mode="fake")(Q, KV, KV)
            composed(gm.graph)
            self.assertEqual(seen, [False])  # the user's pass saw the graph after the expansion
        finally:
            inductor_config.post_grad_custom_pre_pass = saved
