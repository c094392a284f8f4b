"""Gradient checkpointing: keep fewer activations after the forward pass, recompute them during backward.

Training keeps every intermediate value of the forward pass alive until backward has used it; for a deep
network that is most of the memory of a step. Checkpointing trades compute for memory (Chen et al. 2016,
"Training Deep Nets with Sublinear Memory Cost"): nodes marked `drop` are not kept after the forward pass, and
backward recomputes them from their nearest kept ancestors (the checkpoints) just before it needs them.

    model.enable_gc(policy="sqrt")        # or segment_len=4, policy="selective", policy=Budget(64 << 20)
    loss = loss_fn(model(x), y)           # layers call annotate() on their interior as they run
    loss.backward()                       # dropped values are recomputed here, each at most once
    checkpoint.last_backward_stats()      # {"recomputed_nodes": ..., "released_bytes": ..., ...}

This file decides *what* is dropped: `annotate` and the policies. Backward itself (what to recompute before
each step, when each value dies) is autograd's plan, which treats a dropped value as a missing one; the memory
budget planner is `checkpoint_budget.Budget`.

The rules (enforced where noted; each test names the rule it checks):

  Rule 1. Leaves (parameters, constants, dropout masks), the inputs and output of an annotated region, and the
          output of a backward pass are never dropped or released (`annotate`, `autograd.plan_backward`).
  Rule 2. During one backward pass, a dropped or released value is recomputed at most once: recomputed values
          stay alive until their last use in that pass (`autograd.plan_backward` plans it; tests assert it on
          the plan).
  Rule 3. Every activation, dropped or not, is released after its last use: in the forward pass for dropped
          values (eager: as soon as the region's output exists; lazy: after its last consumer is computed), and
          in backward for every value after the last gradient that reads it. Gradient-graph temporaries are
          released after the step that made them (`autograd._realize`, `autograd.run_backward`).
  Rule 4. Recomputation and differentiation are exact (`autograd.Compute`):
          (a) a recomputed value has the shape, dtype and device it had in the forward pass (checked every time);
          (b) eager and lazy mode give bit-identical numbers;
          (c) backward reads what the forward pass read. Every value has a version, bumped by each in-place write
              (`.data =`, an optimizer's update, `t[idx] = ...`); each node records the versions of the inputs
              its forward computation read. Before a gradient reads forward values (`Op.saves`) and before a
              dropped value is recomputed from its inputs, the versions are compared, and a mismatch raises
              RuntimeError — with checkpointing off too (a MatMul's gradient reads its weight).
  Rule 5. When backward returns, every leaf gradient is realized, so an optimizer that updates parameters in
          place can never change a value a gradient still depends on.
"""
import math
import weakref
from dataclasses import dataclass

from .autograd import find_topo_sort, infer_spec, itemsize, last_backward_stats, release
from .checkpoint_budget import Budget

__all__ = [
    "Budget",
    "EverySegment",
    "Sqrt",
    "annotate",
    "dots_saveable",
    "keep_reason",
    "last_backward_stats",
    "nothing_saveable",
    "resolve_policy",
    "saved_residuals",
]


# ----- policies: small pure functions from the candidate nodes of a region to keep/drop flags ------------------
def nothing_saveable(nodes):
    """Drop every candidate ("all")."""
    return [False] * len(nodes)


def dots_saveable(nodes):
    """Keep what is expensive to recompute (matmul, conv: `Op.saveable`); drop the cheap rest ("selective")."""
    return [n.op.saveable for n in nodes]


@dataclass(frozen=True)
class EverySegment:
    """Keep every k-th candidate as a checkpoint (`segment_len=k`)."""

    k: int

    def __call__(self, nodes):
        return [(i + 1) % self.k == 0 for i in range(len(nodes))]


@dataclass(frozen=True)
class Sqrt:
    """Chen's O(sqrt n) schedule: the region's n candidates in segments of k = ceil(sqrt n), one checkpoint each.

    The region's output is kept anyway (rule 1) and ends the last segment, so only the first ceil(n/k) - 1
    segments get a checkpoint: a region of 2 candidates gets none, one of 16 gets 3. Within a segment it
    prefers a cut (no edge between candidates jumps over it, so backward recomputes the segments on either
    side separately), then the value that costs least to keep, then the last. A view of a leaf (a parameter's
    reshape or broadcast) is free to recompute and bounds nothing, so it is never chosen, and its edges do not
    break cuts. Sizes come from shape inference, so a lazy graph is not computed to choose.
    """

    def __call__(self, nodes):
        k = max(1, math.ceil(math.sqrt(len(nodes))))
        cost = [_keep_cost(n) for n in nodes]
        position = {id(n): i for i, n in enumerate(nodes)}
        last_consumer = list(range(len(nodes)))  # nodes come in topological order
        for i, n in enumerate(nodes):
            for x in n.inputs:
                if id(x) in position and cost[position[id(x)]] > 0:
                    last_consumer[position[id(x)]] = i
        cut, reach = [], -1  # reach: the furthest consumer of any earlier candidate
        for i in range(len(nodes)):
            cut.append(reach <= i)
            reach = max(reach, last_consumer[i])
        keep = [False] * len(nodes)
        for start in range(0, len(nodes) - k, k):  # every segment but the last, which the output closes
            segment = [i for i in range(start, start + k) if cost[i] > 0]
            if segment:
                keep[min(segment, key=lambda i: (not cut[i], cost[i], -i))] = True
        return keep


