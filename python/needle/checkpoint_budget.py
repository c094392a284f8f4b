"""Budget(b): checkpoint so that a step's activation peak stays under b bytes, planned before anything is computed.

What it bounds is M_peak: the allocator's peak during forward + backward minus the bytes held when the step
starts (parameters, optimizer state, the batch). It counts every value the step creates — activations, dropout
masks and other constants, gradients — and the batch too (so it errs by the batch's bytes, on the safe side).

    model.enable_gc(policy=checkpoint.Budget(256 << 20))    # that is all: no plan() call
    loss = loss_fn(model(x), y); loss.backward()             # every lazy step stays under 256 MB

How: layers annotate their regions as usual. For a region it has not seen, Budget keeps everything for now and
defers the decision to the moment the graph is first realized (lazy mode: before anything is computed; eager
mode: when backward starts, so the first eager step traces and only later ones are bounded). Then it predicts
the step's peak for drop sets of growing size — cheapest to recompute first — and keeps the smallest that fits.
The prediction walks the very plan autograd will execute (`autograd.realize`, `backward.plan_backward`,
`backward.run_backward`) with a `Ledger` in place of the machine that computes: the ledger holds buffers and counts
bytes from the ops' own declarations (`view`/`view_strides`, `compacts_inputs`, `workspace`, the dtype's size).
The decisions are frozen into a table keyed by each region's structure (its candidates' ops and shapes), so
later steps replay them with no counters and no references to old graphs: an eval forward, a failed step or a
change of batch size never derails it (a new structure is simply planned again).
"""
import itertools
import math
import weakref
from dataclasses import dataclass

from . import offload
from .autograd import (Machine, defer_until_realized, element_shapes, elements_of, find_topo_sort, infer_spec,
                       itemsize, placeholder, realize, spec_nbytes)
from .backend_ndarray.ndarray import compact_strides  # the strides NDArray gives a compact array
from .backend_ndarray.ndarray import is_transposed_matrix  # the views a 2-D matmul reads in place
from .backward import plan_backward, run_backward
from .ops import MakeTensorTuple, TupleGetItem

__all__ = ["Budget", "Ledger", "Planned", "predict_peak"]


def _spec(node):
    spec = infer_spec(node)
    if spec is None:
        raise RuntimeError(f"Budget: cannot infer the shape of {type(node.op).__name__} without computing it; "
                           f"give the op an infer_shape")
    return spec


