"""What annotate learnt about each value: the region that made it and why it is kept, for the questions asked later.

`checkpoint.annotate` notes them (`note_region`, `note_reason`); `region_of` and `keep_reason` answer them for
print_saved_residuals, the DOT graph (viz.py), the memory recorder and the planners (checkpoint_optimal groups a
graph's values by region). Weak, so a note never keeps a value alive. Its own module so that the planners can read
it without importing checkpoint.py (which imports them).
"""
import itertools
import weakref

from . import offload
from .ledger import required_spec

__all__ = ["keep_reason", "new_region", "note_reason", "note_region", "reason_noted", "region_of", "region_structure"]

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
    """'leaf', 'boundary', 'checkpoint', 'offloaded', 'compressed', 'dropped' or 'not annotated' (no region covers
    the node)."""
    if node.is_leaf():
        return "leaf"
    if offload.is_compressed(node):
        return "compressed"
    if offload.is_marked(node):
        return "offloaded"
    if node.drop:
        return "dropped"
    return _reasons.get(node, "not annotated")
