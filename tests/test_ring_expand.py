"""Tests of the compile pass (passes/ring_expand.py): the ring-attention node of a traced graph
expanded into its schedule's steps.

One process, a fake process group of 4 ranks as rank 1 (zigzag's rank 1 meets every kind of step).
Every expansion is checked by tests/graph_render.py's ``check_exchanges`` (each process group's
posts chained in graph order, each waited on once, holding what it sent). One graph per schedule
family is pinned whole (``render``: exchanges, waits and kernels in graph order, other ops
counted): the ring's point-to-point shifts (zigzag), llama3's all-gathers, the sliding window's
exchange, the 2 x 2 hybrid mesh. Every combination of schedule, mask, direction, documents and
window is pinned as one row of counts (``count_table``). Refresh both with EXPECTTEST_ACCEPT=1.
"""
import functools
import tempfile
from pathlib import Path
from unittest import mock

import expecttest
import torch
import torch._inductor.config as inductor_config
import torch.distributed as dist
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import dtensor_ring  # noqa: F401 - registers the ops
from dtensor_ring import ops
from dtensor_ring.comm.mesh import resolve_mesh
from dtensor_ring.hybrid import heads as hybrid_heads
from dtensor_ring.kernels.base import CAUSAL, NONE
from dtensor_ring.kernels.cpu_flash import CpuFlash
from dtensor_ring.hybrid import ops as hybrid_ops
from dtensor_ring.passes import (COUNTERS, ComposedPass, RingExpandPass, expand_ring_attention,
                                 install)
from dtensor_ring.passes.ring_expand import _order_exchanges as order_exchanges, source_key
from graph_render import AFTER, BEGUN, check_exchanges, count_table, counts, render

Q = torch.randn(1, 4, 16, 8)
KV = torch.randn(1, 2, 16, 8)
CU = torch.tensor([0, 16, 24, 64], dtype=torch.int32)  # documents of 16, 8 and 40 tokens
NO_WINDOW = (-1, -1)


@functools.cache
def expanded(schedule, is_causal, backward, documents=False, window=NO_WINDOW):
    """(the graph of one attention op after the pass, its process groups' labels); with
    ``documents``, packed documents whose boundaries are a graph input (so new boundaries need no
    new graph); with ``window``, a sliding window (a constant of the node). Schedule "hybrid":
    the node of a 2 x 2 mesh (zigzag ring; 8/4 heads: two pieces per inner rank)."""
    if schedule == "hybrid":
        mesh = resolve_mesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp_ring", "cp_a2a")))
        groups = tuple(g.group_name for g in (mesh.outer, mesh.inner, mesh.whole))
        op = hybrid_ops.hybrid_attention_bwd if backward else hybrid_ops.hybrid_attention_fwd
        q, kv, window = torch.randn(1, 8, 8, 8), torch.randn(1, 4, 8, 8), ()
        labels = {groups[0]: "ring", groups[1]: "a2a"}
        options = (*groups, "zigzag", is_causal, 0.25, "cpu_flash", "fp32")
    else:
        op = ops.ring_attention_bwd if backward else ops.ring_attention_fwd
        q, kv, labels = Q, KV, None
        options = (dist.group.WORLD.group_name, schedule, is_causal, 0.25, "cpu_flash", "fp32")

    def args(cu):
        return (*options, cu if documents else None, 64 if documents else 0, *window)

    if backward:
        gm = make_fx(lambda d, a, b, c, o, lse, cu: op(d, a, b, c, o, lse, *args(cu)),
                     tracing_mode="fake")(q, q, kv, kv, q, torch.randn(q.shape[:-1]), CU)
    else:
        gm = make_fx(lambda a, b, c, cu: op(a, b, c, *args(cu)), tracing_mode="fake")(q, kv, kv, CU)
    before = sum(COUNTERS.values())
    # the hybrid's pipelined path: two pieces per head group (the default is one)
    with mock.patch.object(hybrid_heads, "DEFAULT_CHUNKS", 2):
        assert expand_ring_attention(gm.graph) == 1
    assert sum(COUNTERS.values()) == before + 1
    assert not any("dtensor_ring" in str(n.target) and "attention" in str(n.target)
                   for n in gm.graph.nodes)
    boundaries = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    assert bool(boundaries.users) == documents  # the expansion reads them from the input
    return gm.graph, labels


