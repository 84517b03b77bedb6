"""Expand each ring-attention node of a post-grad graph into its schedule's explicit steps.

``ring_attention`` (and the DTensor rule) put one node per attention into the graph,
``dtensor_ring::ring_attention_fwd`` or ``_bwd``. This pass replaces it with the schedule itself:
the same schedule code that runs eagerly, traced with ``make_fx`` over ``TracedComm``, so its
exchanges become post/wait op pairs around the eager exchanges (``comm/traced.py``), its blocks
the kernel's aten ops, and its fp32 merges plain elementwise ops that inductor fuses. Each
exchange is posted before the compute of the step it overlaps and waited on after it, as in eager.

Before (forward, zigzag, W = 4, rank 0):

    ring_attention_fwd = dtensor_ring.ring_attention_fwd(q, k, v, '0', 'zigzag', True, 0.25, ...)
    out = ring_attention_fwd[0];  lse = ring_attention_fwd[1]

After (abridged; ``tests/test_ring_expand.py`` pins rank 1's full sequence):

    kv_1 = dtensor_ring.begin_exchange([k, v], None, '0', [])                  # K/V for step 1
    attn = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)  # step 0 block
    kv_1p = dtensor_ring.post_begun_exchange(kv_1, [attn[0]])  # (NCCL posted at the begin)
    ... fp32 accumulator init (a copy of the block) ...
    k_1, v_1 = dtensor_ring.wait_exchange(kv_1p, [k, v], 'send_recv_next', 4, [])
    kv_2 = dtensor_ring.post_exchange([k_1, v_1], kv_1p, 'send_recv_next', '0', [])  # step 2's
    attn_1 = ...(q[S/2:], k_1, v_1, 0.0, False)                                  # step 1 block
    ... fp32 merge ... (and so on for steps 2 and 3; step 2's wait takes [attn_1])

A call with a sliding window (two ints of the node: a constant, so layers with the same window
share a graph) expands into the windowed exchange (``schedules/windowed.py``): per offset within
reach one ``send_recv`` post/wait pair (the K/V rows within reach straight to and from the ranks
at that offset); offsets no query reaches have no exchange at all (``tests/test_ring_expand.py``
counts them).

On a 2-D mesh the node is ``dtensor_ring::hybrid_attention_fwd`` / ``_bwd`` (no window) and both
levels expand: the all-to-all over heads as ``all_to_all`` post/wait pairs on the inner group,
then the outer schedule's steps as above on the outer group, per head piece
(``dtensor_ring/hybrid/schedule.py``; ``tests/test_ring_expand.py`` pins a 2 x 2 forward and
counts the backward's exchanges).

The rank and world size come from the process group named in the node, so the result is specific to
this process; ``RingExpandPass.uuid`` includes the global rank so the FX graph cache never hands one
rank's graph to another, and every process group's name and members: the node names its group,
and the same name stands for a group of another size in another run (two runs of one script on 2
and on 4 GPUs, with the same tokens per GPU, hand inductor the same graph, and the on-disk cache
handed the 4-GPU expansion to the 2-GPU run). It also includes the DTensor rule's registered
sequence schedules: the graph Dynamo hands over is the same whatever schedule the rule then
traces (it reads the registry below Dynamo), so without them the caches (AOTAutograd's and the
FX graph cache, in memory and on disk) would hand a graph traced under one schedule to a run
under another. And it includes a hash of the package's source (``source_key``): the on-disk cache
outlives the process, and handed a run of one version of the code the expansion another version
had traced (seen: a checkout of an older commit ran a newer commit's cached graph).
"""
import collections
import functools
import hashlib
import operator
from pathlib import Path

import torch
import torch.distributed as dist
from torch._guards import detect_fake_mode
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.decomposition import select_decomp_table
from torch.distributed.distributed_c10d import _world
from torch.fx.experimental.proxy_tensor import make_fx

from dtensor_ring import ops as runtime_ops
from dtensor_ring.call import RingCall
from dtensor_ring.dtensor.registry import sequence_schedules_key
from dtensor_ring.hybrid import ops as _hybrid_ops  # noqa: F401 - registers the hybrid's ops
from dtensor_ring.hybrid.comm import traced_comms

VERSION = "ring_expand-7"
COUNTERS: collections.Counter = collections.Counter()


# The nodes expanded: op -> (forward?, how many process-group names lead its options).
_TARGETS = {
    torch.ops.dtensor_ring.ring_attention_fwd.default: (True, 1),
    torch.ops.dtensor_ring.ring_attention_bwd.default: (False, 1),
    # the hybrid's (dtensor_ring/hybrid/ops.py): the ring's group, the all-to-all's, the whole
    # mesh's (for the agreement check at trace time only); its all-to-all expands too
    torch.ops.dtensor_ring.hybrid_attention_fwd.default: (True, 3),
    torch.ops.dtensor_ring.hybrid_attention_bwd.default: (False, 3),
}


