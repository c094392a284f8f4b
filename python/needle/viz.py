"""Graphviz DOT text of a graph, so a student can see what checkpointing keeps, drops and recomputes.

    print(needle.viz.to_dot(loss))   # paste into `dot -Tpng` or any Graphviz viewer

Kept values are solid boxes, dropped ones dashed grey, dropped values that backward recomputes orange (read
off the backward plan of this very graph, so the marking cannot go stale), leaves (parameters, inputs,
constants) green ellipses.
"""
from . import checkpoint
from .autograd import find_topo_sort, plan_backward

__all__ = ["to_dot"]

_STYLES = {
    "leaf": 'shape=ellipse, style=filled, fillcolor="#d9f2d9"',
    "kept": 'shape=box, style=filled, fillcolor="#dde8f7"',
    "dropped": 'shape=box, style="dashed,filled", fillcolor="#eeeeee", color="#888888"',
    "recomputed": 'shape=box, style="filled,bold", fillcolor="#ffcc80", color="#e65100"',
}


def node_kind(node, recomputed_ids=frozenset()):
    """'leaf', 'recomputed', 'dropped' or 'kept' (the reason a value is or is not in memory)."""
    if node.is_leaf():
        return "leaf"
    if id(node) in recomputed_ids:
        return "recomputed"
    return "dropped" if node.drop else "kept"


def _label(node, kind):
    reason = checkpoint.keep_reason(node)
    return kind if kind != "kept" else f"kept ({reason})"


def to_dot(tensor, name="needle"):
    """DOT text for the graph above `tensor` (a Tensor or a list of them)."""
    roots = list(tensor) if isinstance(tensor, (list, tuple)) else [tensor]
    # What backward recomputes: the plan's recomputations when only leaves and kept values exist.
    recomputed = {id(n) for r in roots if r.requires_grad
                  for n in plan_backward(r, lambda n: n.is_leaf() or not n.drop).recomputed()}
    order = find_topo_sort(roots)
    number = {id(n): i for i, n in enumerate(order)}
    lines = [f"digraph {name} {{", "  rankdir=BT;", '  node [fontname="Helvetica", fontsize=10];']
    for node in order:
        kind = node_kind(node, recomputed)
        label = "leaf" if node.is_leaf() else type(node.op).__name__
        shape = node._spec[0] if node.cached_data is None and node._spec else getattr(node.cached_data, "shape", "")
        shape_text = tuple(shape) if shape != "" else ""
        lines.append(f'  n{number[id(node)]} [label="{label}\\n{shape_text}\\n{_label(node, kind)}", '
                     f"{_STYLES[kind]}];")
    for node in order:
        for inp in node.inputs:
            lines.append(f"  n{number[id(inp)]} -> n{number[id(node)]};")
    lines.append("}")
    return "\n".join(lines) + "\n"
