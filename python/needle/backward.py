"""Backward is planned, then executed.

`plan_backward(root)` is plain data: one `Step` per value to differentiate, in reverse topological order, each
naming the values to recompute before it (missing values its gradient reads: dropped by checkpointing or released
earlier), the values a store holds to bring back first (store.py), and the values to release after it (whose last
use it is). `run_backward` walks that plan with a machine (`autograd.Machine`): `Compute` does the work;
checkpoint_budget's `Ledger` walks the very same loop and only counts bytes. A dropped value is just a missing
value here; what to drop is decided in checkpoint.py.

The rules of checkpointing are numbered, and each is stated once, where it is enforced (each test names the rule
it checks): rule 1, what is never dropped or released, at `always_kept` and `checkpoint.annotate`; rule 2,
recompute at most once, and rule 3, release after the last use, at `plan_backward` (and `autograd.realize` for the
forward pass); rule 4, exact recomputation, at `Compute`; rule 5, gradients realized when backward returns, at
`run_backward`.
"""
from dataclasses import dataclass, field

import numpy

from . import ops
from .autograd import (Machine, Tensor, TensorTuple, Value, elements_of, find_topo_sort, infer_spec, lazy_mode,
                       nbytes_of, realize, release, run_deferred, set_autocast, spec_of)
from . import memory_hook, store
from .backend_selection import device_of

__all__ = ["KEPT_ELEMENTS", "BackwardPlan", "Compute", "Step", "always_kept", "compute_gradient_of_variables",
           "last_backward_stats", "plan_backward", "reads", "run_backward"]


# ----- the plan -------------------------------------------------------------------------------------------------
@dataclass
class Step:
    """One step of backward: differentiate `node` (a leaf: sum its gradient parts into `.grad`)."""

    node: "Value"
    recompute: list = field(default_factory=list)  # missing values its gradient reads, and their missing ancestors
    release: list = field(default_factory=list)  # forward values whose last use is this step: released after it
    bring_back: list = field(default_factory=list)  # values a store holds, brought back before this step, for the next
    # {position in `recompute`: values recomputed only on the way to a stack's boundary, released after it}
    passing: dict = field(default_factory=dict)
    update: bool = False  # instead: update `node` by its optimizer in backward, its gradient final (`_with_updates`)


@dataclass
class BackwardPlan:
    """The whole backward pass as data: what to release first, then the steps in reverse topological order."""

    root: "Value"
    unused: list  # values no gradient reads: released before the first step (rule 3)
    steps: list

    def recomputed(self):
        return [n for step in self.steps for n in step.recompute]

    def updated(self):
        return [step.node for step in self.steps if step.update]

    def brought_back(self):
        return [n for step in self.steps for n in step.bring_back]


def reads(node):
    """The forward values whose data `node.op.gradient` reads, as the op declares (`saves`)."""
    saves = node.op.saves
    return {"none": (), "output": (node,), "both": node.inputs + (node,)}.get(saves, node.inputs)


# Values of at most this many elements are never released by backward nor dropped by a policy (rule 1).
KEPT_ELEMENTS = 1


def always_kept(node):
    """Rule 1: whether `node`'s value stays in memory for as long as the graph lives: one element (a loss, a norm).

    Leaves, the output of a backward pass and values of `KEPT_ELEMENTS` are never released (`plan_backward`); no
    policy ever drops a one-element value (they are not candidates: `checkpoint.annotate`). So `loss.numpy()` after
    `(loss * 1.0).backward(); opt.step()` — or after `scaler.scale(loss).backward(); scaler.step(opt)`, read before
    backward or not — is the forward's loss, not the updated model's (other values raise when their recomputation
    would read changed inputs: rule 4c). It costs next to nothing: at most 8 bytes a value, less than the Python
    node that holds it, and a scalar is never worth recomputing; more elements would start keeping small models'
    activations. The Budget's ledger walks the same plan, so it counts those bytes too."""
    data = node.cached_data
    if data is not None and not isinstance(data, tuple):
        return data.size <= KEPT_ELEMENTS  # (backward asks for every value: the short way where there is one)
    spec = infer_spec(node)
    return spec is not None and elements_of(spec[0]) <= KEPT_ELEMENTS