def _keep_cost(node):
    """Bytes that keeping `node` holds: a view holds its base, a view of a leaf nothing new (unknown: inf)."""
    while node.op is not None and node.op.view:
        node = node.inputs[0]
    if node.is_leaf():
        return 0
    spec = infer_spec(node)
    if spec is None or (spec[0] and isinstance(spec[0][0], tuple)):
        return math.inf
    return math.prod(spec[0]) * itemsize(spec[1])


_POLICIES = {None: nothing_saveable, "all": nothing_saveable, "sqrt": Sqrt(), "selective": dots_saveable}


def resolve_policy(policy=None, segment_len=None):
    """The callable for a policy name, a segment length, or a callable policy itself."""
    if callable(policy):
        return policy
    if policy not in _POLICIES:
        raise ValueError(f"unknown checkpoint policy {policy!r}; use None, 'all', 'sqrt', 'selective', "
                         f"Budget(bytes) or a callable")
    if segment_len is not None and policy in (None, "all"):
        if int(segment_len) < 1:
            raise ValueError(f"segment_len must be >= 1, got {segment_len}")
        return EverySegment(int(segment_len))
    return _POLICIES[policy]


def annotate(out_node, in_nodes, segment_len=None, policy=None):
    """Mark the nodes strictly between `in_nodes` and `out_node` as dropped, except the policy's checkpoints.

    Trade-off: every dropped node saves its bytes between the forward pass and its use in backward, and costs
    one recomputation during backward. `segment_len=k` keeps every k-th node as a checkpoint; `policy`
    ("sqrt", "selective", a Budget or any callable nodes -> keep flags) chooses checkpoints otherwise.
    Rule 1: leaves, `in_nodes` and `out_node` are never dropped. A node once dropped stays dropped, so nested
    regions compose (the inner region decides first). Eager mode releases the dropped values at once (the
    region's output exists); lazy mode releases them as they are consumed.

        x = ndl.Tensor(...); h = ops.relu(x @ w); y = h @ v
        annotate(y, [x])           # x @ w and relu(...) are recomputed in backward
    """
    outs = list(out_node) if isinstance(out_node, (list, tuple)) else [out_node]
    stop = {id(n) for n in in_nodes}
    boundary = stop | {id(n) for n in outs}
    order = find_topo_sort(outs, expand=lambda n: id(n) not in stop)
    candidates = [n for n in order if id(n) not in boundary and not n.is_leaf() and not n.drop]
    policy = resolve_policy(policy, segment_len)
    keep = policy(candidates, outs) if isinstance(policy, Budget) else policy(candidates)
    for node, kept in zip(candidates, keep):
        if kept:
            _reasons[node] = "checkpoint"
        else:
            node.drop = True
            _reasons.pop(node, None)
            release(node)
    for node in outs:
        _reasons[node] = "boundary"
    return out_node


# Why an annotated node is kept ("boundary": a region's output; "checkpoint": chosen by the policy). Read by
# keep_reason/saved_residuals and the DOT graph; weak, so it never keeps a node alive.
_reasons = weakref.WeakKeyDictionary()


def keep_reason(node):
    """'leaf', 'boundary', 'checkpoint', 'dropped' or 'not annotated' (no region covers the node)."""
    if node.is_leaf():
        return "leaf"
    if node.drop:
        return "dropped"
    return _reasons.get(node, "not annotated")


def _buffer(data):
    """The buffer under a value and its bytes: views share one (an NDArray's handle, a numpy array's base)."""
    handle = getattr(data, "_handle", None)
    if handle is not None:
        return handle, handle.size * itemsize(data.dtype)
    base = data
    while getattr(base, "base", None) is not None:
        base = base.base
    return base, int(base.nbytes)


def saved_residuals(root, exclude=()):
    """The buffers held in memory by the graph above `root`, one (node, reason, bytes) per buffer.

    Like JAX's print_saved_residuals: what is kept for backward, and why. Views of one buffer count once, at
    the buffer's size (a broadcast view costs what its base costs);
    `exclude` (e.g. parameters and the batch) are left out.
    """
    seen = {id(_buffer(n.cached_data)[0]) for n in exclude if n.cached_data is not None}  # and views of them
    rows = []
    for node in find_topo_sort([root]):
        data = node.cached_data
        if data is None or isinstance(data, tuple):
            continue
        buffer, nbytes = _buffer(data)
        if id(buffer) in seen:
            continue
        seen.add(id(buffer))
        rows.append((node, keep_reason(node), nbytes))
    return rows
