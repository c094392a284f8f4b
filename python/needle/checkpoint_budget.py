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
from .backward import always_kept, plan_backward, run_backward
from .cost_model import CostModel, device_copies_overlap
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


# The Budget plans for a peak this much under its bound, where it can: the ledger's prediction is within 1% of the
# allocator's, and the bound is a promise (M_peak <= bytes at every step, the first included).
PREDICTION_MARGIN = 0.01


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

    def __init__(self, bytes, offload=False, host_bandwidth=None, cost_model=None):
        self.bytes = int(bytes)
        self.offload = bool(offload)  # may a value be parked in host memory instead of recomputed?
        self.host_bandwidth = host_bandwidth  # bytes/s to plan copies with (None: as measured on this machine)
        # Seconds to recompute a value or to copy it (cost_model.py): calibrated once per machine and cached, read
        # here, when the Budget is made, so that no step's planning pays for it.
        self.cost_model = cost_model or CostModel(host_bandwidth=host_bandwidth)
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

    def copies_overlap(self):
        """Whether copies run beside compute: on a device with a copy stream, or when planning for a given link."""
        return self.host_bandwidth is not None or device_copies_overlap(self.cost_model.device)

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
        # Eager mode never gives a region's output back in its forward pass, so only a lazy step offloads outputs:
        # with offload=True a region's output, the checkpoint recomputation starts from, may be parked too.
        lazy = root.cached_data is None
        group_of, groups = {}, {}
        for outs, candidates in regions:
            key = _structure(candidates)
            places = [(position, n) for position, n in enumerate(candidates)]
            if self.offload and lazy:
                places += [(("out", position), n) for position, n in enumerate(outs)
                           if n is not None and offload.offloadable(n) and not always_kept(n)]
            for position, n in places:
                if id(n) not in group_of and id(n) in above:  # a value outside the step frees nothing
                    group_of[id(n)] = (key, position)
                    groups.setdefault((key, position), []).append(n)
        # How each group would leave the device, and at what cost in seconds: recomputed, or (offload=True) parked.
        forward = [n for n in find_topo_sort([root]) if not n.is_leaf()]
        around = sum(map(self.cost_model.compute_seconds, forward)) / max(len(forward), 1)  # one op's compute
        how = {id(ns[0]): self._cheaper_way(ns[0], around, output=isinstance(place, tuple))
               for (_, place), ns in groups.items()}
        ranked = sorted(groups.values(), key=lambda ns: (how[id(ns[0])][1] / max(_bytes(ns[0]), 1), -_bytes(ns[0])))
        # Model the forward pass the way later steps will run it: lazily if this one has not been computed yet.
        eager = None if root.cached_data is None else [([o for o in outs if o is not None], c) for outs, c in regions]

        def chosen(t):  # (ids dropped, ids of those offloaded) with the t cheapest groups off the device
            dropped = {id(n) for ns in ranked[:t] for n in ns}
            return dropped, {id(n) for ns in ranked[:t] if how[id(ns[0])][0] is offload.OFFLOAD for n in ns}

        walks = {}

        def walk(t):  # the ledger's walk with the t cheapest groups off the device (each t walked once)
            if t not in walks:
                walks[t] = walk_step(root, *chosen(t)[:1], eager, chosen(t)[1])
            return walks[t]

        self.minimum_peak = walk(len(ranked)).peak
        if self.minimum_peak > self.bytes:
            raise InfeasibleBudget(f"{self!r} is infeasible: the least peak activation memory this graph can "
                                   f"reach by checkpointing is {self.minimum_peak} bytes "
                                   f"({self.minimum_peak / 2**20:.1f} MB)")
        target = max(self.minimum_peak, self.bytes * (1 - PREDICTION_MARGIN))  # (with room for prediction error)
        t = fewest_that_fit(lambda t: walk(t).peak, len(ranked), target)
        dropped, offloaded = chosen(t)
        self.predicted_peak, self.predicted_host_peak = walk(t).peak, walk(t).host_peak
        # forward + backward, about three forward passes, plus what leaving the device costs
        self.predicted_time = 3 * around * len(forward) + sum(how[id(ns[0])][1] for ns in ranked[:t] for _ in ns)
        gone = set()
        for outs, candidates in regions:  # replay annotate's order: inner regions decide first, drops stay dropped
            remaining = [n for n in candidates if id(n) not in gone]
            flags = tuple(offload.OFFLOAD if id(n) in offloaded else id(n) not in dropped for n in remaining)
            parked_outputs = [o for o in outs if lazy and o is not None and id(o) in offloaded and id(o) not in gone]
            if parked_outputs:  # its outputs' flags follow its candidates' (annotate: offload_outputs)
                flags += tuple(offload.OFFLOAD if n is not None and id(n) in offloaded else True for n in outs)
            self.planned[_structure(remaining)] = flags
            for n in parked_outputs + remaining:
                if id(n) in dropped:
                    n.drop = True
                    if id(n) in offloaded:
                        offload.mark(n)
                    offload.release_value(n)  # eager mode computed it already: recomputed, or parked, for backward
                    gone.add(id(n))
        return Planned(tuple(self.planned.items()))

    def _cheaper_way(self, node, around, output=False):
        """(how `node` leaves the device — False: recomputed, offload.OFFLOAD: parked in host memory —, what that
        costs in seconds). A copy to the host and back; where copies overlap compute, the part of each that the
        compute beside it (`around`: one op's seconds) does not hide. A region's `output` can only be parked."""
        recompute = self.cost_model.compute_seconds(node)
        if not (self.offload and offload.offloadable(node)):
            return False, recompute
        copies = [self.cost_model.copy_seconds(_bytes(node), way) for way in ("to_host", "to_device")]
        if self.copies_overlap():
            copies = [c - self.cost_model.hidden_seconds(c, around) for c in copies]
        return (offload.OFFLOAD, sum(copies)) if output or sum(copies) < recompute else (False, recompute)


def fewest_that_fit(peak, n, target):
    """The least t in [0, n] with peak(t) <= target, given peak(n) <= target (peak: falling as t grows). Each walk
    of the ledger costs about a backward pass, so instead of halving the interval the search guesses where the
    peak crosses the target by interpolating between the interval's ends (a falsi step), halving only when a guess
    lands on an end: a few walks instead of log2(n)."""
    lo, hi = 0, n  # peak(hi) fits; lo is the least t that may fit
    if peak(0) <= target:
        return 0
    high, low = peak(0), peak(n)  # peak at lo (does not fit) and at hi (fits)
    while hi - lo > 1:
        guess = lo + int((high - target) / max(high - low, 1) * (hi - lo))
        t = guess if lo < guess < hi else (lo + hi) // 2
        if peak(t) <= target:
            hi, low = t, peak(t)
        else:
            lo, high = t, peak(t)
    return hi


def _bytes(node):
    return spec_nbytes(_spec(node))


from .checkpoint_optimal import OptimalPlan, optimal  # noqa: E402,F401  (issue #29: checkpoint_budget.optimal)
