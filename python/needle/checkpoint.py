"""Gradient checkpointing: keep fewer activations after the forward pass, recompute them during backward.

Training keeps every intermediate value of the forward pass alive until backward has used it; for a deep
network that is most of the memory of a step. Checkpointing trades compute for memory (Chen et al. 2016,
"Training Deep Nets with Sublinear Memory Cost"): nodes marked `drop` are not kept after the forward pass, and
backward recomputes them from their nearest kept ancestors (the checkpoints) just before it needs them.

    model.enable_gc(policy="sqrt")        # or segment_len=4, policy="selective", policy=Budget(64 << 20)
    loss = loss_fn(model(x), y)           # layers call annotate() on their interior as they run
    loss.backward()                       # dropped values are recomputed here, each at most once
    checkpoint.last_backward_stats()      # {"recomputed_nodes": ..., "released_bytes": ..., ...}

Everything about *what* is dropped and *when* a buffer is released lives in this file; `autograd.py` calls
`release`, `BackwardPlan` and the stats, and layers call only `annotate`.

The rules (each test names the rule it checks):

  Rule 1. Leaves (parameters, constants, dropout masks), the inputs and output of an annotated region, and the
          output of a backward pass are never dropped or released.
  Rule 2. During one backward pass, a dropped or released value is recomputed at most once: recomputed values
          stay alive until their last use in that pass (`BackwardPlan` plans this, then asserts it).
  Rule 3. Every activation, dropped or not, is released after its last use: in the forward pass for dropped
          values (eager: as soon as the region's output exists; lazy: after its last consumer is computed), and
          in backward for every value after the last gradient that reads it. Gradient-graph temporaries are
          released after the step that made them.
  Rule 4. Recomputation and differentiation are exact:
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

from .backend_ndarray.ndarray import _compact_strides  # the strides NDArray gives a compact array

__all__ = [
    "Budget",
    "BackwardPlan",
    "annotate",
    "last_backward_stats",
    "nothing_saveable",
    "dots_saveable",
    "resolve_policy",
    "release",
    "spec_of",
    "Sqrt",
    "EverySegment",
    "keep_reason",
    "saved_residuals",
]


def spec_of(data):
    """(shape, dtype, device) of a raw array or a tuple of them."""
    if isinstance(data, tuple):
        specs = [spec_of(x) for x in data]
        return tuple(s[0] for s in specs), specs[0][1] if specs else "float32", specs[0][2] if specs else None
    device = getattr(data, "device", None)
    if not hasattr(device, "enabled"):  # a plain numpy.ndarray (NEEDLE_BACKEND=np)
        from .backend_selection import cpu

        device = cpu()
    return tuple(data.shape), data.dtype, device


def nbytes_of(data):
    if data is None:
        return 0
    if isinstance(data, tuple):
        return sum(nbytes_of(x) for x in data)
    return int(data.nbytes)


def release(node):
    """Forget a node's value (it can be recomputed from its inputs); remember its shape, dtype and device."""
    if node.cached_data is not None:
        node._spec = spec_of(node.cached_data)
        node.cached_data = None


def check_unchanged(node, inputs=True, output=False, action="differentiate"):
    """Rule 4c: `node`'s inputs (and its own value) still hold the versions its forward computation read."""
    read = node._input_versions
    suspects = [(x, v) for x, v in zip(node.inputs, read or ()) if inputs] + ([(node, 0)] if output else [])
    for x, version in suspects:
        if x.version != version:
            what = "its output" if x is node else "one of its inputs"
            name = getattr(x, "name", None)
            kind = f"{type(x).__name__} {name!r}" if name else type(x).__name__
            raise RuntimeError(
                f"{type(node.op).__name__}: cannot {action} it: {what}, a {kind} of shape {tuple(x.shape)}, was "
                f"modified in place after the forward pass read it (version {x.version}, the forward pass read "
                f"version {version}), so the result would be wrong. Call backward() before optimizer.step(), or "
                f"don't modify it in place (rule 4c)"
            )