def plan_backward(root, has=None, stored=None):
    """The backward plan of the graph above `root`, given which values exist when it starts (`has`) and which
    missing ones a store holds (`stored`, default: those a store holds now, store.py; one whose stored copy is
    gone, after an earlier backward, is recomputed).

    Simulates the pass in reverse topological order. Before a node's gradient, the values it reads must exist;
    missing ones, and the missing ancestors they need, are recomputed at that step and from then on count as
    available, so nothing is recomputed twice (rule 2: during one backward pass a dropped or released value is
    recomputed at most once; tests assert it on the plan). A stored value is brought back instead of recomputed (its
    ancestors are not needed), a step earlier than the step that reads it, so that a store that copies beside the
    compute (a copy stream or thread) has that step's time to do it. A value's last use is the last step that reads
    it or recomputes a consumer from it; it is released right after (rule 3: every activation, dropped or not, is
    released after its last use: here in backward, in the forward pass by `autograd.realize`; gradient-graph
    temporaries after the step that made them, `_release_step_temporaries`). Leaves, the root and one-element
    values are never released (rule 1).
    """
    has = has or Compute().has
    stored = stored or (lambda n: n.stored is not None)
    reverse = list(reversed(find_topo_sort([root])))
    available = {id(n) for n in reverse if has(n)}
    steps, last_use = [], {}
    for node in reverse:
        if not node.requires_grad:
            continue
        step = Step(node)
        steps.append(step)
        if node.is_leaf():
            continue
        needed = reads(node)
        for v in needed:
            last_use[id(v)] = step
        missing = [v for v in needed if id(v) not in available]
        order = [n for n in find_topo_sort(missing, expand=lambda n: id(n) not in available and not stored(n))
                 if id(n) not in available]
        held, passing = _held_here(missing, order), set()
        for n in order:
            if stored(n):
                available.add(id(n))
                (steps[-2] if len(steps) > 1 else step).bring_back.append(n)  # a step ahead of its use
                continue
            (available if id(n) in held else passing).add(id(n))  # rule 2: one held exists until its last use
            step.recompute.append(n)
            for inp in n.inputs:
                if id(inp) not in passing:
                    last_use[id(inp)] = step
        step.passing = _releases_on_the_way(step.recompute, passing)
    unused = []
    for node in reverse:
        if node.is_leaf() or node is root or always_kept(node):
            continue
        if id(node) in last_use:
            last_use[id(node)].release.append(node)
        else:
            unused.append(node)
    return BackwardPlan(root, unused, _with_updates(steps, last_use))


def _with_updates(steps, last_use):
    """`steps` with an update step for each leaf an optimizer updates in backward, placed where its gradient is
    final: after its own step (every consumer's gradient summed) and after the last step that reads its value (a
    recomputation, a gradient that reads the weight), so that nothing reads the parameter after it changes."""
    position = {id(step): i for i, step in enumerate(steps)}
    updates = {}
    for i, step in enumerate(steps):
        if step.node.is_leaf() and step.node.optimizer is not None:
            at = max(i, position.get(id(last_use.get(id(step.node))), i))
            updates.setdefault(at, []).append(Step(step.node, update=True))
    if not updates:
        return steps
    return [s for i, step in enumerate(steps) for s in [step] + updates.get(i, [])]


def _held_here(missing, order):
    """The ids of the values to recompute (`order`) held until their last use (rule 2); the rest only pass. Held:
    what this step's own layer needs (reached from `missing` without crossing a stack's boundary; the boundaries so
    reached are `wanted`), and the boundaries rebuilt on the way as their `Boundary` says: always (Chen), or only
    when rebuilding a wanted child's output (Revolve's snapshots)."""
    to_recompute, held, stack = {id(n) for n in order}, set(), list(missing)
    while stack:
        n = stack.pop()
        if id(n) in held or id(n) not in to_recompute:
            continue
        held.add(id(n))
        if not n.boundary:
            stack.extend(n.inputs)
    wanted = {(n.boundary.stack, n.boundary.child) for n in order if n.boundary and id(n) in held}
    for n in order:
        rule = n.boundary
        if rule and (rule.held_for is None or (rule.stack, rule.held_for) in wanted):
            held.add(id(n))
    return held


def _releases_on_the_way(recompute, passing):
    """{position in `recompute`: the passing values whose last consumer there is}: released right after it."""
    last = {id(x): (i, x) for i, n in enumerate(recompute) for x in n.inputs if id(x) in passing}  # the last wins
    releases = {}
    for i, x in last.values():
        releases.setdefault(i, []).append(x)
    return releases


