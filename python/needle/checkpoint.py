"""Gradient checkpointing: keep fewer activations after the forward pass, recompute them during backward.

Training keeps every intermediate value of the forward pass alive until backward has used it; for a deep network
that is most of a step's memory. Checkpointing trades compute for memory (Chen et al. 2016, "Training Deep Nets
with Sublinear Memory Cost"): nodes marked `drop` are not kept after the forward pass, and backward recomputes
them from their nearest kept ancestors (the checkpoints) just before it needs them.

    model.enable_gc(policy="sqrt")        # or segment_len=4, policy="selective", policy=Budget(64 << 20)
    loss = loss_fn(model(x), y)           # layers call annotate() on their interior as they run
    loss.backward()                       # dropped values are recomputed here, each at most once
    y = checkpoint.checkpoint(block, x)   # without enable_gc: drop one function's interior (torch's API)
    checkpoint.print_saved_residuals(loss)                # what backward will find in memory, and why

This file decides *what* is dropped: `annotate` and the policies (`resolve_policy` says what a policy is).
Backward (what to recompute before each step, when each value dies) is backward.py's plan, which treats a dropped
value as a missing one; the memory-budget planner is checkpoint_budget.py. Rule 1 (what is never dropped) is
stated at `annotate`, where it is enforced; rules 2-5 in backward.py.
"""
import math
import warnings
from collections import Counter
from dataclasses import dataclass

from . import autograd, lazy, memory_hook, regions
from .regions import apply_decision, keep_reason, region_of
from .autograd import Value, element_shapes, find_topo_sort, infer_spec, itemsize, spec_nbytes
from .backward import always_kept, last_backward_stats
from .checkpoint_budget import Budget
from .store import Store

__all__ = [
    "Budget",
    "EverySegment",
    "KeepChildren",
    "NothingToDropWarning",
    "Store",
    "Sqrt",
    "annotate",
    "apply_decision",
    "checkpoint",
    "checkpoint_sequential",
    "dots_saveable",
    "keep_reason",
    "last_backward_stats",
    "nothing_saveable",
    "print_saved_residuals",
    "region_of",
    "resolve_policy",
    "saved_residuals",
    "warn_if_nothing_to_drop",
]


# ----- policies: small pure functions from the candidate nodes of a region to decisions -------------------------
# From the toolbox, on first use: OFFLOAD (the host-memory store, a policy's answer), compress(bits, policy),
# offload_all (the "offload" policy), Revolve(snapshots) (binomial checkpointing for a stack).
__getattr__ = lazy.attributes(__name__, {"OFFLOAD": "offload:OFFLOAD", "offload_all": "offload:offload_all",
                                         "compress": "compress:compress", "Revolve": "revolve:Revolve"})


def nothing_saveable(nodes, outputs=()):
    """Drop every candidate ("all")."""
    return [False] * len(nodes)


def dots_saveable(nodes, outputs=()):
    """Keep what is expensive to recompute (matmul, conv: `Op.saveable`); drop the cheap rest ("selective")."""
    return [n.op.saveable for n in nodes]


@dataclass(frozen=True)
class KeepChildren:
    """A stack's policy: keep the outputs of the children numbered in `children` (0: the first to run; an LSTM step's
    h and c together; None: every child's, policy "layers", Hugging Face's per-layer checkpointing, about one extra
    forward), drop every other candidate (a layer's interior too). Backward rebuilds a dropped run of boundaries
    from the child kept below it, once (backward.plan_backward)."""

    children: frozenset = None

    def __call__(self, nodes, outputs=()):
        keep = [False] * len(nodes)
        for child, positions in enumerate(regions.stack_children(nodes)):
            for i in positions:
                keep[i] = self.children is None or child in self.children
        return keep



@dataclass(frozen=True)
class EverySegment:
    """Keep every k-th candidate as a checkpoint (`segment_len=k`); in a stack, every k-th child's outputs."""

    k: int

    def __call__(self, nodes, outputs=()):
        children = regions.stack_children(nodes)
        if children:
            return KeepChildren(frozenset(range(self.k - 1, len(children), self.k)))(nodes)
        return [(i + 1) % self.k == 0 for i in range(len(nodes))]