# ----- policies: small pure functions from the candidate nodes of a region to keep/drop flags ------------------
SAVEABLE_OPS = ("MatMul", "Conv")


def nothing_saveable(nodes):
    """Drop every candidate ("all")."""
    return [False] * len(nodes)


def dots_saveable(nodes):
    """Keep the outputs of matmul/conv (expensive to recompute); drop the cheap rest ("selective")."""
    return [type(n.op).__name__ in SAVEABLE_OPS for n in nodes]


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
    while node.op is not None and type(node.op).__name__ in VIEW_OPS:
        node = node.inputs[0]
    return 0 if node.is_leaf() else _known_bytes(node)


def _known_bytes(node):
    """A node's size from its data or its inferred shape, without computing it (unknown: infinity)."""
    if node.cached_data is None and node._spec is None:
        from .autograd import _infer_specs

        _infer_specs(node)
    if node.cached_data is not None:
        return nbytes_of(node.cached_data)
    if node._spec is None or (node._spec[0] and isinstance(node._spec[0][0], tuple)):
        return math.inf
    return 4 * math.prod(node._spec[0])


class Budget:
    """Keep the peak activation memory of a step under `bytes`, at the least recompute cost.

    Planned from a traced step: the first step after `enable_gc(policy=Budget(b))` drops nothing and records
    every annotated region; `plan(loss, measured_peak)` then simulates the backward schedule (`BackwardPlan`)
    for drop sets of growing size, cheapest to recompute first (element-wise and softmax before matmul), and
    keeps the smallest whose predicted peak fits. Predictions are calibrated by the traced step's measured peak
    (`measured_peak`: allocator peak minus the step's starting bytes). Later steps replay the plan region by
    region. An infeasible budget raises ValueError that names the least peak the graph can reach.

        budget = Budget(200 << 20); model.enable_gc(policy=budget)
        loss = train_step()                        # traced: nothing dropped
        budget.plan(loss, measured_peak=peak)      # from now on steps drop what the plan says
    """

    def __init__(self, bytes):
        self.bytes = int(bytes)
        self.predicted_peak = None
        self.minimum_peak = None
        self._regions = []  # the traced step's regions: their candidate nodes (strong refs until planned)
        self._flags = None  # after planning: keep flags per region, replayed in order every step
        self._calls = 0

    def __repr__(self):
        return f"Budget({self.bytes})"

    @property
    def planned(self):
        return self._flags is not None

    def __call__(self, nodes):
        if self._flags is None:
            self._regions.append(list(nodes))
            return [True] * len(nodes)
        flags = self._flags[self._calls % len(self._flags)]
        self._calls += 1
        if len(flags) != len(nodes):
            raise RuntimeError(f"{self!r}: region {self._calls - 1} has {len(nodes)} candidates, the planned graph "
                               f"had {len(flags)}; the model's graph changed since planning — plan again")
        return flags

    def plan(self, root, measured_peak=None, exclude=()):
        """Choose what to drop from the traced step whose output is `root`; returns the predicted peak."""
        from .autograd import find_topo_sort

        if not self._regions:
            raise RuntimeError(f"{self!r}.plan: no region was traced; run one step with this policy first")
        skip = {id(n) for n in exclude}
        order, seen = [], set()
        for region in self._regions:
            for n in region:
                if id(n) not in seen:
                    seen.add(id(n))
                    order.append(n)
        topo = find_topo_sort([root])
        owner, size, _ = buffer_sizes(topo)
        order = [n for n in order if id(n) in owner]  # a region output the loss never uses frees nothing
        footprints = gradient_footprints(topo)

        def cheapest_first(i):  # a view's bytes are its base's: dropping both frees them
            return recompute_cost_per_byte(order[i]), -size[owner[id(order[i])]], i

        def predict(t):  # the peak with the t cheapest candidates dropped
            dropped = {id(order[i]) for i in ranked[:t]}
            return simulate_peak(root, dropped, skip, footprints) + offset

        ranked = sorted(range(len(order)), key=cheapest_first)
        offset = 0 if measured_peak is None else measured_peak - simulate_peak(root, set(), skip, footprints)
        self.minimum_peak = predict(len(ranked))
        if self.minimum_peak > self.bytes:
            raise ValueError(f"{self!r} is infeasible: the least peak activation memory this graph can reach "
                             f"by checkpointing is {self.minimum_peak} bytes ({self.minimum_peak / 2**20:.1f} MB)")
        lo, hi = 0, len(ranked)  # smallest t whose prediction fits: fewest drops, cheapest recomputation
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if predict(mid) <= self.bytes else (mid + 1, hi)
        dropped = {id(order[i]) for i in ranked[:lo]}
        self.predicted_peak = predict(lo)
        self._flags, gone = [], set()
        for region in self._regions:  # replay annotate: inner regions decide first, dropped nodes stay dropped
            candidates = [n for n in region if id(n) not in gone]
            self._flags.append([id(n) not in dropped for n in candidates])
            gone |= {id(n) for n in candidates if id(n) in dropped}
        self._regions, self._calls = [], 0
        return self.predicted_peak