# ----- the machine that runs it for real --------------------------------------------------------------------------
class Compute(Machine):
    """The machine that runs realization and backward for real: it computes, checks and releases values.

    Rule 4: recomputation and differentiation are exact. (a) A recomputed value has the shape, dtype and device it
    had in the forward pass (checked every time). (b) Eager and lazy mode give bit-identical numbers. (c) A value,
    once computed, reads the same forever, or raises saying why it cannot: every value has a version, bumped by each
    in-place write (`.data =`, an optimizer's update, `t[idx] = ...`); each node records its inputs' versions when
    it is built (lazy mode too). Whenever a value is computed — eagerly, when a lazy graph is realized, when backward
    recomputes a dropped value or reads a released one again — and before a gradient reads forward values
    (`Op.saves`), the versions are compared, and a mismatch raises RuntimeError naming the op, the input and both
    versions (`check_unchanged`) — with checkpointing off too (a MatMul's gradient reads its weight).
    """

    def __init__(self):
        self.stats = {"recomputed_nodes": 0, "recomputed_bytes": 0, "released_bytes": 0,
                      "max_recomputes_per_node": 0, "brought_back_nodes": 0, "passing_nodes": 0,
                      "recomputed_boundaries": 0}
        self.recomputed = {}  # id -> count, this pass
        self.in_backward = False  # run_backward sets it: a release there is a value's last (autograd.release)
        self.filling = []  # the stores that may still be filling a value brought back (see ready)
        self.optimizers = []  # the optimizers that updated parameters in this backward (in_backward)

    def has(self, node):
        return node.cached_data is not None

    def compute(self, node):
        """Rule 4c: a value is computed from the versions of its inputs that its graph read when it was built."""
        for x, version in zip(node.inputs, node._input_versions):
            if x.version != version:
                check_unchanged(node, node.inputs, action="recompute" if node._released else "compute")
        recorder = memory_hook.RECORDER  # needle.memory: what the op makes is its result or its workspace
        if recorder is not None:
            recorder.computing(node)
        value = node.op.compute(*[x.cached_data for x in node.inputs])
        if isinstance(value, numpy.generic):  # NEEDLE_BACKEND=np: NumPy turns 0-d results into scalars
            value = numpy.asarray(value)
        if recorder is not None:
            recorder.computed(node, value)
        node.cached_data = value

    def recompute(self, node, passing=False):
        """Rule 4: a recomputation reads the versions the forward pass read (`compute` checks them) and gives the
        same shape and dtype. `passing`: only on the way to a stack's boundary, not held (rule 2 counts the held)."""
        if any(x.cached_data is None for x in node.inputs):
            raise RuntimeError(f"backward plan violated: an input of {type(node.op).__name__} is missing at its "
                               "recomputation (rule 2)")
        expected = node._spec
        with memory_hook.phase("recompute"):
            self.compute(node)
        got = spec_of(node.cached_data)
        if expected is not None and got != expected:
            raise RuntimeError(
                f"checkpoint: recomputing {type(node.op).__name__} gave shape/dtype/device {got}, but the forward "
                f"pass had {expected} (rule 4a). Does the op's compute depend on state other than its inputs, "
                f"e.g. a global RNG? Make that state a leaf input.")
        self.stats["recomputed_nodes"] += 1
        self.stats["recomputed_bytes"] += nbytes_of(node.cached_data)
        self.stats["recomputed_boundaries"] += bool(node.boundary)
        if passing:
            self.stats["passing_nodes"] += 1
            return
        count = self.recomputed[id(node)] = self.recomputed.get(id(node), 0) + 1
        self.stats["max_recomputes_per_node"] = max(self.stats["max_recomputes_per_node"], count)

    def check_reads(self, node):
        check_unchanged(node, reads(node))

    def bring_back(self, node):
        """A value its store holds, back in memory: the store may fill it beside this step (see ready)."""
        with memory_hook.phase("recompute"):
            node.cached_data = node.store.get(node, node.stored)
        if memory_hook.RECORDER is not None:
            memory_hook.RECORDER.brought_back(node)  # needle.memory: what the buffer brought back is
        if not node.store.kept_until_last_use:  # back until its last use (rule 2): its stored copy is not needed
            node.store.discard(node, node.stored)
            node.stored = None
        if node.store not in self.filling:
            self.filling.append(node.store)
        self.stats["brought_back_nodes"] += 1

    def ready(self):
        for filling in self.filling:
            filling.ready()
        self.filling.clear()

    def release(self, node):
        self.stats["released_bytes"] += nbytes_of(node.cached_data)
        release(node, last_use=self.in_backward)  # a value with a store is put there first (store.py)

    def set_grad(self, node, grad):
        node.grad = grad
        for hook in node._grad_hooks or ():  # e.g. DataParallel: start reducing while backward goes on
            hook(node)
        if node.store is not None and not node._grad_hooks:  # a leaf's store takes its complete gradient (store.py)
            grad.store = node.store
            release(grad)

    def update(self, node):
        """The optimizer in backward: update parameter `node` (its gradient final) and release its gradient."""
        with memory_hook.phase("optimizer", node.optimizer):  # (the timeline draws the update and the free)
            node.optimizer.update_in_backward(node, self)
            grad, node.grad = node.grad, None
            if grad is not None:
                release(grad)
        if node.optimizer not in self.optimizers:
            self.optimizers.append(node.optimizer)

    def value(self, node):
        return node.cached_data


