"""A compact, stable rendering of a ring-expanded FX graph for expect tests.

One line per collective, wait and attention kernel, in graph order, with tensor shapes; the
elementwise and view ops between them (merges, slicing, casts) fold into one "(N ops)" line, so the
expectation pins what matters -- which exchange is posted before which block -- and not node names.
"""
import torch


def _shape(node):
    val = node.meta.get("val") if hasattr(node, "meta") else None
    return "x".join(map(str, val.shape)) if isinstance(val, torch.Tensor) else "?"


def _kind(node):
    name = str(node.target)
    if "_c10d_functional" in name:
        return "wait" if "wait_tensor" in name else "comm"
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
        tensors = [a for a in node.args if isinstance(a, torch.fx.Node)]
        shapes = ", ".join(_shape(a) for a in tensors)
        extra = [a for a in node.args if isinstance(a, (list, bool))]
        if kind == "comm":
            where = ""
            if groups:
                where = "".join(f" @{groups[a]}" for a in node.args
                                if isinstance(a, str) and a in groups)
            lines.append(f"{op}({shapes}{''.join(f', {e}' for e in extra)}){where}")
        elif kind == "wait":
            lines.append(f"wait({shapes})")
        else:
            causal = node.args[4] if len(node.args) > 4 else node.kwargs.get("is_causal", False)
            mask = node.kwargs.get("attn_mask")
            tag = "causal" if causal is True else "mask" if mask is not None else "full"
            lines.append(f"{op}({shapes}, {tag})")
    if folded:
        lines.append(f"  ({folded} ops)")
    return "\n".join(lines)