class Ledger(Machine):
    """A backward machine that computes nothing: it tracks which values would exist and the bytes they hold.

    Memory is counted per buffer, as the allocator does: a view (`op.view`, and `op.view_strides` not None for
    its input's strides) holds its base's buffer; a tuple's elements are buffers of their own. Values that exist
    when the walk starts are leaves; those that require grad (parameters) are not counted (they are held before
    the step starts), the others (batch, masks, constants) are.
    """

    def __init__(self, root, out_grad, offloaded=frozenset()):
        self.present, self.holders, self.size, self.buffers, self.strides = set(), {}, {}, {}, {}
        self.elements = {}  # buffer -> its elements (size is 0 for parameters' buffers: they are not counted)
        self.live = self.peak = self.made = 0
        # Offloading (offload.py): the ids of the values parked in host memory when forward releases them; the
        # host bytes they hold, at most; the bytes copied each way.
        self.offloaded, self.parked = offloaded, {}
        self.host_live = self.host_peak = self.offloaded_bytes = self.fetched_bytes = 0
        self.in_backward = False  # as backward.Compute's: run_backward sets it
        self.seen = []  # every node the walk met, kept alive so that no id is reused while the ledger counts it
        for node in find_topo_sort([root]) + [out_grad]:
            if node.is_leaf():
                self._own(node)
                self.present.add(id(node))
                if node.requires_grad and node is not out_grad:  # a parameter: held before the step, not counted
                    for key in self.buffers[id(node)]:
                        self.size[key] = 0
                self._hold(node)

    # -- buffers
    def _own(self, node):
        """Fresh buffers for `node`'s value: one per tuple element, else one."""
        self.seen.append(node)
        shape, dtype, _ = _spec(node)
        self.made += 1  # a recomputed value gets new buffers, even while views of its old ones are held
        elements = element_shapes(shape)  # a tuple value: one buffer per element
        keys = [(self.made, k) for k in range(len(elements or [shape]))]
        for key, s in zip(keys, elements or [shape]):
            self.elements[key] = math.prod(s)
            self.size[key] = math.prod(s) * itemsize(dtype)
        if elements is None:  # an array, compact: the ledger follows its views' strides
            self.strides[id(node)] = compact_strides(shape)
        self.buffers[id(node)] = keys

    def _alias(self, node):
        """The buffers a view's value lives in, or False if computing it makes a fresh buffer."""
        op = node.op
        if not op.view:
            return False
        if isinstance(op, MakeTensorTuple):  # packs its inputs' buffers
            self.buffers[id(node)] = [b for x in node.inputs for b in self.buffers[id(x)]]
            return True
        inp = node.inputs[0]
        if isinstance(op, TupleGetItem):  # an element of a tuple
            self.buffers[id(node)] = [self.buffers[id(inp)][op.index]]
            self.strides[id(node)] = compact_strides(_spec(node)[0])
            return True
        strides = self.strides.get(id(inp))
        out = strides and op.view_strides(_spec(inp)[0], strides, _spec(node)[0])
        if out is None or strides is None:
            return False
        self.buffers[id(node)], self.strides[id(node)] = self.buffers[id(inp)], out
        return True

    def _hold(self, node):
        for key in self.buffers[id(node)]:
            self.holders[key] = self.holders.get(key, 0) + 1
            if self.holders[key] == 1:
                self.live += self.size[key]

    def _workspace(self, node):
        """Bytes compute allocates besides its result: declared temporaries and compact copies of strided inputs."""
        shapes = [_spec(x)[0] for x in node.inputs]
        extra = node.op.workspace(*shapes)
        compacted = node.op.compacts_inputs  # True (every input) or the positions of the inputs it compacts
        transposed_in_place = node.op.reads_transposed(*shapes)
        for i, (x, shape) in enumerate(zip(node.inputs, shapes)):
            if compacted is True or (compacted and i in compacted):
                strides = self.strides.get(id(x))
                if strides is None or strides == compact_strides(shape):
                    continue
                if transposed_in_place and is_transposed_matrix(shape, strides) and self._whole_buffer(x, shape):
                    continue
                extra += elements_of(shape)
        return extra * itemsize(_spec(node)[1])

    def _whole_buffer(self, node, shape):
        keys = self.buffers[id(node)]
        return len(keys) == 1 and self.elements[keys[0]] == math.prod(shape)

    # -- the machine (autograd.Machine), as backward.Compute
    def has(self, node):
        if node.is_leaf() and id(node) not in self.present:  # a constant a gradient made: it exists, and counts
            self._own(node)
            self.present.add(id(node))
            self._hold(node)
        return id(node) in self.present

    def compute(self, node):
        if not self._alias(node):
            self._own(node)
        self.seen.append(node)
        self.present.add(id(node))
        self._hold(node)
        self.peak = max(self.peak, self.live + self._workspace(node))

    recompute = compute

    def fetch(self, node):
        """A parked value brought back: a fresh device buffer (offload.fetch), its host copy still held."""
        self._own(node)
        self.present.add(id(node))
        self._hold(node)
        self.fetched_bytes += self.parked[id(node)]
        self.peak = max(self.peak, self.live)

    def release(self, node):
        """As offload.release_value: an offloaded value is parked on its first release (forward), and its host copy
        goes with its last (backward)."""
        if id(node) in self.parked:
            if self.in_backward:
                self.host_live -= self.parked.pop(id(node))
        elif id(node) in self.offloaded and id(node) in self.present:
            nbytes = _bytes(node)
            self.parked[id(node)] = nbytes
            self.host_live += nbytes
            self.offloaded_bytes += nbytes
            self.host_peak = max(self.host_peak, self.host_live)
        if id(node) not in self.present:
            return
        self.present.discard(id(node))
        for key in self.buffers[id(node)]:
            self.holders[key] -= 1
            if self.holders[key] == 0:
                self.live -= self.size[key]

    def check_reads(self, node):
        pass

    def set_grad(self, node, grad):
        pass

    def value(self, node):
        return None