def recompute_cost_per_byte(node):
    """A node's recompute cost relative to the bytes that dropping it saves (matmul/conv cost the most)."""
    return 64.0 if type(node.op).__name__ in SAVEABLE_OPS else 1.0


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
    from .autograd import find_topo_sort

    outs = list(out_node) if isinstance(out_node, (list, tuple)) else [out_node]
    stop = {id(n) for n in in_nodes}
    boundary = stop | {id(n) for n in outs}
    order = find_topo_sort(outs, expand=lambda n: id(n) not in stop)
    candidates = [n for n in order if id(n) not in boundary and not n.is_leaf() and not n.drop]
    keep = resolve_policy(policy, segment_len)(candidates)
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
    """The buffer under a value: views share one (an NDArray's handle, a numpy array's base)."""
    handle = getattr(data, "_handle", None)
    if handle is not None:
        return handle, 4 * handle.size
    base = data
    while getattr(base, "base", None) is not None:
        base = base.base
    return base, int(base.nbytes)


def _buffer_key(data):
    return id(_buffer(data)[0])


def saved_residuals(root, exclude=()):
    """The buffers held in memory by the graph above `root`, one (node, reason, bytes) per buffer.

    Like JAX's print_saved_residuals: what is kept for backward, and why. Views of one buffer count once, at
    the buffer's size (a broadcast view costs what its base costs);
    `exclude` (e.g. parameters and the batch) are left out.
    """
    from .autograd import find_topo_sort

    seen = {_buffer_key(n.cached_data) for n in exclude if n.cached_data is not None}  # and views of them
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


# ----- the backward plan --------------------------------------------------------------------------------------
_last_stats = {}


def last_backward_stats():
    """Statistics of the last backward pass: recomputed nodes and bytes, released bytes, the allocator's peak.

    `peak_bytes` is the device allocator's peak since its last reset (reset it at the start of a step to
    get the step's peak); `max_recomputes_per_node` is counted per node (rule 2 says it is at most 1).
    """
    return dict(_last_stats)


def _reads(node):
    """The forward values whose data `node.op.gradient` reads (declared by the op's `saves`)."""
    saves = node.op.saves
    if saves == "none":
        return ()
    if saves == "output":
        return (node,)
    if saves == "both":
        return node.inputs + (node,)
    return node.inputs