def _schedule_fn(node, after):
    """The schedule call this node stands for, as a function of its tensor arguments (with
    packed documents, their boundaries follow: a graph input, not a constant; then the handles of
    ``after`` (process group name -> the last exchange posted on it before this node, a graph
    node), one per group that has one). It returns the schedule's results, then its own last
    handle for each group in ``posted`` (filled while it is traced) and that list."""
    forward, n_groups = _TARGETS[node.target]
    n_tensors = 3 if forward else 6
    tensors = list(node.args[:n_tensors])
    groups = node.args[n_tensors:n_tensors + n_groups]
    call, cu_seqlens = RingCall.from_op_args(groups, *node.args[n_tensors + n_groups:])
    exchanged = groups[:2]  # the ring's (and the all-to-all's); not the whole mesh's
    has_docs = cu_seqlens is not None
    chained = [g for g in exchanged if g in after]
    tensors += ([cu_seqlens] if has_docs else []) + [after[g] for g in chained]
    posted = []  # the groups whose last handles follow the results

    def run(*args):
        args = list(args)
        tokens = dict(zip(chained, args[len(args) - len(chained):]))
        del args[len(args) - len(chained):]
        docs = call.documents(args.pop() if has_docs else None)
        comm, per_group = traced_comms(exchanged, tokens)
        results = (call.forward if forward else call.backward)(comm, *args, docs=docs)
        posted[:] = [name for name, c in zip(exchanged, per_group) if c.last is not None]
        return (*results, *(c.last for c in per_group if c.last is not None))

    return tensors, run, posted


def _inline(graph, node, sub, tensors):
    """Copy ``sub``'s nodes in front of ``node``, its placeholders bound to ``tensors``."""
    env = dict(zip([n for n in sub.graph.nodes if n.op == "placeholder"], tensors))
    with graph.inserting_before(node):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                return [env[out] for out in n.args[0]]
            if n.op == "get_attr":
                raise RuntimeError(f"ring_expand: traced schedule holds a constant {n.target!r}")
            env[n] = graph.node_copy(n, lambda x: env[x])
    raise AssertionError("traced schedule has no output")


def _expand(graph, node, after) -> None:
    """Expand ``node``; ``after``: process group name -> the handle of the last exchange posted
    on it so far in the graph, updated with this node's."""
    tensors, fn, posted = _schedule_fn(node, after)
    example = [t.meta["val"] for t in tensors]
    with detect_fake_mode(example) or torch._subclasses.FakeTensorMode():
        # Inductor's own decompositions: a post-grad graph may only hold ops inductor lowers.
        sub = make_fx(torch.func.functionalize(fn), select_decomp_table())(*example)
    sub.graph.eliminate_dead_code()  # views the functionalised merges left unused
    results = _inline(graph, node, sub, tensors)
    for user in list(node.users):
        if user.target is not operator.getitem:
            raise RuntimeError(f"ring_expand: unexpected user {user.format_node()} of {node}")
        user.replace_all_uses_with(results[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)
    after.update(zip(posted, results[len(results) - len(posted):]))


def expand_ring_attention(graph: torch.fx.Graph) -> int:
    """Expand every ring-attention node of ``graph`` in place; returns how many were expanded.
    Every exchange on a process group is posted after the one before it in graph order, across
    nodes (``comm/traced.py``: inductor must not reorder them)."""
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.target in _TARGETS]
    if not nodes:
        COUNTERS["graphs_without_ring_attention"] += 1  # nothing of ours here: leave it untouched
        return 0
    backward_graph = any(not _TARGETS[n.target][0] for n in nodes)
    last_posted = {}  # process group name -> the handle of the last exchange posted on it
    for node in nodes:
        _expand(graph, node, last_posted)
        COUNTERS[f"expanded_{node.target.overloadpacket.__name__}"] += 1
        if backward_graph and _TARGETS[node.target][0]:
            # A ring forward in a backward graph: activation checkpointing's recompute, which
            # communicates again (zero under dr.save_ring_attention_context).
            COUNTERS["recomputed_ring_attention_fwd"] += 1
    _order_exchanges(graph)
    _order_kernels(graph)
    graph.lint()
    return len(nodes)


_POST = torch.ops.dtensor_ring.post_exchange.default
_BEGIN = torch.ops.dtensor_ring.begin_exchange.default
_BEGUN = torch.ops.dtensor_ring.post_begun_exchange.default
_POSTS = (_POST, _BEGIN, _BEGUN)  # each posts (part of) an exchange (comm/traced.py)
_WAIT = torch.ops.dtensor_ring.wait_exchange.default
# each exchange op's argument ``after_kernels`` (comm/traced.py): its position
_KERNELS = {op: [a.name for a in op._schema.arguments].index("after_kernels")
            for op in (*_POSTS, _WAIT)}


