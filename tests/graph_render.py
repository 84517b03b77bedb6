"""A compact, stable rendering of a ring-expanded FX graph for expect tests.

One line per exchange posted (its kind and the shapes sent), wait (the shapes received) and
attention kernel, in graph order, with tensor shapes; the elementwise and view ops between them (merges, slicing, casts) fold into one "(N ops)" line, so the
expectation pins what matters -- which exchange is posted before which block -- and not node names.
"""
import torch


def _shape(node):
    val = node.meta.get("val") if hasattr(node, "meta") else None
    return _shape_of(val) if isinstance(val, torch.Tensor) else "?"


def _shape_of(val):
    return "x".join(map(str, val.shape))


def _arg(node, name, default=None):
    """Argument ``name`` of an op's call, by its schema."""
    for i, argument in enumerate(node.target._schema.arguments):
        if argument.name == name:
            return node.args[i] if i < len(node.args) else node.kwargs.get(name, default)
    return default


def _kind(node):
    name = str(node.target)
    if "_exchange" in name:
        return "wait" if "wait_" in name else "comm"
    if "scaled_dot_product" in name or "flash" in name or "attention" in name:
        return "attn"
    return None


def render(graph: torch.fx.Graph, groups: dict | None = None) -> str:
    """``groups``: process-group name -> label, shown after each collective on that group."""
    lines, folded = [], 0
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        kind = _kind(node)
        if kind is None:
            folded += 1
            continue
        if folded:
            lines.append(f"  ({folded} ops)")
            folded = 0
        op = node.target.__name__.split(".")[0]
        if kind == "comm":  # post_exchange(tensors, after, kind, group): the kind, shapes sent
            sent = ", ".join(_shape(a) for a in node.args[0])
            offset = node.args[4] if len(node.args) > 4 else node.kwargs.get("offset", 0)
            where = f" @{groups[node.args[3]]}" if groups and node.args[3] in groups else ""
            # send_recv (sliding windows): to rank + offset, from rank - offset
            lines.append(f"{node.args[2]}({sent}{f', offset {offset}' if offset else ''}){where}")
        elif kind == "wait":  # wait_exchange(...) -> the tensors received
            lines.append(f"wait({', '.join(_shape_of(v) for v in node.meta['val'])})")
        else:
            shapes = ", ".join(_shape(a) for a in node.args if isinstance(a, torch.fx.Node))
            causal = _arg(node, "is_causal", False)  # the backward's is its 8th argument
            mask = _arg(node, "attn_mask")
            tag = "causal" if causal is True else "mask" if mask is not None else "full"
            lines.append(f"{op}({shapes}, {tag})")
    if folded:
        lines.append(f"  ({folded} ops)")
    return "\n".join(lines)