@dataclass(frozen=True)
class Sqrt:
    """Chen's O(sqrt n) schedule: the region's n candidates in segments of k = ceil(sqrt n), one checkpoint each
    (in a stack of n children, the outputs of every k-th child: `KeepChildren`).

    The region's output is kept anyway (rule 1) and ends the last segment, so only the first ceil(n/k) - 1
    segments get a checkpoint: a region of 2 candidates gets none, one of 16 gets 3. Within a segment it
    prefers a cut (no edge between candidates jumps over it, so backward recomputes the segments on either
    side separately), then the value that costs least to keep, then the last. A view of a leaf (a parameter's
    reshape or broadcast) is free to recompute and bounds nothing, so it is never chosen, and its edges do not
    break cuts. Sizes come from shape inference, so a lazy graph is not computed to choose.
    """

    def __call__(self, nodes, outputs=()):
        children = regions.stack_children(nodes)
        if children:  # a stack of n children (its output the last's): every ceil(sqrt n)-th child's outputs
            return EverySegment(math.ceil(math.sqrt(len(children) + 1)))(nodes)
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
            segment = [i for i in range(start, start + k) if 0 < cost[i] < math.inf]  # (unknown: never)
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
    if spec is None or element_shapes(spec[0]) is not None:  # a tuple value: unknown
        return math.inf
    return spec_nbytes(spec)


# "off" is no checkpointing at all (resolved to None: nothing annotated), the name gc.py's --policy off uses too;
# "offload" is the toolbox's (offload_all, loaded when named).
_POLICIES = {None: nothing_saveable, "all": nothing_saveable, "sqrt": Sqrt(), "selective": dots_saveable,
             "layers": KeepChildren(), "offload": "offload_all", "off": None}


def resolve_policy(policy=None, segment_len=None):
    """The policy callable for a policy name, a segment length, or a callable policy itself (returned as is);
    None for "off" (no checkpointing).

    A policy is a callable `policy(candidates, outputs) -> decisions`: `candidates` are a region's interior nodes
    in topological order, `outputs` its output nodes; it returns one decision per candidate: True keeps it as a
    checkpoint; False drops it, backward recomputes it; a `Store` (store.py) drops it into that store, which gives
    it back to backward (the toolbox's: `OFFLOAD`, host memory; `compress(bits, policy)`, k-bit codes on the
    device). `regions.apply_decision` writes the answer on the node. The built-in policies, `Budget` and `Planned`
    are all called this way."""
    if callable(policy):
        return policy
    if policy not in _POLICIES:
        raise ValueError(f"unknown checkpoint policy {policy!r}; use None, 'all', 'sqrt', 'selective', 'layers', "
                         f"'offload', 'off', Budget(bytes) or a callable (candidates, outputs) -> keep flags")
    if segment_len is not None and policy in (None, "all"):
        if int(segment_len) < 1:
            raise ValueError(f"segment_len must be >= 1, got {segment_len}")
        return EverySegment(int(segment_len))
    found = _POLICIES[policy]
    return lazy.load("offload").offload_all if found == "offload_all" else found


def annotate(out_node, in_nodes, segment_len=None, policy=None, label=None, stack=False):
    """Mark the nodes strictly between `in_nodes` and `out_node` as dropped, except the policy's checkpoints.

    Trade-off: every dropped node saves its bytes between the forward pass and its use in backward, and costs
    one recomputation during backward. `segment_len=k` keeps every k-th node as a checkpoint; `policy`
    ("sqrt", "selective", a Budget or any callable (candidates, outputs) -> decisions) chooses checkpoints
    otherwise.
    Rule 1: leaves (parameters, constants, dropout masks), `in_nodes`, `out_node`, one-element values
    (`backward.always_kept`: a loss) and the outputs of ops that are not `recomputable` (collectives) are never
    dropped: they are not candidates, so a policy never sees them. A node once dropped stays dropped, so nested
    regions compose (the inner region decides first). Eager mode releases the dropped values at once (the
    region's output exists); lazy mode releases them as they are consumed. `label` (a module's class name)
    only names the region in the DOT graph. `stack=True`: a stack of regions (a Transformer's layers, an LSTM's
    steps, a Sequential), whose children's outputs are its boundaries, candidates too (backward.plan_backward).

        x = ndl.Tensor(...); h = ops.relu(x @ w); y = h @ v
        annotate(y, [x])           # x @ w and relu(...) are recomputed in backward
    """
    keep_flags = resolve_policy(policy, segment_len)
    if keep_flags is None:  # policy "off": nothing is dropped
        return out_node
    outs = list(out_node) if isinstance(out_node, (list, tuple)) else [out_node]
    stop = {id(n) for n in in_nodes}
    boundary = stop | {id(n) for n in outs}
    order = find_topo_sort(outs, expand=lambda n: id(n) not in stop)
    candidates = [n for n in order if id(n) not in boundary and not n.is_leaf() and not n.drop and not always_kept(n)
                  and n.op.recomputable]  # a collective's output is kept: recomputing it would call it again
    if getattr(memory_hook.PREDICTOR, "eager", False):  # an eager step's dry run: what no gradient flows through
        candidates = [n for n in candidates if n.requires_grad]  # is a detached leaf when it really runs
    region = regions.new_region(label)
    if stack:
        regions.mark_boundaries(candidates, region)
    decisions = keep_flags(candidates, outs)
    if not isinstance(decisions, (list, tuple)) or len(decisions) < len(candidates):
        raise TypeError(f"checkpoint policy {keep_flags!r} returned a {type(decisions).__name__} for "
                        f"{len(candidates)} candidates: a policy returns a list of decisions, one per candidate "
                        f"(True, False or a Store), then optionally one per output")
    drop_outputs(outs, decisions[len(candidates):])
    for node, decision in zip(candidates, decisions):
        apply_decision(node, decision)
    if memory_hook.PREDICTOR is not None:  # ndl.memory.predict walks an eager step region by region: what each drops
        memory_hook.PREDICTOR.regions.append((outs, [n for n in candidates if n.drop]))
    for node in outs:
        if node.store is None:
            regions.note_reason(node, "boundary")
    for node in order:  # the inner region ran first and keeps its nodes
        if id(node) not in stop and not node.is_leaf():
            regions.note_region(node, region)
    return out_node