def _schedule(reverse_topo, available):
    """The recomputations before each backward step, and each value's last use (see BackwardPlan).

    `available`: ids of values that exist when backward starts; it is updated as the simulation recomputes.
    """
    from .autograd import find_topo_sort

    recompute_at, last_use = {}, {}
    for step, node in enumerate(reverse_topo):
        if node.is_leaf() or not node.requires_grad:
            continue
        reads = _reads(node)
        for v in reads:
            last_use[id(v)] = step
        missing = [v for v in reads if id(v) not in available]
        if not missing:
            continue
        todo = []
        for n in find_topo_sort(missing, expand=lambda n: id(n) not in available):
            if id(n) in available:
                continue
            available.add(id(n))  # rule 2: from now on it exists until its last use
            todo.append(n)
            for inp in n.inputs:
                last_use[id(inp)] = step
        recompute_at[step] = todo
    return recompute_at, last_use


VIEW_OPS = ("Reshape", "BroadcastTo", "Transpose", "TupleGetItem", "MakeTensorTuple")
# Ops whose compute copies a strided (transposed, broadcast) operand into a compact temporary first.
COMPACTING_OPS = ("MatMul", "Summation", "LogSumExp", "SoftmaxCrossEntropy", "SoftmaxCrossEntropyGrad")


def _gradient_bytes(node):
    """Bytes of a node's gradient: its full (un-viewed) size; a tuple's gradient has one per element."""
    shape = node.shape
    if shape and isinstance(shape[0], tuple):
        return sum(4 * math.prod(s) for s in shape)
    return 4 * math.prod(shape)


def _is_tuple(node):
    shape = node.shape
    return bool(shape) and isinstance(shape[0], tuple)


def buffer_owners(topo):
    """For each node (in topological order), the node whose buffer its value lives in (itself if it owns one),
    and the element strides of its value (where known).

    Transpose and BroadcastTo are views (new strides, same buffer). Reshape is a view of a compact input and a
    compact copy of any other (NDArray.reshape requires compactness), so strides are followed to tell which.
    An element of make_tuple(...) is that value itself; an element of another tuple (split) lives in the
    tuple's buffers.
    """
    owner, strides = {}, {}
    for n in topo:
        name = type(n.op).__name__ if n.op is not None else None
        shape = n.shape
        if name in ("Transpose", "BroadcastTo", "Reshape") and id(n.inputs[0]) in strides:
            inp = n.inputs[0]
            owner[id(n)], s = owner[id(inp)], strides[id(inp)]
            if name == "Transpose":
                s = tuple(s[k] for k in n.op._permutation(len(s)))
            elif name == "BroadcastTo":
                lead = len(shape) - len(s)
                s = (0,) * lead + tuple(0 if a != b else x for x, a, b in zip(s, inp.shape, shape[lead:]))
            elif s != _compact_strides(inp.shape):  # a Reshape that compacts first: a new buffer
                owner[id(n)], s = id(n), _compact_strides(shape)
            else:
                s = _compact_strides(shape)
            strides[id(n)] = s
        elif name == "TupleGetItem":
            tup = n.inputs[0]
            source = tup.inputs[n.op.index] if type(tup.op).__name__ == "MakeTensorTuple" else tup
            owner[id(n)] = owner.get(id(source), id(source))
            strides[id(n)] = _compact_strides(shape)
        else:  # a fresh buffer
            owner[id(n)] = id(n)
            if not _is_tuple(n):
                strides[id(n)] = _compact_strides(shape)
    return owner, strides


def _own_bytes(node):
    """Bytes of the buffer a value owns: a make_tuple owns none (its elements do), another tuple all of them."""
    if not _is_tuple(node):
        return 4 * math.prod(node.shape)
    if type(node.op).__name__ == "MakeTensorTuple":
        return 0
    return sum(4 * math.prod(s) for s in node.shape)


def buffer_sizes(topo):
    """(owner, size, workspace): the buffer each node's value lives in (see buffer_owners), each buffer's bytes,
    and the bytes each node's compute allocates besides its result: what the op declares
    (`TensorOp.workspace`) plus a compact copy of each strided operand of an op that needs compact ones."""
    owner, strides = buffer_owners(topo)
    size = {id(n): _own_bytes(n) if owner[id(n)] == id(n) else 0 for n in topo}

    def strided(x):
        return id(x) in strides and strides[id(x)] != _compact_strides(x.shape)

    workspace = {}
    for n in topo:
        if n.op is None:
            continue
        declared = getattr(n.op, "workspace", None)
        extra = declared(*[x.shape for x in n.inputs]) if declared else 0
        if type(n.op).__name__ in COMPACTING_OPS:
            extra += sum(4 * math.prod(x.shape) for x in n.inputs if strided(x))
        if extra:
            workspace[id(n)] = extra
    return owner, size, workspace