def check_unchanged(node, values, action="differentiate"):
    """Rule 4c: `values` (inputs of `node`, or `node` itself) hold the versions its graph read when it was built.

    `action` says what was about to happen, and so why a changed version is an error: "compute" (a lazy graph
    realized after a write), "recompute" (a value dropped by checkpointing or released by backward, needed
    again) or "differentiate" (a gradient reading forward values).
    """
    read = {id(x): v for x, v in zip(node.inputs, node._input_versions)}
    read[id(node)] = 0  # a computed value is never written by the graph itself
    for x in values:
        version = read.get(id(x), x.version)
        if x.version != version:
            what = "its output" if x is node else "one of its inputs"
            name = getattr(x, "name", None)
            kind = f"{type(x).__name__} {name!r}" if name else type(x).__name__
            raise RuntimeError(f"{type(node.op).__name__}: cannot {action} it: {what}, a {kind} of shape "
                               f"{tuple(x.shape)}, was modified in place {_WHY_NOT[action](x.version, version)} "
                               f"(rule 4c)")


# Rule 4c's error, by what was about to happen: when the write came, why the number would be wrong, what to do.
_WHY_NOT = {
    "compute": lambda now, read: (
        f"after the graph was built (version {now}, the graph read version {read}): computing it now would mix "
        f"values from before and after the write. Build the graph after the write, or compute it before"),
    "recompute": lambda now, read: (
        f"after the forward pass read it (version {now}, the forward pass read version {read}). Its value was "
        f"released (by backward after its last use, or dropped by checkpointing), and recomputing it now would "
        f"give a different number than the forward pass did. Read the values you need before the write, call "
        f"backward() before optimizer.step(), or don't modify it in place"),
    "differentiate": lambda now, read: (
        f"after the forward pass read it (version {now}, the forward pass read version {read}), so the "
        f"gradient would be wrong. Call backward() before optimizer.step(), or don't modify it in place"),
}


# ----- executing the plan -----------------------------------------------------------------------------------------
def run_backward(plan, out_grad, machine=None):
    """Walk `plan`: bring back, recompute, differentiate, release. Gradients are graph nodes built lazily, realized
    per step (rule 5: when backward returns, every leaf gradient is realized, so an optimizer that updates
    parameters in place can never change a value a gradient still depends on).

    Each step's gradient graph is built lazily and realized together, so its temporaries die as soon as they are
    consumed; afterwards everything the step made is released unless a later step awaits it (rule 3).
    """
    machine = machine or Compute()
    machine.in_backward = True
    forward = {id(s.node) for s in plan.steps} | {id(n) for s in plan.steps for n in s.node.inputs}
    grads = {id(plan.root): [out_grad]}
    awaited = {}  # gradient node id -> how many later steps will consume it
    for node in plan.unused:
        machine.release(node)
    for step in plan.steps:
        node = step.node
        if step.update:
            machine.update(node)  # the optimizer in backward: its gradient goes with it
            continue
        if memory_hook.RECORDER is not None:
            memory_hook.RECORDER.differentiating(node)  # needle.memory: the gradients belong to node's module
        machine.ready()  # the values brought back a step ago are read from this step on
        for n in step.bring_back:  # first: a value recomputed here may read one brought back
            machine.bring_back(n)
        if step is plan.steps[0]:
            machine.ready()  # the first step's include what it reads itself (plan_backward)
        passing = {id(x) for xs in step.passing.values() for x in xs}
        for i, n in enumerate(step.recompute):
            machine.recompute(n, passing=id(n) in passing)
            for passed in step.passing.get(i, ()):  # (a stack's earlier layer, rebuilt only for its boundary)
                machine.release(passed)
        parts = grads.pop(id(node), None)
        for g in parts or ():  # consumed here (counts are by id: a stale one would pass to a later node's)
            awaited[id(g)] = awaited.get(id(g), 0) - 1
        if parts is not None and len(parts) == 1 and node.is_leaf() and machine.has(parts[0]):
            machine.set_grad(node, parts[0])  # a parameter used once: its gradient is computed, nothing to release
        elif parts is not None:
            with lazy_mode(True):
                grad = sum_node_list(parts)
            walked = []
            if node.is_leaf():
                new = [grad]
                realize(new, lambda n: n is grad, machine, walked)
                machine.set_grad(node, grad)
            else:
                new = _input_gradients(node, grad, machine, walked, grads)
            for g in new:
                awaited[id(g)] = awaited.get(id(g), 0) + 1
            _release_step_temporaries(walked, new, parts, grad, forward, awaited, machine)
            for x in [] if node.is_leaf() else node.inputs:
                _accumulate(grads.get(id(x)), machine, awaited, forward)
        for n in step.release:
            machine.release(n)
    machine.ready()  # (every value brought back is read by a later step, which waited for it: nothing is left)


