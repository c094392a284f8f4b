"""Graphviz DOT text of a graph, so a student can see what checkpointing keeps, drops and recomputes.

    open("graph.dot", "w").write(needle.viz.to_dot(loss))
    # then, in a shell (Graphviz):  dot -Tpng graph.dot -o graph.png     or paste it into any DOT viewer

Kept values are solid boxes, dropped ones dashed grey, dropped values that backward recomputes orange (read off the
backward plan of this very graph, so the marking cannot go stale), values a store holds (store.py) by the store's
kind: offloaded ones (parked in host memory, fetched back for backward) purple double octagons, leaves (parameters,
inputs, constants) green ellipses (bold-edged: parameters the optimizer updates inside backward, the step of the
plan that releases their gradient), values kept compressed (compress.py) rounded yellow boxes; a legend repeats this.
Each node shows its op (a parameter: its name), shape and bytes. The nodes of one annotated region (a module's
forward when checkpointing is on, a `checkpoint()` call) are boxed together under the module's class name.
`hide_views=True` leaves out view nodes (reshape, broadcast, transpose: no buffer of their own) and draws their
inputs straight to their consumers.
"""
from . import checkpoint
from .autograd import find_topo_sort, infer_spec, spec_nbytes
from .backward import plan_backward

__all__ = ["to_dot"]

_STYLES = {
    "leaf": 'shape=ellipse, style=filled, fillcolor="#d9f2d9"',
    "updated": 'shape=ellipse, style="filled,bold", fillcolor="#d9f2d9", color="#1b5e20", penwidth=2',
    "kept": 'shape=box, style=filled, fillcolor="#dde8f7"',
    "dropped": 'shape=box, style="dashed,filled", fillcolor="#eeeeee", color="#888888"',
    "recomputed": 'shape=box, style="filled,bold", fillcolor="#ffcc80", color="#e65100"',
    "offloaded": 'shape=doubleoctagon, style=filled, fillcolor="#e1d5f0", color="#6a3d9a"',
    "compressed": 'shape=box, style="rounded,filled,bold", fillcolor="#fff3b0", color="#b8860b"',
    "stored": 'shape=box, style="rounded,filled", fillcolor="#e1d5f0"',
}
_LEGEND = {
    "leaf": "leaf: parameter, input, constant",
    "updated": "parameter updated inside backward",
    "kept": "kept for backward",
    "dropped": "dropped, not needed again",
    "recomputed": "dropped, recomputed in backward",
    "offloaded": "offloaded to host memory, fetched for backward",
    "compressed": "kept compressed (k-bit codes), rebuilt for backward",
}  # (a store of another kind is drawn as "stored": not in the legend)


def node_kind(node, recomputed_ids=frozenset(), updated_ids=frozenset()):
    """'leaf', 'updated', 'compressed', 'offloaded', 'recomputed', 'dropped' or 'kept' (the reason a value is or is
    not in memory)."""
    if node.is_leaf():
        return "updated" if id(node) in updated_ids else "leaf"
    if node.store is not None:
        return node.store.kind if node.store.kind in _STYLES else "stored"
    if id(node) in recomputed_ids:
        return "recomputed"
    return "dropped" if node.drop else "kept"


def _label(node, kind):
    if node.store is not None:  # the bytes its store keeps (a compressed value's codes), beside the full value's
        spec = infer_spec(node)
        kept = "?" if spec is None else _human(node.store.device_bytes(spec) + node.store.host_bytes(spec))
        return f"{kind}{node.store.detail()}: {kept}"
    reason = checkpoint.keep_reason(node)
    return kind if kind != "kept" else f"kept ({reason})"


def _size(node):
    """Shape text and bytes of a node's value, from shape inference (nothing is computed); '?' if unknown."""
    spec = infer_spec(node)
    if spec is None:
        return "?", "?"
    return str(tuple(spec[0])), _human(spec_nbytes(spec))  # a tuple op's: its elements' summed


def _human(nbytes):
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes} B" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024


def _sources(node, hidden):
    """`node`'s inputs, looking through hidden view nodes to the values they view."""
    sources, stack = [], list(reversed(node.inputs))
    while stack:
        x = stack.pop()
        if id(x) in hidden:
            stack.extend(reversed(x.inputs))
        else:
            sources.append(x)
    return sources


def to_dot(tensor, name="needle", hide_views=False):
    """DOT text for the graph above `tensor` (a Tensor or a list of them); see the module's docstring."""
    roots = list(tensor) if isinstance(tensor, (list, tuple)) else [tensor]
    # What backward recomputes: the plan's recomputations when only leaves and kept values exist.
    plans = [plan_backward(r, lambda n: n.is_leaf() or not n.drop, lambda n: n.store is not None)
             for r in roots if r.requires_grad]
    recomputed = {id(n) for plan in plans for n in plan.recomputed()}
    updated = {id(n) for plan in plans for n in plan.updated()}
    order = find_topo_sort(roots)
    root_ids = {id(r) for r in roots}
    hidden = {id(n) for n in order if hide_views and n.op is not None and n.op.view and id(n) not in root_ids}
    shown = [n for n in order if id(n) not in hidden]
    number = {id(n): i for i, n in enumerate(shown)}
    lines = [f"digraph {name} {{", "  rankdir=BT;", '  node [fontname="Helvetica", fontsize=10];']
    for node in shown:
        kind = node_kind(node, recomputed, updated)
        title = getattr(node, "name", None) or ("leaf" if node.is_leaf() else type(node.op).__name__)
        shape, nbytes = _size(node)
        status = "" if title == kind else f"\\n{_label(node, kind)}"
        lines.append(f'  n{number[id(node)]} [label="{title}\\n{shape}\\n{nbytes}{status}", {_STYLES[kind]}];')
    for node in shown:
        for src in _sources(node, hidden):
            lines.append(f"  n{number[id(src)]} -> n{number[id(node)]};")
    # One cluster per annotated region; a node listed in a cluster is drawn inside it.
    regions = {}
    for node in shown:
        region = checkpoint.region_of(node)
        if region is not None:
            regions.setdefault(region, []).append(f"n{number[id(node)]}")
    for (label, serial), members in regions.items():
        lines.append(f'  subgraph cluster_{serial} {{ label="{label}"; style=rounded; color="#9e9e9e"; '
                     f"{'; '.join(members)}; }}")
    lines.append('  subgraph cluster_legend { label="legend"; color="#bbbbbb";')
    for kind, text in _LEGEND.items():
        lines.append(f'    legend_{kind} [label="{text}", {_STYLES[kind]}];')
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"