CASES = [(s, c, b) for s in ("ring", "zigzag", "stripe", "llama3") for c in (True, False)
         for b in (False, True)] + [
    ("zigzag", True, False, True), ("zigzag", True, True, True), ("llama3", True, False, True),
    ("ring", True, False, False, (3, -1)), ("ring", True, True, False, (3, -1)),
    ("zigzag", True, False, False, (3, -1)), ("hybrid", True, False), ("hybrid", True, True)]


def _name(schedule, is_causal, backward, documents=False, window=NO_WINDOW):
    return " ".join([schedule, "causal" if is_causal else "full", "bwd" if backward else "fwd"]
                    + ["docs"] * documents + [f"window {window[0]}"] * (window != NO_WINDOW))


def _after_kernels_index(node) -> int:
    return [a.name for a in node.target._schema.arguments].index("after_kernels")


def _after_kernels(node) -> list:
    """The kernels (their first outputs) ``node``, an exchange op, is ordered after."""
    return node.args[_after_kernels_index(node)]


def _drop_after_kernels(node):
    """``node`` (an exchange op) no longer after any kernel."""
    node.update_arg(_after_kernels_index(node), [])


def _drop_wait(wait):
    """``wait`` removed, what it received replaced by what was sent (an exchange never waited)."""
    for user in list(wait.users):
        assert user.target.__name__ == "getitem"
        user.replace_all_uses_with(wait.args[1][user.args[1]])
        wait.graph.erase_node(user)
    wait.graph.erase_node(wait)


class FakeWorld(expecttest.TestCase):
    """A fake world of 4 ranks, as rank 1, per class (the cache key test must not see the
    hybrid mesh's groups)."""

    @classmethod
    def setUpClass(cls):
        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)

    @classmethod
    def tearDownClass(cls):
        dist.destroy_process_group()