class _Ledger:
    """Bytes held by a set of values, counted per buffer: a buffer is held while any value on it is."""

    def __init__(self, owner, size, excluded=()):
        self.owner, self.size, self.excluded = owner, size, set(excluded)
        self.holders, self.held, self.live = {}, set(), 0

    def hold(self, n):
        b = self.owner[id(n)]
        if id(n) in self.held or b in self.excluded:
            return
        self.held.add(id(n))
        self.holders[b] = self.holders.get(b, 0) + 1
        if self.holders[b] == 1:
            self.live += self.size[b]

    def free(self, n):
        if id(n) not in self.held:
            return
        b = self.owner[id(n)]
        self.held.discard(id(n))
        self.holders[b] -= 1
        if self.holders[b] == 0:
            self.live -= self.size[b]


def gradient_footprint(node):
    """What realizing `node`'s gradient allocates, read off its lazy gradient graph (nothing is computed).

    Returns (peak, made): the most bytes the gradient graph holds at once beyond out_grad (its temporaries and
    results), and per input the bytes its new gradient owns (0 for out_grad passed on, or a view of it, which
    keeps out_grad's bytes; None for an input that gets no gradient). None where a shape cannot be inferred
    (the caller then guesses).
    """
    from .autograd import Tensor, TensorTuple, _infer_specs, find_topo_sort, lazy_mode

    if node.is_leaf():
        return None
    placeholder = TensorTuple if _is_tuple(node) else Tensor
    out_grad = placeholder.__new__(placeholder)  # shape, dtype and device, no data
    out_grad._init(None, [], requires_grad=True)
    out_grad._spec = (tuple(node.shape), node.dtype, node.device)
    with lazy_mode(True):
        grads = node.op.gradient_as_tuple(out_grad, node)
    targets = [g for x, g in zip(node.inputs, grads) if x.requires_grad and g is not None]
    old = {id(out_grad), id(node)} | {id(x) for x in node.inputs}
    new = [n for n in find_topo_sort(targets, expand=lambda n: id(n) not in old) if id(n) not in old]
    for n in new:
        if n._spec is None:
            _infer_specs(n)
        if n._spec is None:
            return None
    owner, size, workspace = buffer_sizes([out_grad, *node.inputs, node] + new)
    ledger = _Ledger(owner, size, excluded=[owner[i] for i in old])
    target_ids = {id(g) for g in targets}
    consumers = {}
    for n in new:
        for x in n.inputs:
            consumers[id(x)] = consumers.get(id(x), 0) + 1
    peak = 0
    for n in new:  # as _realize runs it: each temporary freed after its last consumer
        ledger.hold(n)
        peak = max(peak, ledger.live + workspace.get(id(n), 0))
        for x in n.inputs:
            consumers[id(x)] = consumers.get(id(x), 0) - 1
            if consumers[id(x)] == 0 and id(x) not in target_ids:
                ledger.free(x)
    made, counted = [], set()
    for x, g in zip(node.inputs, grads):
        if not x.requires_grad or g is None:
            made.append(None)
            continue
        b = owner[id(g)]
        made.append(size[b] if b not in counted and b not in ledger.excluded else 0)
        counted.add(b)
    return peak, made


def gradient_footprints(topo):
    """`gradient_footprint` of every node of `topo` that backward differentiates, by id."""
    return {id(n): gradient_footprint(n) for n in topo if n.requires_grad and not n.is_leaf()}