def drop_outputs(outputs, decisions):
    """A policy may answer for the region's outputs too, after its candidates (the toolbox's offloading Budget
    does): an output given a Store is put there once its last consumer has run, and brought back for backward.
    Only in lazy mode, where realization gives a value back after its last consumer; an eager forward keeps
    outputs (rule 1)."""
    for node, decision in zip(outputs, decisions):
        if isinstance(decision, Store) and autograd.LAZY_MODE and node.cached_data is None \
                and decision.accepts(node) and not always_kept(node):
            apply_decision(node, decision)


class NothingToDropWarning(UserWarning):
    """Checkpointing is on, yet no annotated region has an interior: backward will recompute nothing."""


def warn_if_nothing_to_drop(outputs, model_name):
    """Warn (NothingToDropWarning) when no region in the graph above `outputs` had an interior node to drop.

    A layer made of one op (a fused Linear, a ReLU) annotates a region whose only nodes are its input and its
    output, both kept (rule 1): so `enable_gc()` on such a layer alone changes nothing (in a stack, such as an
    nn.Sequential, the layers' outputs are the stack's to drop). A student trying the feature should hear it, so
    Module calls this after the first forward after `enable_gc`. A region has an interior when the policy saw
    candidates. Returns whether it warned.
    """
    roots, stack = [], [outputs]
    while stack:  # a model may return nested tuples of Tensors (an LSTM's (out, (h, c)))
        item = stack.pop()
        if isinstance(item, Value):
            roots.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    nodes = find_topo_sort(roots)
    if any(node.drop or regions.reason_noted(node) == "checkpoint" for node in nodes):
        return False
    labels = Counter(label for label, _ in {region_of(n) for n in nodes if region_of(n) is not None})
    named = ", ".join(f"{label} x{count}" for label, count in sorted(labels.items())) or "none"
    warnings.warn(f"{model_name}.enable_gc(): nothing to drop, so backward will recompute nothing. Regions "
                  f"without an interior (one op between input and output): {named}. Put the layers in an "
                  f"nn.Sequential (a stack: their outputs can be dropped), or make a region of several ops with "
                  f"checkpoint.checkpoint(fn, x)", NothingToDropWarning, stacklevel=3)
    return True


def _buffer(data):
    """The buffer under a value and its bytes: views share one (an NDArray's handle, a numpy array's base)."""
    handle = getattr(data, "buffer", None)
    if handle is not None:
        return handle, handle.size * itemsize(data.dtype)
    base = data
    while getattr(base, "base", None) is not None:
        base = base.base
    return base, int(base.nbytes)


def saved_residuals(root, exclude=()):
    """The buffers held in memory by the graph above `root`, one (node, reason, bytes) per buffer.

    Like JAX's print_saved_residuals: what is kept for backward, and why. Views of one buffer count once, at
    the buffer's size (a broadcast view costs what its base costs); a tuple value holds each of its elements'
    buffers (fused attention's row log-sum-exp is read by no view, yet kept);
    `exclude` (e.g. parameters and the batch) are left out.
    """
    seen = {id(_buffer(n.cached_data)[0]) for n in exclude if n.cached_data is not None}  # and views of them
    rows = []
    for node in find_topo_sort([root]):
        data = node.cached_data
        if data is None:
            if node.stored is not None:  # held by its store: host memory, or codes on the device
                spec = infer_spec(node)
                rows.append((node, keep_reason(node), node.store.device_bytes(spec) + node.store.host_bytes(spec)))
            continue
        for element in data if isinstance(data, tuple) else (data,):
            buffer, nbytes = _buffer(element)
            if id(buffer) in seen:
                continue
            seen.add(id(buffer))
            rows.append((node, keep_reason(node), nbytes))
    return rows