def _input_gradients(node, grad, machine, walked, grads):
    """Differentiate `node`: build its inputs' gradients lazily, realize them together, file them under `grads`;
    return them."""
    machine.check_reads(node)
    with lazy_mode(True):
        in_grads = node.op.gradient_as_tuple(grad, node)
    if len(in_grads) != len(node.inputs):
        raise RuntimeError(f"{type(node.op).__name__}.gradient returned {len(in_grads)} values for "
                           f"{len(node.inputs)} inputs")
    pairs = [(x, _in_dtype_of(x, g, node)) for x, g in zip(node.inputs, in_grads)
             if x.requires_grad and g is not None]
    new = [g for _, g in pairs]
    keep_ids = {id(g) for g in new}
    realize(new, lambda n: id(n) in keep_ids, machine, walked)
    for x, g in pairs:
        grads.setdefault(id(x), []).append(g)
    return new


def _accumulate(parts, machine, awaited, forward):
    """Sum a value's gradient parts as they arrive, so that one partial sum waits for its step instead of every
    part (a weight shared by T time steps: one buffer, not T). The sum is the same, bit for bit: it is taken in the
    order the parts arrive, as the step that consumes them would take it (`sum_node_list`). Tuple parts wait."""
    if parts is None or len(parts) < 2 or not all(isinstance(g, Tensor) for g in parts):
        return
    with lazy_mode(True):
        total = sum_node_list(parts)
    realize([total], lambda n: n is total, machine)
    for g in parts:
        awaited[id(g)] = awaited.get(id(g), 0) - 1
        if id(g) not in forward and not g.is_leaf() and awaited[id(g)] <= 0 and g is not total:
            machine.release(g)
    awaited[id(total)] = awaited.get(id(total), 0) + 1
    parts[:] = [total]


def _in_dtype_of(x, grad, node):
    """An input's gradient in the input's dtype: an op on mixed dtypes computes (and differentiates) in the
    promoted one, so the gradient of a bfloat16 input of a float32 op is cast back to bfloat16."""
    if not isinstance(grad, Tensor) or _dtype(x) == _dtype(node) or grad.dtype == x.dtype:
        return grad
    with lazy_mode(True):
        return ops.cast(grad, x.dtype)


def _dtype(value):
    data = value.cached_data  # a forward value's array, when it has one (cheaper than the full spec)
    return data.dtype if data is not None and not isinstance(data, tuple) else value.dtype