def simulate_peak(root, dropped, exclude=frozenset(), footprints=None):
    """Predicted peak activation bytes of a step on the traced graph above `root` if `dropped` were dropped.

    Forward as lazy realization (dropped values freed after their last consumer), then the backward schedule
    of `_schedule` with its recomputations and releases, plus the gradients alive at each step and what each
    step's gradient graph allocates (`gradient_footprint`, or `footprints` computed once by the caller).
    Memory is counted per buffer: a buffer lives while any value viewing it is held (a kept reshape of a
    dropped value keeps that value's bytes). Leaves in `exclude` (parameters, the batch) are not counted.
    """
    from .autograd import find_topo_sort

    topo = find_topo_sort([root])
    owner, size, workspace = buffer_sizes(topo)
    if footprints is None:
        footprints = gradient_footprints(topo)
    act = _Ledger(owner, size, excluded={owner[i] for i in exclude if i in owner})
    peak = 0
    consumers = {}
    for n in topo:
        for inp in n.inputs:
            consumers[id(inp)] = consumers.get(id(inp), 0) + 1
    for n in topo:
        act.hold(n)
        peak = max(peak, act.live + workspace.get(id(n), 0))
        for inp in n.inputs:
            consumers[id(inp)] -= 1
            if consumers[id(inp)] == 0 and id(inp) in dropped:
                act.free(inp)
    reverse = list(reversed(topo))
    available = {id(n) for n in topo if n.is_leaf() or id(n) not in dropped}
    recompute_at, last_use = _schedule(reverse, available)
    release_at = {}
    for n in topo:
        if not n.is_leaf() and n is not root:
            release_at.setdefault(last_use.get(id(n), -1), []).append(n)
    for n in release_at.get(-1, ()):
        act.free(n)
    root_bytes = _gradient_bytes(root)
    grad_bytes, parts = {id(root): root_bytes}, {}
    grads_live = root_bytes
    for step, node in enumerate(reverse):
        if id(node) in grad_bytes and not node.is_leaf():
            for n in recompute_at.get(step, ()):
                act.hold(n)
            node_grad = grad_bytes.pop(id(node))
            if parts.pop(id(node), 1) > 1:  # summing the parts allocates the sum while the parts still live
                total = _gradient_bytes(node)
                peak = max(peak, act.live + grads_live + total)
                grads_live += total - node_grad
                node_grad = total
            footprint = footprints.get(id(node))
            if footprint is None:  # unknown shapes: one temporary beside each new gradient of full size
                made = [_gradient_bytes(x) if x.requires_grad else None for x in node.inputs]
                peak = max(peak, act.live + grads_live + 2 * sum(b for b in made if b))
            else:
                step_peak, made = footprint  # one entry per input: None where it gets no gradient
                peak = max(peak, act.live + grads_live + step_peak)
            passed_on = False  # out_grad's bytes move to the first input whose gradient is out_grad (or a view)
            for inp, new_bytes in zip(node.inputs, made):
                if new_bytes is None:
                    continue
                carried = node_grad if new_bytes == 0 and not passed_on else 0
                passed_on = passed_on or carried > 0
                grad_bytes[id(inp)] = grad_bytes.get(id(inp), 0) + new_bytes + carried
                parts[id(inp)] = parts.get(id(inp), 0) + 1
            grads_live += sum(b for b in made if b) - (0 if passed_on else node_grad)
        for n in release_at.get(step, ()):
            act.free(n)
    return peak