def print_saved_residuals(loss, exclude=()):
    """Print the buffers the graph above `loss` holds for backward, one row each, and why (as JAX's).

    Columns: a parameter's name (else the op that made the value, or "leaf"), shape, bytes, reason (see
    `keep_reason`), then the total. Call it between the forward pass and backward; `exclude` as in
    `saved_residuals`.
    """
    rows = [(getattr(node, "name", None) or ("leaf" if node.is_leaf() else type(node.op).__name__),
             str(tuple(node.shape)), f"{nbytes:,}", reason)
            for node, reason, nbytes in saved_residuals(loss, exclude)]
    table = [("name/op", "shape", "bytes", "reason")] + rows
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    for name, shape, nbytes, reason in table:
        print(f"{name:<{widths[0]}}  {shape:<{widths[1]}}  {nbytes:>{widths[2]}}  {reason}")
    device = sum(int(row[2].replace(",", "")) for row in rows if row[3] != "offloaded")
    host = sum(int(row[2].replace(",", "")) for row in rows if row[3] == "offloaded")
    packed = sum(int(row[2].replace(",", "")) for row in rows if row[3] == "compressed")
    print(f"total: {len(rows)} buffers, {device:,} bytes ({device / 2**20:.2f} MiB)"
          + (f" on the device ({packed:,} of them compressed codes)" if packed else "")
          + (f", {host:,} bytes ({host / 2**20:.2f} MiB) offloaded to host memory" if host else ""))


# ----- checkpointing a function or a stack of layers (PyTorch's torch.utils.checkpoint) ------------------------
def checkpoint(fn, *args, segment_len=None, policy=None):
    """Run `fn(*args)` without keeping its intermediate values; backward recomputes them from `args`.

    Trade-off: the values `fn` computes between its Tensor arguments and its output are freed as soon as the
    output exists (eager) or consumed (lazy), instead of living until backward; backward runs that part of
    `fn` once more, just before it needs it. Gradients are bit-identical to calling `fn(*args)` (rule 4b).

    Args:
        fn: a function or Module from Tensors to a Tensor or a tuple/list of Tensors. The Tensors it reads
            besides `args` should be leaves (parameters, constants): a computed Tensor captured from outside
            counts as interior (annotate's walk stops only at `args`), so pass it as an argument.
        *args: passed to `fn`; the Tensors among them are the region's inputs, kept (rule 1).
        segment_len, policy: which interior values to keep anyway, as for `annotate` (default: none).
    Returns `fn`'s output, itself kept (rule 1).

        h = checkpoint.checkpoint(lambda x: ops.relu(x @ w1) @ w2, x)
        h.sum().backward()      # x @ w1 and relu(...) are recomputed here
    """
    out = fn(*args)
    outs = [o for o in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(o, Value)]
    inputs = [a for a in args if isinstance(a, Value)]
    label = getattr(fn, "__name__", None) or type(fn).__name__  # a function's name, a module's class
    annotate(outs, inputs, segment_len=segment_len, policy=policy, label=label)
    return out


def checkpoint_sequential(modules, segments, x, segment_len=None, policy=None):
    """Run `modules` one after the other on `x`, as `segments` consecutive checkpointed chunks.

    Only the chunk ends (and leaves) stay in memory after the forward pass; backward rebuilds one chunk's module
    outputs at a time, then each module's interior: segments ~ sqrt(n) keeps O(sqrt n) activations for about one
    extra forward pass, with gradients bit-identical. It is what `enable_gc` does for an nn.Sequential (a stack),
    with the chunk ends kept (`KeepChildren`); each module (any callable Tensor -> Tensor, in an nn.Sequential or a
    list) is a region of its own, `segment_len` and `policy` passed to it. 1 <= segments <= len(modules); the
    chunks' lengths differ by at most one.

        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        y = checkpoint.checkpoint_sequential(model, 2, x)     # kept: x, model.modules[1]'s output, y
    """
    modules = list(getattr(modules, "modules", modules))  # nn.Sequential keeps its layers in `.modules`
    if not 1 <= segments <= len(modules):
        raise ValueError(f"checkpoint_sequential: segments must be between 1 and the number of modules "
                         f"({len(modules)}), got {segments}")
    chunk_ends = frozenset(i * len(modules) // segments - 1 for i in range(1, segments))
    first = x
    for i, module in enumerate(modules):
        start, x = x, module(x)
        annotate(x, [start], segment_len=segment_len, policy=policy, label=f"modules[{i}]")
    return annotate(x, [first], policy=KeepChildren(chunk_ends), label="checkpoint_sequential", stack=True)