def _is_attention(node) -> bool:
    """An attention kernel's node: aten's SDPA and flash ops (not our own ops)."""
    name = str(node.target)
    return node.op == "call_function" and "dtensor_ring" not in name and any(
        word in name for word in ("scaled_dot_product", "flash", "attention"))


def _order_exchanges(graph: torch.fx.Graph) -> None:
    """Each exchange op after the compute that comes before it in graph order (the schedule's
    order, as eager runs it), through arguments that are only dependencies (``comm/traced.py``):
    inductor places a node anywhere its inputs allow.

    * A wait after the last post before it (``after_post``) and after every attention kernel
      since its own post (``after_kernels``): the blocks it was posted to overlap. Inductor's
      peak-memory reordering hoisted waits above them.
    * A post (``post_exchange``, ``begin_exchange``) after every kernel since the post before
      it. A post that reads only local tensors could otherwise go first: compiled llama3 posted
      every head group's all-gather at the start of its forward, all four in flight at once,
      and deferred the first groups' blocks below later waits (4 H200s, 8K tokens per GPU, 32/32
      heads: its forward took 1.4x eager's time).
    * ``post_begun_exchange`` after every kernel launched since its begin.

    Kernels a node already depends on (through any of their outputs) are left out. A kernel is
    handed over as its first output read (a tensor node)."""
    position, kernels, first, reads = {}, [], {}, {}  # reads: node -> the kernels it depends on
    last_post = None

    def order(node, since) -> None:
        missing = [first[k] for k in kernels
                   if position[k] > since and k not in reads[node] and k in first]
        if missing:
            node.update_arg(_KERNELS[node.target], missing)
            reads[node] = reads[node] | {m.args[0] for m in missing}

    for i, node in enumerate(graph.nodes):
        position[node] = i
        reads[node] = frozenset().union(*(reads[a] for a in node.all_input_nodes))
        if _is_attention(node):
            kernels.append(node)
            reads[node] = reads[node] | {node}
        elif node.target is operator.getitem and _is_attention(node.args[0]):
            first.setdefault(node.args[0], node)
        elif node.target is _WAIT:
            posted = node.args[0]
            if last_post is not posted:
                node.update_kwarg("after_post", last_post)
                reads[node] = reads[node] | reads[last_post]
            order(node, position[posted])
        elif node.target is _BEGUN:
            order(node, position[node.args[0]])
            last_post = node
        elif node.target in _POSTS:
            order(node, -1 if last_post is None else position[last_post])
            last_post = node


_AFTER = torch.ops.dtensor_ring.after_exchange.default


def _lse_argument(node):
    """The index of a backward attention kernel's LSE argument (None: not such a kernel)."""
    if not (_is_attention(node) and "backward" in str(node.target)):
        return None
    names = [a.name for a in node.target._schema.arguments]
    index = names.index("logsumexp") if "logsumexp" in names else None
    return index if index is not None and index < len(node.args) else None


def _order_kernels(graph: torch.fx.Graph) -> None:
    """Each backward attention kernel after the last post before it in graph order (the
    schedule's order), where nothing it reads depends on that post: its LSE argument is handed to
    it through ``after_exchange`` (``comm/traced.py``). Inductor's peak-memory reordering moves
    such a kernel (the backward's late own blocks) above the post otherwise."""
    latest = {}  # node -> the graph position of the latest post it depends on (-1: none)
    last_post = None
    for i, node in enumerate(list(graph.nodes)):
        depends = max((latest.get(a, -1) for a in node.all_input_nodes), default=-1)
        if node.target in _POSTS:
            latest[node], last_post = i, node
            continue
        lse = _lse_argument(node)
        if lse is not None and last_post is not None and depends < latest[last_post]:
            with graph.inserting_before(node):
                ordered = graph.call_function(_AFTER, (node.args[lse], last_post))
            ordered.meta["val"] = node.args[lse].meta["val"]
            node.update_arg(lse, ordered)
            depends = latest[last_post]
        latest[node] = depends


class RingExpandPass(CustomGraphPass):
    """``expand_ring_attention`` as an inductor custom pass (see ``install``)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        expand_ring_attention(graph)

    def uuid(self):
        rank = dist.get_rank() if dist.is_initialized() else -1
        return (f"{VERSION}-rank{rank}-{process_groups_key()}-{sequence_schedules_key()}-"
                f"{source_key()}")


@functools.cache
def source_key(roots=None) -> str:
    """A hash of every Python file under ``roots`` (default: the runtime package and these
    passes): what the expansion traces, so a change to any of it is a new cache key."""
    if roots is None:
        roots = (Path(runtime_ops.__file__).parent, Path(__file__).parent)
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def process_groups_key() -> str:
    """Every process group of this process, as text: its name and its members' global ranks."""
    groups = sorted((name, tuple(sorted(_world.pg_group_ranks.get(group, {}))))
                    for group, name in _world.pg_names.items())
    return hashlib.sha256(repr(groups).encode()).hexdigest()[:16]
