"""Reading a ring-expanded FX graph in tests (tests/test_ring_expand.py).

* ``check_exchanges``: what every expansion must hold -- on each process group the posts chained
  in graph order (each takes the previous one's handle: inductor cannot reorder them), every post
  waited on exactly once, its wait holding the tensors sent (their last use: no buffer reuse
  while in flight) and, as dependencies that keep inductor from hoisting it, the last post before
  it in graph order where that is another (``after_post``); every wait after (reading, directly
  or not) each attention kernel between its post and it, every post after each kernel since the
  post before it; and every backward attention kernel after the last post before it in graph
  order, through what it reads (else inductor may move it above that post). A shift or windowed
  exchange begun before a step's kernels (``begin_exchange``) is posted
  (``post_begun_exchange``) next on its group, after those kernels.
* ``render``: the whole graph, one line per exchange posted or begun (its kind, the shapes
  sent), begun exchange's second half ("posted"), wait (the shapes received) and attention
  kernel (query and key shapes, its mask), in graph order; each line ends with the number of
  other ops (merges, slicing, casts) that follow it. Pins which exchange is posted before which
  block, not node names.
* ``counts``: the same graph in numbers: exchanges by kind (send_recv: +offset; @group where
  named), the elements they send, how many have an attention kernel between post and wait
  (overlapped), kernels by mask, the attention scores they compute (query rows x keys, summed),
  all ops; ``count_table``: one row of them per graph.
"""
import collections

import torch

import dtensor_ring  # noqa: F401 - registers the ops

POST = torch.ops.dtensor_ring.post_exchange.default
BEGIN = torch.ops.dtensor_ring.begin_exchange.default  # a shift posted in two halves: its first
BEGUN = torch.ops.dtensor_ring.post_begun_exchange.default  # and its second
WAIT = torch.ops.dtensor_ring.wait_exchange.default
AFTER = torch.ops.dtensor_ring.after_exchange.default


def _arg(node, name, default=None):
    """Argument ``name`` of an op's call, by its schema."""
    for i, argument in enumerate(node.target._schema.arguments):
        if argument.name == name:
            return node.args[i] if i < len(node.args) else node.kwargs.get(name, default)
    return default


def _shape(node):
    val = node.meta.get("val")
    return "x".join(map(str, val.shape)) if isinstance(val, torch.Tensor) else "?"


def is_kernel(node) -> bool:
    name = str(node.target)
    return (node.op == "call_function" and "dtensor_ring" not in name
            and ("scaled_dot_product" in name or "flash" in name or "attention" in name))


def _mask(kernel) -> str:
    if _arg(kernel, "is_causal", False) is True:
        return "causal"
    return "mask" if _arg(kernel, "attn_mask") is not None else "full"


def _group(post, groups) -> str:
    name = _arg(post, "group_name")
    return f"@{groups[name]}" if groups and name in groups else ""


def _kind(post) -> str:
    """The exchange's kind (a begun exchange's: a ring shift unless it says otherwise)."""
    return _arg(post, "kind", "send_recv_next") if post.target is BEGIN else post.args[2]


def _label(post, groups) -> str:
    """``kind``, then ``+offset`` (send_recv: to rank + offset), then ``@group`` if named."""
    offset = _arg(post, "offset", 0)
    return f"{_kind(post)}{f'{offset:+d}' if offset else ''}{_group(post, groups)}"