class BackwardPlan:
    """Which dropped values to recompute before each step of backward, and when each value is released.

    Plan, then execute: the constructor simulates the pass in reverse topological order. Before step i (the
    gradient of node i) the values that gradient reads must exist; missing ones, and the missing ancestors they
    need, are scheduled for recomputation at step i and from then on count as available (rule 2). A value's
    last use is the last step that reads it or recomputes a consumer from it; it is released right after that
    step (rule 3). Leaves and the output are never released (rule 1).
    """

    def __init__(self, reverse_topo, root):
        self.root = root
        self.forward_ids = {id(n) for n in reverse_topo}
        self.release_at = {}
        self.unused = []
        self.pending = {}
        self.recompute_counts = {}
        self.stats = {"recomputed_nodes": 0, "recomputed_bytes": 0, "released_bytes": 0,
                      "max_recomputes_per_node": 0, "recomputed_ids": set()}
        available = {id(n) for n in reverse_topo if n.cached_data is not None}
        self.recompute_at, last_use = _schedule(reverse_topo, available)
        for node in reverse_topo:
            if node.is_leaf() or node is root:
                continue
            step = last_use.get(id(node))
            if step is None:
                self.unused.append(node)
            else:
                self.release_at.setdefault(step, []).append(node)

    def _release(self, node):
        self.stats["released_bytes"] += nbytes_of(node.cached_data)
        release(node)

    def release_unused(self):
        """Rule 3: values no gradient reads are released before the first step."""
        for node in self.unused:
            self._release(node)

    def recompute(self, step):
        """Recompute the values scheduled before `step`, from inputs that the plan guarantees exist."""
        for node in self.recompute_at.get(step, ()):
            if any(x.cached_data is None for x in node.inputs):
                raise RuntimeError(f"checkpoint plan violated: an input of {type(node.op).__name__} is missing "
                                   "at its recomputation (rule 2)")
            check_unchanged(node, action="recompute")
            value = node.op.compute(*[x.cached_data for x in node.inputs])
            expected = node._spec
            if expected is not None and spec_of(value)[:2] != expected[:2]:
                raise RuntimeError(
                    f"checkpoint: recomputing {type(node.op).__name__} gave shape/dtype {spec_of(value)[:2]}, "
                    f"but the forward pass had {expected[:2]} (rule 4). Does the op's compute depend on "
                    f"state other than its inputs, e.g. a global RNG? Make that state a leaf input."
                )
            node.cached_data = value
            self.stats["recomputed_nodes"] += 1
            self.stats["recomputed_bytes"] += nbytes_of(value)
            self.stats["recomputed_ids"].add(id(node))
            count = self.recompute_counts[id(node)] = self.recompute_counts.get(id(node), 0) + 1
            self.stats["max_recomputes_per_node"] = max(self.stats["max_recomputes_per_node"], count)

    def release(self, step):
        for node in self.release_at.get(step, ()):
            self._release(node)

    def consume(self, parts):
        """The gradient contributions `parts` have been summed by the node that awaited them."""
        for g in parts:
            self.pending[id(g)] = self.pending.get(id(g), 0) - 1

    def release_gradient_temporaries(self, new, parts, grad):
        """Rule 3 for the gradient graph: after a step, free what it made and what it consumed, unless awaited.

        `new` are the step's results (kept until their node's step); the walk from them stops at forward
        values and at the step's own inputs (`parts`, `grad`), so it visits only what this step created.
        """
        from .autograd import find_topo_sort

        for g in new:
            self.pending[id(g)] = self.pending.get(id(g), 0) + 1
        new_ids = {id(g) for g in new}
        part_ids = {id(g) for g in parts}
        forward = self.forward_ids
        # Expand only what this step made: never a forward value or a part (a `new` entry may be a part, e.g.
        # an add passing out_grad through, and expanding it would re-walk every earlier step: O(n^2)).
        made = find_topo_sort(new + [grad], expand=lambda n: not (id(n) in forward or id(n) in part_ids))
        for node in made:
            if (id(node) not in self.forward_ids and id(node) not in new_ids and not node.is_leaf()
                    and self.pending.get(id(node), 0) <= 0):
                release(node)

    def finish(self):
        """Record the statistics of this pass (see `last_backward_stats`)."""
        stats = dict(self.stats)
        data = self.root.cached_data
        device = getattr(data, "device", None)
        stats["peak_bytes"] = device.memory_stats()["peak_bytes"] if hasattr(device, "memory_stats") else None
        _last_stats.clear()
        _last_stats.update(stats)