def predict_peak(root, dropped, regions=None, offloaded=frozenset()):
    """Predicted M_peak of a step on the graph above `root` if the values whose ids are in `dropped` were dropped
    (those also in `offloaded`: parked in host memory and fetched back, not recomputed).

    The forward pass is modelled as the executor runs it: lazy (`regions` None) — realization releases a dropped
    value after its last consumer; eager (`regions`: [(outputs, candidates)] in the order they ran) — every value
    lives until its region's output exists. Then the backward plan runs on the ledger. Nothing is computed.
    """
    return walk_step(root, dropped, regions, offloaded).peak


def walk_step(root, dropped, regions=None, offloaded=frozenset()):
    """The Ledger after walking a step's forward and backward passes (see predict_peak): its device `peak`, its
    `host_peak`, the bytes `offloaded_bytes` and `fetched_bytes` copied each way."""
    out_grad = placeholder(_spec(root))  # the root's gradient: its shape, dtype and device, no data
    ledger = Ledger(root, out_grad, offloaded)
    if regions is None:
        realize([root], lambda n: id(n) not in dropped, ledger)
    else:
        ends = {}
        for outputs, candidates in regions:
            ends.setdefault(id(outputs[-1]), []).extend(candidates)
        for node in find_topo_sort([root]):
            if not ledger.has(node):
                ledger.compute(node)
            for n in ends.get(id(node), ()):
                if id(n) in dropped:
                    ledger.release(n)
    run_backward(plan_backward(root, ledger.has, lambda n: id(n) in offloaded), out_grad, ledger)
    return ledger


def _structure(nodes):
    """A region's key: its candidates' ops and shapes (what a replay must match)."""
    return tuple((type(n.op).__name__, tuple(_spec(n)[0])) for n in nodes)


def recompute_cost_per_byte(node):
    """A node's recompute cost relative to the bytes that dropping it saves (matmul/conv cost the most)."""
    return 64.0 if node.op.saveable else 1.0


# Parking a value and fetching it back, per byte, on recompute_cost_per_byte's scale: two copies of its bytes, dearer
# than recomputing an element-wise op, cheaper than a matmul.
OFFLOAD_COST_PER_BYTE = 4.0


@dataclass(frozen=True)
class Planned:
    """A Budget's decisions, frozen: a pure policy from a region's structure to its keep flags.

    A region it has never seen keeps everything. Usable on its own: `model.enable_gc(policy=budget.plan(loss))`.
    """

    table: tuple  # ((region structure, keep flags), ...)

    def __call__(self, nodes, outputs=()):
        return list(dict(self.table).get(_structure(nodes), (True,) * len(nodes)))


class InfeasibleBudget(ValueError):
    """Budget(b) cannot be met: no choice of checkpoints brings this graph's peak under b (the message names the
    least peak it can reach; the Budget's minimum_peak holds it in bytes)."""