def _release_step_temporaries(walked, new, parts, grad, forward, awaited, machine):
    """Release what a step made and consumed: its gradient graph's values, except the results later steps await.

    `walked` is the step's realization walk: every value it computed (released there unless kept) and, not
    expanded, the values that existed before it — forward values, the parts, leaves, and rarely a value the
    step made that a shape query computed early (an op that cannot infer its shape); only that last case needs
    a walk of its own, from those values and from `grad`, to reach what they hold.
    """
    part_ids = {id(g) for g in parts}
    new_ids = {id(g) for g in new}
    # A kept make_tuple of gradients holds its elements' data, and tuple arithmetic folds through it to the
    # element nodes later: releasing them would give no memory back now and force a recomputation then.
    new_ids |= {id(x) for g in new if isinstance(g, TensorTuple) and g.op is not None and g.op.view for x in g.inputs}

    def made(n):  # made by this step (never a forward value or a part: expanding a part would re-walk every
        return id(n) not in forward and id(n) not in part_ids and not n.is_leaf()  # earlier step: O(n^2))

    early = [n for n in walked + [grad] if machine.has(n) and made(n) and id(n) not in new_ids]
    if early:
        # Expanded: only what this step walked or what holds a value. A value without data that this step did not
        # walk holds nothing, and behind it lie earlier steps' values: walking them each step would be O(n^2).
        walked_ids = {id(n) for n in walked}
        early = find_topo_sort(early, expand=lambda n: made(n) and (id(n) in walked_ids or machine.has(n)))
    # The parts are listed too: summing tuple gradients folds them away (make_tuple's elements are used directly),
    # so the walk from the sum may not reach them, yet this step consumed them.
    for n in list(parts) + early:
        if id(n) not in forward and id(n) not in new_ids and not n.is_leaf() and awaited.get(id(n), 0) <= 0:
            machine.release(n)


def sum_node_list(node_list):
    """The sum of a list of Tensors, in list order (so float sums are the same run to run)."""
    total = node_list[0]
    for node in node_list[1:]:
        total = total + node
    return total


# ----- the entry point and its statistics -------------------------------------------------------------------------
_last_stats = {}


def last_backward_stats():
    """Statistics of the last backward pass: recomputed nodes and bytes (`passing_nodes` of them computed only on the
    way to a stack's boundary, `recomputed_boundaries` of them a stack's boundaries), released bytes, values brought
    back from their stores, the allocator's peak, and what the stores did since the backward before (store.take_traffic:
    the bytes the toolbox's stores moved, say).

    `peak_bytes` is the device allocator's peak since its last reset (reset it when a step starts to read that
    step's peak: `backend_ndarray.reset_peak_memory_stats(device)`);
    `max_recomputes_per_node` is counted per node (rule 2 says it is at most 1).
    """
    return dict(_last_stats)


def compute_gradient_of_variables(output_tensor, out_grad):
    """Reverse-mode differentiation: fill `.grad` of every leaf above `output_tensor` that requires grad.

    Realizes the forward pass (lazy mode computes it here), plans the backward pass (`plan_backward`) and runs
    it (`run_backward`). Gradients are Tensors themselves (differentiable); each call replaces `.grad`, it does
    not accumulate.
    """
    if not isinstance(out_grad, Value):
        raise TypeError(f"backward(): out_grad must be a Tensor, got {type(out_grad).__name__}")
    if tuple(out_grad.shape) != tuple(output_tensor.shape):
        raise ValueError(f"backward(): out_grad has shape {tuple(out_grad.shape)}, but the output has shape "
                         f"{tuple(output_tensor.shape)}; they must be equal")
    # Decisions waiting for the whole graph (a Budget's), before anything more is computed.
    run_deferred([output_tensor])
    with memory_hook.phase("forward"):
        output_tensor.realize_cached_data()  # the forward pass (in lazy mode it runs here)
    # Gradients are built from an out_grad that requires grad, so every gradient value is a graph node that
    # can be released after use and recomputed on demand (x.grad stays differentiable), never a stray constant.
    with memory_hook.phase("backward"):  # (needle.memory: the seed is a gradient)
        out_grad = Tensor.make_const(out_grad, requires_grad=True)
    device = device_of(output_tensor.cached_data)
    machine = Compute()
    # The gradient graph keeps the dtypes the forward pass chose: autocast applies to forward ops, so a backward()
    # called inside an autocast block computes exactly what one called after it does.
    autocast = set_autocast(None)
    try:
        with memory_hook.phase("backward"):
            run_backward(plan_backward(output_tensor), out_grad, machine)
        for optimizer in machine.optimizers:
            with memory_hook.phase("optimizer", optimizer):
                optimizer.end_step()
    finally:
        set_autocast(autocast)
    stats = dict(machine.stats)
    stats["peak_bytes"] = device.memory_stats()["peak_bytes"] if hasattr(device, "memory_stats") else None
    stats.update(store.take_traffic())  # what the stores did this step, in its forward and its backward
    _last_stats.clear()
    _last_stats.update(stats)
