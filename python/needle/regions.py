"""What a policy decided for each value, applied in one place, and what annotate learnt about it for later.

A policy answers, for each value of a region: keep it (True), drop it for backward to recompute (False), or put it
into a `Store` (store.py) when it leaves memory. `apply_decision` is the one place such an answer is written on a
node (its `drop` flag and its `store`). annotate also notes the region that made each value and why it is kept
(`note_region`, `note_reason`); `region_of` and `keep_reason` answer for print_saved_residuals, the DOT graph
(viz.py), the memory recorder and the planners. Weak, so a note never keeps a value alive. Its own module so that
the Budget and the toolbox's policies can apply and read decisions without importing checkpoint.py.
"""
import dataclasses
import itertools
import weakref

from .autograd import release
from .ledger import required_spec
from .store import Store

__all__ = ["Boundary", "HeldFor", "apply_decision", "keep_reason", "mark_boundaries", "new_region", "note_reason",
           "note_region", "reason_noted", "region_of", "region_structure", "stack_children"]

# Why an annotated node is kept ("boundary": a region's output; "checkpoint": chosen by the policy; "offloaded").
_reasons = weakref.WeakKeyDictionary()
# The innermost annotated region that made a node: (label, number), for the DOT graph's clusters.
_regions = weakref.WeakKeyDictionary()
_region_numbers = itertools.count()


def region_structure(nodes):
    """A region's key: its candidates' ops and shapes (what a replay of a policy's decisions must match)."""
    return tuple((type(n.op).__name__, tuple(required_spec(n)[0])) for n in nodes)


def new_region(label):
    """A new region's (label, number)."""
    return (label or "region", next(_region_numbers))


def note_region(node, region):
    """`node` belongs to `region` unless an inner region (annotated first) already claimed it."""
    _regions.setdefault(node, region)


def note_reason(node, reason):
    """Why annotate kept `node` (None: forget, as for a value it dropped)."""
    if reason is None:
        _reasons.pop(node, None)
    else:
        _reasons[node] = reason


def reason_noted(node):
    """The reason annotate noted for `node`, or None."""
    return _reasons.get(node)


def region_of(node):
    """(label, number) of the innermost annotated region that contains `node` (its output included), or None."""
    return _regions.get(node)


def keep_reason(node):
    """'leaf', 'boundary', 'checkpoint', 'dropped', 'not annotated' (no region covers the node), or its store's kind
    ('offloaded', 'compressed')."""
    if node.is_leaf():
        return "leaf"
    if node.store is not None:
        return node.store.kind
    if node.drop:
        return "dropped"
    return _reasons.get(node, "not annotated")


@dataclasses.dataclass(frozen=True)
class Boundary:
    """Where a value sits in a stack (`Value.boundary`): the stack's region number, the child (0, 1, ...) that made
    it. Dropped, it is rebuilt and held until its last use (`held_for` None: Chen's schedule), or held only when
    backward rebuilds child `held_for`'s output and let pass otherwise (a `HeldFor` answer: Revolve's snapshots)."""

    stack: int
    child: int
    held_for: object = None


@dataclasses.dataclass(frozen=True)
class HeldFor:
    """A stack's policy's answer for a boundary: drop it; hold it (a snapshot) when backward rebuilds child `child`'s
    output, and let it pass on any other way (backward.plan_backward)."""

    child: int


def mark_boundaries(candidates, stack):
    """A stack's candidates that are its children's outputs (annotate noted them "boundary") become its boundaries,
    numbered by child in the order the children ran (`stack`: the stack's region, from new_region)."""
    child_of = {}
    for node in candidates:
        if _reasons.get(node) == "boundary":
            child = child_of.setdefault(_regions.get(node), len(child_of))
            node.boundary = Boundary(stack[1], child)


def stack_children(candidates):
    """A stack's candidates grouped by the child that made them, its outputs only: [[positions], ...] in the order
    the children ran; [] where `candidates` are no stack's (no boundary among them)."""
    children = {}
    for i, node in enumerate(candidates):
        if node.boundary:
            children.setdefault(node.boundary.child, []).append(i)
    return [children[child] for child in sorted(children)]


def apply_decision(node, decision):
    """Write a policy's answer on `node`: True keeps it (a checkpoint); False drops it, recomputed in backward; a
    Store drops it into that store (one that does not accept the value — a view, say — drops it plainly); HeldFor
    drops a stack's boundary and writes when backward holds it (on its `boundary`). A dropped
    value is released now if it has been computed (eager mode; into its store first), else after its last forward
    consumer (lazy mode)."""
    if isinstance(decision, HeldFor):  # a stack's boundary, held in backward only when rebuilding that child
        if not node.boundary:
            raise TypeError(f"checkpoint policy: answered {decision!r} for a {type(node.op).__name__} value that is "
                            f"no stack's boundary (only a stack's children's outputs can be held for a child)")
        node.boundary = dataclasses.replace(node.boundary, held_for=decision.child)
        decision = False
    if not isinstance(decision, Store):
        if decision is None or isinstance(decision, str) or decision not in (True, False):
            raise TypeError(f"checkpoint policy: answered {decision!r} for a {type(node.op).__name__} value; a "
                            f"policy answers True (keep), False (recompute), a Store (checkpoint.OFFLOAD, a "
                            f"compress codec) or, for a stack's boundary, HeldFor(child)")
        decision = bool(decision)
        if decision:
            note_reason(node, "checkpoint")
            return
    elif not decision.accepts(node):
        decision = False
    node.drop = True
    node.store = decision or None
    note_reason(node, decision.kind if decision else None)
    release(node)