class RingExpandTest(FakeWorld):
    def test_zigzag_forward(self):
        """Each K/V shift posted before the block it overlaps, waited on after it."""
        self.assertExpectedInline(render(*expanded("zigzag", True, False)), """\
send_recv_next(1x2x16x8, 1x2x16x8)         +3 ops
attn(q 1x4x16x8, k 1x2x16x8, causal)       +2 ops
posted                                     +1 ops
wait(1x2x16x8, 1x2x16x8)                   +2 ops
send_recv_next(1x2x16x8, 1x2x16x8)         +3 ops
attn(q 1x4x16x8, k 1x2x8x8, full)          +2 ops
wait(1x2x16x8, 1x2x16x8)                   +2 ops
send_recv_next(1x2x16x8, 1x2x16x8)         +3 ops
attn(q 1x4x8x8, k 1x2x16x8, full)          +2 ops
wait(1x2x16x8, 1x2x16x8)                   +5 ops
attn(q 1x4x8x8, k 1x2x16x8, full)          +78 ops""")

    def test_zigzag_backward(self):
        self.assertExpectedInline(render(*expanded("zigzag", True, True)), """\
send_recv_next(1x2x16x8, 1x2x16x8)         +7 ops
attn_bwd(q 1x4x8x8, k 1x2x8x8, causal)     +3 ops
posted
wait(1x2x16x8, 1x2x16x8)                   +2 ops
send_recv_next(1x2x16x8, 1x2x16x8)         +11 ops
attn_bwd(q 1x4x16x8, k 1x2x8x8, full)      +11 ops
send_recv_next(1x2x16x8, 1x2x16x8)
wait(1x2x16x8, 1x2x16x8)                   +2 ops
send_recv_next(1x2x16x8, 1x2x16x8)         +7 ops
attn_bwd(q 1x4x8x8, k 1x2x16x8, full)      +25 ops
wait(1x2x16x8, 1x2x16x8)                   +8 ops
send_recv_next(1x2x16x8, 1x2x16x8)
wait(1x2x16x8, 1x2x16x8)                   +8 ops
attn_bwd(q 1x4x8x8, k 1x2x16x8, full)      +3 ops
wait(1x2x16x8, 1x2x16x8)                   +8 ops
send_recv_next(1x2x16x8, 1x2x16x8)         +19 ops
attn_bwd(q 1x4x8x8, k 1x2x16x8, mask)      +32 ops
wait(1x2x16x8, 1x2x16x8)                   +42 ops""")

    def test_llama3_forward(self):
        self.assertExpectedInline(render(*expanded("llama3", True, False)), """\
+4 ops
all_gather(2x1x1x16x8)                     +2 ops
wait(4x2x1x1x16x8)                         +5 ops
all_gather(2x1x1x16x8)                     +61 ops
attn(q 1x2x8x8, k 1x1x16x8, mask)          +31 ops
attn(q 1x2x8x8, k 1x1x56x8, mask)          +8 ops
wait(4x2x1x1x16x8)                         +62 ops
attn(q 1x2x8x8, k 1x1x16x8, mask)          +31 ops
attn(q 1x2x8x8, k 1x1x56x8, mask)          +10 ops""")

    def test_llama3_backward(self):
        self.assertExpectedInline(render(*expanded("llama3", True, True)), """\
+7 ops
all_gather(2x1x1x16x8)
wait(4x2x1x1x16x8)                         +5 ops
all_gather(2x1x1x16x8)                     +65 ops
attn_bwd(q 1x2x8x8, k 1x1x16x8, mask)      +50 ops
attn_bwd(q 1x2x8x8, k 1x1x56x8, mask)      +107 ops
reduce_scatter(4x2x1x1x16x8)
wait(4x2x1x1x16x8)                         +65 ops
attn_bwd(q 1x2x8x8, k 1x1x16x8, mask)      +49 ops
attn_bwd(q 1x2x8x8, k 1x1x56x8, mask)      +104 ops
wait(2x1x1x16x8)                           +24 ops
reduce_scatter(4x2x1x1x16x8)
wait(2x1x1x16x8)                           +21 ops""")

    # Sliding windows (schedules/windowed.py): 16 tokens per rank, rank 1 of 4. Causal with 3
    # keys before each query, rank 1 needs the last 3 rows of rank 0 and rank 2 the last 3 of
    # rank 1: one offset of the ring's three, 3 rows of K and of V each way; offsets 2 and 3
    # reach no query and are skipped, with no collective at all. The backward returns the dK/dV
    # of those rows to their owner (offset -1). The first exchange is begun before the own early
    # block and posted after it ("posted"), as eager runs it. zigzag's rank 1 (count table)
    # exchanges with both neighbours: chunk 1 needs rank 0's chunk 0, chunk 6 rank 2's chunk 5
    # (offsets 1 and 3).
    def test_window_backward(self):
        self.assertExpectedInline(render(*expanded("ring", True, True, window=(3, -1))), """\
+2 ops
send_recv(1x2x3x8, 1x2x3x8, offset 1)      +22 ops
attn_bwd(q 1x4x8x8, k 1x2x8x8, mask)       +3 ops
posted
wait(1x2x3x8, 1x2x3x8)                     +24 ops
attn_bwd(q 1x4x3x8, k 1x2x3x8, mask)       +7 ops
send_recv(1x2x3x8, 1x2x3x8, offset -1)     +22 ops
attn_bwd(q 1x4x8x8, k 1x2x11x8, mask)      +35 ops
wait(1x2x3x8, 1x2x3x8)                     +66 ops""")

    def test_hybrid_forward(self):
        """Both levels: piece 0's q/k/v all-to-all (one message), piece 1's posted before piece
        0's ring (its K/V shift on the ring group, its blocks), piece 0's output (out, then the
        LSE) sent back while piece 1 is attended, piece 1's output last."""
        self.assertExpectedInline(render(*expanded("hybrid", True, False)), """\
+22 ops
all_to_all(2x8x1x4x8) @a2a
wait(2x8x1x4x8)                            +29 ops
all_to_all(2x8x1x4x8) @a2a
send_recv_next(1x1x16x8, 1x1x16x8) @ring   +3 ops
attn(q 1x2x16x8, k 1x1x16x8, causal)       +2 ops
posted                                     +1 ops
wait(1x1x16x8, 1x1x16x8)                   +5 ops
attn(q 1x2x8x8, k 1x1x16x8, full)          +40 ops
all_to_all(2x1x2x8x8) @a2a                 +7 ops
all_to_all(2x1x2x8) @a2a
wait(2x8x1x4x8)                            +7 ops
send_recv_next(1x1x16x8, 1x1x16x8) @ring   +3 ops
attn(q 1x2x16x8, k 1x1x16x8, causal)       +2 ops
posted                                     +1 ops
wait(1x1x16x8, 1x1x16x8)                   +5 ops
attn(q 1x2x8x8, k 1x1x16x8, full)          +31 ops
wait(2x1x2x8x8)                            +10 ops
wait(2x1x2x8)                              +17 ops
all_to_all(2x1x2x8x8) @a2a                 +7 ops
all_to_all(2x1x2x8) @a2a
wait(2x1x2x8x8)                            +10 ops
wait(2x1x2x8)                              +10 ops""")

    def test_every_combination_counted(self):
        """Exchanges by kind (send_recv: +offset; the hybrid's: @group), the elements they send,
        how many overlap an attention kernel, kernels by mask, the scores they compute, all ops.
        Full attention is one graph whatever the layout."""
        self.assertExpectedInline(count_table({_name(*c): expanded(*c) for c in CASES}), """\
                           exchanges                               sent overlap causal full mask scores ops
ring causal fwd            send_recv_next 3                        1536       2      1    1    0   2048  52
ring causal bwd            send_recv_next 6                        3072       3      1    1    1   1792 146
ring full fwd              send_recv_next 3                        1536       3      0    4    0   4096 114
ring full bwd              send_recv_next 6                        3072       6      0    5    0   4096 186
zigzag causal fwd          send_recv_next 3                        1536       3      1    3    0   2560 114
zigzag causal bwd          send_recv_next 6                        3072       6      1    3    1   2304 206
zigzag full fwd            send_recv_next 3                        1536       3      0    4    0   4096 114
zigzag full bwd            send_recv_next 6                        3072       6      0    5    0   4096 186
stripe causal fwd          send_recv_next 3                        1536       3      4    0    0   3848 114
stripe causal bwd          send_recv_next 6                        3072       6      4    0    1   3592 202
stripe full fwd            send_recv_next 3                        1536       3      0    4    0   4096 114
stripe full bwd            send_recv_next 6                        3072       6      0    5    0   4096 186
llama3 causal fwd          all_gather 2                             512       1      0    0    4   2304 222
llama3 causal bwd          all_gather 2, reduce_scatter 2          2560       2      0    0    4   2304 509
llama3 full fwd            all_gather 2                             512       1      0    2    0   4096 130
llama3 full bwd            all_gather 2, reduce_scatter 2          2560       2      0    2    0   4096 342
zigzag causal fwd docs     send_recv_next 3                        1536       3      0    0    4   4096 419
zigzag causal bwd docs     send_recv_next 6                        3072       6      0    0    5   3840 493
llama3 causal fwd docs     all_gather 2                             512       2      0    0    5   9216 687
ring causal fwd window 3   send_recv+1 1                             96       1      0    0    2   1060  92
ring causal bwd window 3   send_recv+1 1, send_recv-1 1             192       2      0    0    3    644 189
zigzag causal fwd window 3 send_recv+1 1, send_recv+3 1             192       2      0    0    4    584 193
hybrid causal fwd          all_to_all@a2a 6, send_recv_next@ring 2 2112       5      2    2    0   1536 234
hybrid causal bwd          all_to_all@a2a 6, send_recv_next@ring 4 4160       7      2    2    2   1280 492""")

    def test_the_checks_fail_on_an_altered_graph(self):
        """zigzag's forward, altered as a broken pass would alter it."""
        def fresh():
            return expanded.__wrapped__("zigzag", True, False)[0]

        pinned = counts(*expanded("zigzag", True, False))
        self.assertEqual((pinned["exchanges"], pinned["overlapped"]), ({"send_recv_next": 3}, 3))
        graph = fresh()  # a post no longer after the one before it: inductor may reorder them
        check_exchanges(graph)[1][0].update_arg(1, None)
        with self.assertRaisesRegex(AssertionError, "not chained"):
            counts(graph)
        graph = fresh()  # an exchange posted and never waited on
        _drop_wait(check_exchanges(graph)[1][1])
        with self.assertRaisesRegex(AssertionError, "waited on 0 times"):
            render(graph)
        graph = fresh()  # an exchange removed (its wait too; the chain and the order mended)
        (post, wait), (later, _) = check_exchanges(graph)[1:]
        _drop_wait(wait)
        later.update_arg(1, post.args[1])
        graph.erase_node(post)
        order_exchanges(graph)
        self.assertEqual(counts(graph)["exchanges"], {"send_recv_next": 2})
        graph = fresh()  # a wait free to move above the kernel it overlaps
        post, wait = check_exchanges(graph)[1]
        _drop_after_kernels(wait)
        with self.assertRaisesRegex(AssertionError, "a wait: the kernels since its post"):
            counts(graph)
        post.append(wait)  # moved up to its post (the order mended below it): it overlaps nothing
        order_exchanges(graph)
        self.assertEqual(counts(graph)["overlapped"], 2)
        graph = fresh()  # the first shift's second half free to move above the own block
        (begun,) = [n for n in graph.nodes if n.target is BEGUN]
        _drop_after_kernels(begun)
        with self.assertRaisesRegex(AssertionError, "a begun exchange's post: the kernels"):
            counts(graph)
        # another schedule with the same exchanges: stripe's blocks
        self.assertNotEqual(counts(*expanded("stripe", True, False)), pinned)
        # the backward: a late own block that no longer reads its LSE through the dK/dV post
        graph = expanded.__wrapped__("zigzag", True, True)[0]
        ordered = [n for n in graph.nodes if n.target is AFTER][-1]
        ordered.replace_all_uses_with(ordered.args[0])
        graph.erase_node(ordered)
        with self.assertRaisesRegex(AssertionError, "does not depend on post_exchange"):
            counts(graph)