class Budget:
    """Keep the step's activation peak M_peak at or under `bytes`, at the least recompute cost (see the module doc).

    `plan(root)` may also be called by hand on a traced graph; it returns the frozen decisions as a `Planned`
    policy. An infeasible budget raises ValueError naming the least peak the graph can reach by checkpointing.
    """

    def __init__(self, bytes, offload=False, host_bandwidth=None):
        self.bytes = int(bytes)
        self.offload = bool(offload)  # may a value be parked in host memory instead of recomputed?
        self.host_bandwidth = host_bandwidth  # bytes/s to plan copies with (None: as measured on this machine)
        self.planned = {}  # region structure -> keep flags (True, False or OFFLOAD): the frozen policy
        self.predicted_peak = None
        self.predicted_time = None
        self.predicted_host_peak = None
        self.minimum_peak = None
        # The regions not decided yet, by number (the order they were annotated in): weak references to their
        # outputs and candidates. A region leaves when it is decided, or at once when its graph is gone (a
        # candidate's weak reference calls back), so this holds only live graphs' regions, whatever the steps.
        self._pending = {}
        self._numbers = itertools.count()

    def __repr__(self):
        return f"Budget({self.bytes}{', offload=True' if self.offload else ''})"

    def __call__(self, nodes, outputs=()):
        if not nodes:  # a region of one op (Linear, ReLU): nothing to decide
            return []
        flags = self.planned.get(_structure(nodes))
        if flags is not None:
            return list(flags)
        number, pending = next(self._numbers), self._pending

        def gone(_, number=number):  # no reference to the Budget: a dying graph never keeps it alive
            pending.pop(number, None)

        pending[number] = ([weakref.ref(n) for n in outputs], [weakref.ref(n, gone) for n in nodes])
        for n in nodes[:1]:  # the region's first value: realization reaches it before the rest
            defer_until_realized(n, self._decide)
        return [True] * len(nodes)

    def _decide(self, roots):
        if self._pending:
            self.plan(roots[0])

    def _take_regions_above(self, above):
        """The pending regions with a candidate in `above` (ids of a graph's values), in the order they were
        annotated; they are no longer pending."""
        regions = []
        for number, (outs, cands) in list(self._pending.items()):  # a copy: a dying graph's callback may pop
            candidates = [r() for r in cands]
            if all(n is not None for n in candidates) and any(id(n) in above for n in candidates):
                regions.append(([r() for r in outs], candidates))
                del self._pending[number]
        return regions

    def plan(self, root):
        """Choose what to drop in the graph above `root` (nothing computed), apply it, and freeze it; returns the
        frozen decisions (`Planned`)."""
        above = {id(n) for n in find_topo_sort([root])}
        regions = self._take_regions_above(above)
        if not regions:
            return Planned(tuple(self.planned.items()))
        # Group a node by the first region that lists it and its place there: regions of one structure (the
        # layers of a stack) get one decision per place, so the frozen table replays them all.
        group_of, groups = {}, {}
        for _, candidates in regions:
            key = _structure(candidates)
            for position, n in enumerate(candidates):
                if id(n) not in group_of and id(n) in above:  # a value outside the step frees nothing
                    group_of[id(n)] = (key, position)
                    groups.setdefault((key, position), []).append(n)
        # How each group would leave the device, and at what cost per byte: recomputed, or (offload=True) parked.
        how = {id(ns[0]): self._cheaper_way(ns[0]) for ns in groups.values()}
        ranked = sorted(groups.values(), key=lambda ns: (how[id(ns[0])][1], -_bytes(ns[0])))
        # Model the forward pass the way later steps will run it: lazily if this one has not been computed yet.
        eager = None if root.cached_data is None else [([o for o in outs if o is not None], c) for outs, c in regions]

        def chosen(t):  # (ids dropped, ids of those offloaded) with the t cheapest groups off the device
            dropped = {id(n) for ns in ranked[:t] for n in ns}
            return dropped, {id(n) for ns in ranked[:t] if how[id(ns[0])][0] is offload.OFFLOAD for n in ns}

        def predict(t):  # the peak with the t cheapest groups dropped
            return predict_peak(root, *chosen(t)[:1], eager, chosen(t)[1])

        self.minimum_peak = predict(len(ranked))
        if self.minimum_peak > self.bytes:
            raise InfeasibleBudget(f"{self!r} is infeasible: the least peak activation memory this graph can "
                                   f"reach by checkpointing is {self.minimum_peak} bytes "
                                   f"({self.minimum_peak / 2**20:.1f} MB)")
        lo, hi = 0, len(ranked)  # the fewest groups (cheapest recomputation) whose prediction fits
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if predict(mid) <= self.bytes else (mid + 1, hi)
        dropped, offloaded = chosen(lo)
        walk = walk_step(root, dropped, eager, offloaded)
        self.predicted_peak, self.predicted_host_peak = walk.peak, walk.host_peak
        gone = set()
        for _, candidates in regions:  # replay annotate's order: inner regions decide first, drops stay dropped
            remaining = [n for n in candidates if id(n) not in gone]
            self.planned[_structure(remaining)] = tuple(
                offload.OFFLOAD if id(n) in offloaded else id(n) not in dropped for n in remaining)
            for n in remaining:
                if id(n) in dropped:
                    n.drop = True
                    if id(n) in offloaded:
                        offload.mark(n)
                    offload.release_value(n)  # eager mode computed it already: recomputed, or parked, for backward
                    gone.add(id(n))
        return Planned(tuple(self.planned.items()))

    def _cheaper_way(self, node):
        """(how `node` leaves the device — False: recomputed, offload.OFFLOAD: parked in host memory —, its cost
        per byte)."""
        recompute = recompute_cost_per_byte(node)
        if self.offload and offload.offloadable(node) and OFFLOAD_COST_PER_BYTE < recompute:
            return offload.OFFLOAD, OFFLOAD_COST_PER_BYTE
        return False, recompute


def _bytes(node):
    return spec_nbytes(_spec(node))


from .checkpoint_optimal import OptimalPlan, optimal  # noqa: E402,F401  (issue #29: checkpoint_budget.optimal)