def check_exchanges(graph: torch.fx.Graph) -> list:
    """Raise AssertionError where an exchange breaks the rules above; return (post, wait) pairs
    in the order posted (a begun exchange's post: its ``begin_exchange``)."""
    last, pairs = {}, []  # group name -> the handle its next post must be chained after
    latest, kernels, position = None, [], {}  # the last post; the attention kernels so far
    depends = {}  # node -> the position of the latest post it reads through its inputs (-1)
    reads = {}  # node -> the attention kernels it reads, directly or not

    def after_kernels(node, since, what):
        missed = [k for k in kernels if position[k] > position[since] and k not in reads[node]]
        assert not missed, f"{node} ({what}) does not come after kernels {missed}"

    for i, node in enumerate(graph.nodes):
        position[node] = i
        depends[node] = i if node.target in (POST, BEGIN, BEGUN) else max(
            (depends.get(a, -1) for a in node.all_input_nodes), default=-1)
        reads[node] = frozenset().union(*(reads[a] for a in node.all_input_nodes))
        if is_kernel(node):
            if "backward" in str(node.target) and latest is not None:
                assert depends[node] >= position[latest], (
                    f"{node} does not depend on {latest}, the last post before it")
            kernels.append(node)
            reads[node] = reads[node] | {node}
        if node.target is WAIT:
            posted = node.args[0]
            assert posted.target in (POST, BEGUN), f"{node} waits on {posted}, not a post"
            want = None if latest is posted else latest
            assert _arg(node, "after_post") is want, (
                f"{node} waits after {_arg(node, 'after_post')}, not after {want}, the last post")
            after_kernels(node, posted, "a wait: the kernels since its post")
        if node.target is BEGUN:
            begun = node.args[0]
            assert begun.target is BEGIN, f"{node} posts {begun}, not a begun exchange"
            group = _arg(begun, "group_name")
            assert last.get(group) is begun, f"{node} is not the next post after {begun}"
            after_kernels(node, begun, "a begun exchange's post: the kernels since its begin")
            latest = last[group] = node
        if node.target not in (POST, BEGIN):
            continue
        if latest is not None:
            after_kernels(node, latest, "a post: the kernels since the post before it")
        latest = node
        group = _arg(node, "group_name")
        assert node.args[1] is last.get(group), (
            f"{node} is not chained after {last.get(group)}, the last post on group {group}")
        last[group] = handle = node
        if node.target is BEGIN:
            (handle,) = [u for u in node.users if u.target is BEGUN]
        for used in {node, handle}:
            others = [u for u in used.users
                      if not (u.target in (WAIT, BEGUN)
                              and (u.args[0] is used or _arg(u, "after_post") is used))
                      and not (u.target in (POST, BEGIN) and u.args[1] is used)
                      and u.target is not AFTER]
            assert not others, f"{used}'s handle used by {others}"
        waits = [u for u in handle.users if u.target is WAIT and u.args[0] is handle]
        assert len(waits) == 1, f"{node} is waited on {len(waits)} times"
        (wait,) = waits
        assert wait.args[2] == _kind(node), f"{wait} waits a {wait.args[2]}, not {_kind(node)}"
        assert list(wait.args[1]) == list(node.args[0]), f"{wait} holds not what {node} sent"
        pairs.append((node, wait))
    return pairs


def render(graph: torch.fx.Graph, groups: dict | None = None) -> str:
    """``groups``: process-group name -> label, shown after each exchange on that group."""
    check_exchanges(graph)
    lines = [["", 0]]  # [event, ops that follow it]; the first: the ops before any event
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in (POST, BEGIN):
            sent = ", ".join(_shape(t) for t in node.args[0])
            offset = _arg(node, "offset", 0)
            sent += f", offset {offset}" if offset else ""
            lines.append([f"{_kind(node)}({sent}) {_group(node, groups)}".strip(), 0])
        elif node.target is BEGUN:
            lines.append(["posted", 0])
        elif node.target is WAIT:
            received = ", ".join("x".join(map(str, v.shape)) for v in node.meta["val"])
            lines.append([f"wait({received})", 0])
        elif is_kernel(node):
            q, k, v = (_arg(node, name) for name in ("query", "key", "value"))
            assert _shape(v) == _shape(k), f"{node}: value {_shape(v)}, key {_shape(k)}"
            op = "attn_bwd" if "backward" in str(node.target) else "attn"
            lines.append([f"{op}(q {_shape(q)}, k {_shape(k)}, {_mask(node)})", 0])
        else:
            lines[-1][1] += 1
    return "\n".join(f"{event:<42} +{ops} ops".strip() if ops else event
                     for event, ops in lines if event or ops)


def counts(graph: torch.fx.Graph, groups: dict | None = None) -> dict:
    """The graph in numbers (see the module docstring), after ``check_exchanges``."""
    pairs = check_exchanges(graph)
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    order = {n: i for i, n in enumerate(nodes)}
    kernels = [n for n in nodes if is_kernel(n)]
    return {
        "exchanges": dict(sorted(collections.Counter(_label(p, groups) for p, _ in pairs).items())),
        "sent": sum(t.meta["val"].numel() for post, _ in pairs for t in post.args[0]),
        "overlapped": sum(any(order[post] < order[k] < order[wait] for k in kernels)
                          for post, wait in pairs),
        "kernels": {mask: sum(_mask(k) == mask for k in kernels)
                    for mask in ("causal", "full", "mask")},
        "scores": sum(_arg(k, "query").meta["val"].shape[:-1].numel()
                      * _arg(k, "key").meta["val"].shape[-2] for k in kernels),
        "ops": len(nodes),
    }


def count_table(graphs: dict) -> str:
    """``graphs``: a name -> (graph, groups); one row of ``counts`` each."""
    rows = [("", "exchanges", "sent", "overlap", "causal", "full", "mask", "scores", "ops")]
    for name, (graph, groups) in graphs.items():
        c = counts(graph, groups)
        exchanges = ", ".join(f"{kind} {n}" for kind, n in c["exchanges"].items())
        rows.append((name, exchanges, c["sent"], c["overlapped"], *c["kernels"].values(),
                     c["scores"], c["ops"]))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(" ".join(f"{cell:<{w}}" if i < 2 else f"{cell:>{w}}"
                              for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
                     for row in rows)