class PassPlumbingTest(FakeWorld):
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
        self.assertEqual(expand_ring_attention(gm.graph), 2)
        pairs = check_exchanges(gm.graph)  # chained in graph order
        self.assertEqual(len(pairs), 6)  # 3 shifts per zigzag forward at W = 4
        # each after the handle of the one before (a begun shift's: its second half's)
        handles = [wait.args[0] for _, wait in pairs]
        self.assertEqual([post.args[1] for post, _ in pairs], [None, *handles[:-1]])

    def test_llama3_gathers_stay_below_the_blocks_before_them(self):
        """llama3 with a kernel that has no bottom-right causal mask (cuDNN's plan: the own block
        first, then two blocks per head group). Its all-gathers read only local K/V; compiled on
        4 H200s, inductor posted all four groups' at the start of the forward (1.4x eager's time).
        Each gather after the first now comes after the blocks the schedule computes before it,
        and each wait after its group's blocks (traced here with the CPU kernel's mask
        restricted to cuDNN's)."""
        q, kv = torch.randn(1, 8, 16, 8), torch.randn(1, 4, 16, 8)  # 4 kv heads: 4 groups at W = 4
        options = (dist.group.WORLD.group_name, "llama3", True, 0.25, "cpu_flash", "fp32", None,
                   0, *NO_WINDOW)
        with mock.patch.object(CpuFlash, "masks", (NONE, CAUSAL)):
            gm = make_fx(lambda a, b, c: ops.ring_attention_fwd(a, b, c, *options),
                         tracing_mode="fake")(q, kv, kv)
            expand_ring_attention(gm.graph)
        gathers = [post for post, _ in check_exchanges(gm.graph)]
        self.assertEqual(len(gathers), 4)
        self.assertEqual([len(_after_kernels(post)) for post in gathers], [0, 1, 2, 2])
        self.assertExpectedInline(render(gm.graph), """\
+6 ops
all_gather(16x2x1x1x8)
attn(q 1x8x16x8, k 1x4x16x8, causal)       +3 ops
wait(4x16x2x1x1x8)                         +7 ops
all_gather(16x2x1x1x8)                     +19 ops
attn(q 1x2x16x8, k 1x1x8x8, full)          +7 ops
attn(q 1x2x8x8, k 1x1x32x8, full)          +54 ops
wait(4x16x2x1x1x8)                         +7 ops
all_gather(16x2x1x1x8)                     +19 ops
attn(q 1x2x16x8, k 1x1x8x8, full)          +7 ops
attn(q 1x2x8x8, k 1x1x32x8, full)          +54 ops
wait(4x16x2x1x1x8)                         +7 ops
all_gather(16x2x1x1x8)                     +19 ops
attn(q 1x2x16x8, k 1x1x8x8, full)          +7 ops
attn(q 1x2x8x8, k 1x1x32x8, full)          +54 ops
wait(4x16x2x1x1x8)                         +20 ops
attn(q 1x2x16x8, k 1x1x8x8, full)          +7 ops
attn(q 1x2x8x8, k 1x1x32x8, full)          +56 ops""")
        _drop_after_kernels(gathers[2])
        with self.assertRaisesRegex(AssertionError, "a post: the kernels since the post before"):
            check_exchanges(gm.graph)

    def test_a_handle_from_elsewhere_is_refused(self):
        """The exchange in flight travels on the handle (comm/traced.py): a tensor the posting op
        did not return, or a handle used twice, is an error naming the op, not a silent hang."""
        group, x = dist.group.WORLD.group_name, torch.randn(1, 2, 4, 8)
        ops, none = torch.ops.dtensor_ring, []  # no kernel to come after
        with self.assertRaisesRegex(RuntimeError, "begin_exchange did not return"):
            ops.post_begun_exchange(torch.empty(0), none)
        begun = ops.begin_exchange([x], None, group, none)
        handle = ops.post_begun_exchange(begun, none)
        with self.assertRaisesRegex(RuntimeError, "or posted it twice"):
            ops.post_begun_exchange(begun, none)
        (received,) = ops.wait_exchange(handle, [x], "send_recv_next", 4, none)
        self.assertEqual(received.shape, x.shape)
        with self.assertRaisesRegex(RuntimeError, "post_exchange did not return .or waited"):
            ops.wait_exchange(handle, [x], "send_recv_next", 4, none)

    def test_the_pinned_copy_has_eager_strides(self):
        """``after_exchange`` (the pin of ``_order_kernels``) copies its input with the strides
        eager gives it. Inductor laid a computed LSE [1, H, S, 1] out with stride 0 in its size-1
        dims, and cuDNN's backward refused the copy that kept them (4 H200s, compiled windowed
        zigzag). The real op and its fake agree."""
        lse = torch.randn(8, 255)
        inductors = lse.as_strided((1, 8, 255, 1), (0, 255, 1, 0))
        handle = torch.empty(0)
        copy = torch.ops.dtensor_ring.after_exchange(inductors, handle)
        self.assertEqual(copy.stride(), (2040, 255, 1, 1))
        self.assertTrue(torch.equal(copy, lse[None, :, :, None]))
        with FakeTensorMode() as mode:
            fake = torch.ops.dtensor_ring.after_exchange(mode.from_tensor(inductors),
                                                         mode.from_tensor(handle))
        self.assertEqual(fake.stride(), copy.stride())
        # other strides are kept: a transposed input stays transposed
        t = torch.randn(1, 4, 6, 8).transpose(1, 2)  # (192, 8, 48, 1)
        self.assertEqual(torch.ops.dtensor_ring.after_exchange(t, handle).stride(), t.stride())

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

    def test_cache_key_names_the_source(self):
        # Inductor's on-disk cache outlives the process: an expansion traced by another version
        # of the code must not come back. The key hashes every file the expansion traces.
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
