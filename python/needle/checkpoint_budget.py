"""Budget(b): checkpoint so that a step's activation peak stays under b bytes, planned before anything is computed.

It bounds M_peak: the allocator's peak during forward + backward minus the bytes held when the step starts
(parameters, optimizer state), counting every value the step creates and the batch (on the safe side).

    model.enable_gc(policy=checkpoint.Budget(256 << 20))    # that is all: no plan() call
    loss = loss_fn(model(x), y); loss.backward()             # every lazy step stays under 256 MB

A region it has not seen keeps everything for now; the Budget plans at one moment, when backward starts
(`autograd.defer_until_backward`), with the whole graph in view: in lazy mode before any of it is computed (in
eager mode the forward has run, so only later steps are bounded). It ranks values by recompute seconds per byte,
priced from each op's FLOPs and bytes at fixed rates (costs.py: the same plan on every machine, no stopwatch, no
file), and bisects for the fewest that fit, each guess walked by the `Ledger` (ledger.py) through the very plan
backward will run. The decisions are frozen per region structure (`Planned`), so later steps replay them.

The toolbox extends it (`Budget(b, offload=True)`, `calibrate=True`: toolbox/budget_offload.py): values may leave
the device for host memory, gradients may be parked there, prices measured; `optimal` solves the choice exactly.
"""
import itertools
import math
import weakref
from dataclasses import dataclass

from . import lazy, memory_hook
from .autograd import defer_until_backward, find_topo_sort
from .costs import CostModel
from .ledger import Ledger, holds_base, predict_peak, value_bytes, walk_step
from .regions import apply_decision, region_structure, stack_children

__all__ = ["Budget", "InfeasibleBudget", "Ledger", "Planned", "boundary_keep_order", "predict_peak", "walk_step"]

# From the toolbox, on first use: the exact optimum (a mixed-integer program) and its plan.
__getattr__ = lazy.attributes(__name__, {"optimal": "checkpoint_optimal:optimal",
                                         "OptimalPlan": "checkpoint_optimal:OptimalPlan"})


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
        return list(dict(self.table).get(region_structure(nodes), (True,) * len(nodes)))


class InfeasibleBudget(ValueError):
    """Budget(b) cannot be met: no choice of checkpoints brings this graph's peak under b (the message names the
    least peak it can reach; `budget`, the Budget, holds it in bytes: minimum_peak)."""

    def __init__(self, message, budget=None):
        super().__init__(message)
        self.budget = budget


class Budget:
    """Keep the step's activation peak M_peak at or under `bytes`, at the least recompute cost (see the module doc).

    `plan(root)` may also be called by hand on a traced graph; it returns the frozen decisions as a `Planned`
    policy. An infeasible budget raises ValueError naming the least peak the graph can reach by checkpointing.
    `cost_model` prices recomputation (default: costs.CostModel(), fixed rates). `offload=True`, `calibrate=True`
    or a `host_bandwidth` make it the toolbox's Budget (toolbox/budget_offload.py), which reads them.
    """

    # Where parameters' complete gradients may go when nothing fits without: nowhere here (the toolbox's Budget
    # parks them in host memory).
    gradient_store = None

    def __new__(cls, bytes, offload=False, host_bandwidth=None, cost_model=None, calibrate=False):
        if cls is Budget and (offload or calibrate or host_bandwidth is not None):
            return super().__new__(lazy.load("budget_offload").OffloadBudget)
        return super().__new__(cls)

    def __init__(self, bytes, offload=False, host_bandwidth=None, cost_model=None, calibrate=False):
        self.bytes = _checked_bytes(bytes)
        self.cost_model = cost_model or CostModel()
        self.planned = {}  # region structure -> decisions (True, False or a Store): the frozen policy
        self.predicted_peak = None
        self.predicted_time = None  # seconds of a step under the plan: its compute plus what the plan adds
        self.predicted_added_time = None  # what the plan adds: recomputations (and the toolbox's copies)
        self.predicted_host_peak = None
        self.minimum_peak = None
        self.parks_gradients = False  # whether the plan sends parameters' gradients to `gradient_store`
        self.trace_seconds = 0.0  # the Python that built a lazy graph, in predicted_time (timed by the toolbox's)
        # The regions not decided yet, by number (the order they were annotated in): weak references to their
        # outputs and candidates. A region leaves when it is decided, or at once when its graph is gone (a
        # candidate's weak reference calls back), so this holds only live graphs' regions, whatever the steps.
        self._pending = {}
        self._numbers = itertools.count()

    def __repr__(self):
        return f"Budget({self.bytes})"

    def __call__(self, nodes, outputs=()):
        if not nodes:  # a region of one op (Linear, ReLU): nothing to decide
            return []
        flags = self.planned.get(region_structure(nodes))
        if flags is not None:
            return list(flags)
        number, pending = next(self._numbers), self._pending
        self._region_seen()

        def gone(_, number=number):  # no reference to the Budget: a dying graph never keeps it alive
            pending.pop(number, None)

        pending[number] = ([weakref.ref(n) for n in outputs], [weakref.ref(n, gone) for n in nodes])
        for n in nodes[:1]:  # the region's first value: backward's start reaches it
            defer_until_backward(n, self._decide)
        return [True] * len(nodes)

    def _region_seen(self):
        """A region this Budget has not planned was annotated (the toolbox's Budget times the trace from here)."""

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
        order = find_topo_sort([root])
        above = {id(n) for n in order}
        regions = self._take_regions_above(above)
        if not regions:
            return Planned(tuple(self.planned.items()))
        # (ndl.memory.predict traces an eager step without computing it: planned as the eager step it is)
        lazy_step = root.cached_data is None and not getattr(memory_hook.PREDICTOR, "eager", False)
        trace_seconds = self._trace_seconds(lazy_step)
        keys = [region_structure(candidates) for _, candidates in regions]
        # An output place is one decision per structure: none where a region of it gives a stack a boundary there.
        shared = {(key, p) for key, (outs, _) in zip(keys, regions) for p, n in enumerate(outs)
                  if n is not None and n.boundary}
        groups = self._groups(regions, keys, shared, above, lazy_step)
        # How each group would leave the device (False: recomputed; the toolbox's: a Store), at what seconds.
        forward = [n for n in order if not n.is_leaf()]
        around = sum(map(self.cost_model.compute_seconds, forward)) / max(len(forward), 1)  # one op's compute
        rebuild = _rebuild_seconds(regions, self.cost_model)  # a stack's boundary: its whole layer again
        how = {id(ns[0]): self._cheaper_way(ns[0], around, output=isinstance(place, tuple) and place[0] != "child",
                                            recompute=rebuild.get(id(ns[0])))
               for (_, place), ns in groups.items()}
        ranked = _ranked(groups, how)
        # Model the forward pass the way later steps will run it: lazily if this one has not been computed yet.
        eager = None if lazy_step else [([o for o in outs if o is not None], c) for outs, c in regions]
        params = [n for n in order if n.is_leaf() and n.requires_grad]
        t, gradient_store, walk = self._search(root, ranked, how, eager)
        decided = _chosen(ranked, how, t)
        self.predicted_peak, self.predicted_host_peak = walk.peak, walk.host_peak
        # the step (its ops forward and backward, the update, the Python that traced it) plus what the plan adds
        self.predicted_added_time = sum(how[id(ns[0])][1] for ns in ranked[:t] for _ in ns)
        self.predicted_added_time += self._gradient_seconds(params, gradient_store)
        self.predicted_time = self.cost_model.step_seconds(root) + trace_seconds + self.predicted_added_time
        self.parks_gradients = gradient_store is not None
        for p in params:  # a leaf's store is where its complete gradient goes (store.py)
            p.store = gradient_store
        self._apply(regions, keys, shared, decided, lazy_step)
        return Planned(tuple(self.planned.items()))

    def _trace_seconds(self, lazy_step):
        """Seconds of Python that built the graph, counted in predicted_time: none here (no stopwatch)."""
        return 0.0

    def _gradient_seconds(self, params, gradient_store):
        """Seconds that sending the parameters' gradients to `gradient_store` adds (none here)."""
        return 0.0

    def _search(self, root, ranked, how, eager):
        """(t, gradient store, the ledger's walk at t): the fewest of the `ranked` groups off the device that fit,
        and where parameters' gradients must go for it (`gradient_store`, only where nothing fits without). Sets
        `minimum_peak`; an infeasible budget raises here, before anything is computed."""
        walks = {}

        def walk(t, gradients):  # the ledger's walk with the t cheapest groups off the device (each walked once)
            if (t, gradients) not in walks:
                decided = _chosen(ranked, how, t)
                stores = {k: d for k, d in decided.items() if d is not False}
                walks[t, gradients] = walk_step(root, decided, eager, stores, gradients)
            return walks[t, gradients]

        n = len(ranked)
        least = walk(n, self.gradient_store)  # the least peak: everything off the device, the gradients too
        self.minimum_peak = least.peak
        if self.minimum_peak > self.bytes:
            raise InfeasibleBudget(f"{self!r} is infeasible: the least peak activation memory this graph can "
                                   f"reach by {self.means} is {self.minimum_peak} bytes "
                                   f"({self.minimum_peak / 2**20:.1f} MB)", self)
        target = max(self.minimum_peak, self.bytes * (1 - PREDICTION_MARGIN))  # (with room for prediction error)
        # Gradients leave the device only where nothing fits without: where everything off the device, the
        # gradients kept, peaks above the target. The least walk (which sent them) counted that peak as it went.
        gradients = self.gradient_store if least.peak_keeping_gradients > target else None
        # Bounds no walk can beat, from the least walk alone. Leaving fewer groups off the device only keeps
        # buffers alive longer, so at two moments of forward the least walk's bytes grow by the buffers of the
        # groups kept that it had freed by then: when backward begins (every kept value is alive) and when forward
        # peaks (the kept values made before it). A view that holds a buffer alive anyway adds nothing; where the
        # gradients go changes nothing in forward. On a stack of layers the second is exact where the peak sits at
        # the end of forward, so the search starts at the fewest groups it allows and, the walk there fitting, is
        # told without a walk that one group fewer does not.
        at_start = _suffix_sums([_bytes_freed_before(ns, least, least.forward_clock) for ns in ranked])
        at_peak = _suffix_sums([_bytes_freed_before(ns, least, least.forward_peak_clock) for ns in ranked])

        def bound(t):
            return max(least.peak, least.forward_live + at_start[t], least.forward_peak + at_peak[t])

        def peak(t):
            below = bound(t)
            return below if below > target else walk(t, gradients).peak
        t = fewest_that_fit(peak, n, target, bound)
        return t, gradients, walk(t, gradients)

    means = "checkpointing"  # how it takes values off the device, for the infeasible-budget message

    def _groups(self, regions, keys, shared, above, lazy_step):
        """{(region structure, place): its values}. A node goes by the first region that lists it and its place
        there: regions of one structure (the layers of a stack) get one decision per place, so the frozen table
        replays them all. A stack's boundaries come first, a place per child, in `_stack_boundaries`' order (its
        spine, never dropped, only where the toolbox's Budget may park it, as it may park outputs)."""
        group_of, groups, places = {}, {}, []
        for key, (_, candidates) in zip(keys, regions):
            dropped, spine = _stack_boundaries(candidates)
            places += [(key, ("child", child), n) for child, ns in dropped for n in ns] + [
                (key, ("spine", child), n) for child, ns in spine for _, n in self._output_places(ns, lazy_step)]
        for key, (outs, candidates) in zip(keys, regions):
            places += [(key, p, n) for p, n in enumerate(candidates) if not n.boundary]
            places += [(key, p, n) for p, n in self._output_places(outs, lazy_step) if (key, p[1]) not in shared]
        for key, position, n in places:
            if id(n) not in group_of and id(n) in above:  # a value outside the step frees nothing
                group_of[id(n)] = (key, position)
                groups.setdefault((key, position), []).append(n)
        return groups

    def _output_places(self, outs, lazy_step):
        """[(("out", position), output)] of a region's outputs that may leave the device too: none here (rule 1
        keeps them; the toolbox's Budget may park them in host memory)."""
        return []

    def _apply(self, regions, keys, shared, decided, lazy_step):
        """Freeze the decisions per region structure, in annotate's order (inner regions decide first, and what
        they drop is not a candidate of the regions around them), and apply them to this graph."""
        gone = set()
        for key, (outs, candidates) in zip(keys, regions):
            remaining = [n for n in candidates if id(n) not in gone]
            flags = tuple(decided.get(id(n), True) for n in remaining)
            out_flags = [True if (key, p) in shared or o is None or id(o) in gone else decided.get(id(o), True)
                         for p, o in enumerate(outs)]  # outputs the toolbox's Budget parks (rule 1 keeps the rest)
            moved_outputs = [o for o, f in zip(outs, out_flags) if lazy_step and f is not True and f is not False]
            if moved_outputs:  # its outputs' decisions follow its candidates' (checkpoint.drop_outputs)
                flags += tuple(out_flags)
            self.planned[region_structure(remaining)] = flags
            for n in moved_outputs + remaining:
                if id(n) in decided:
                    apply_decision(n, decided[id(n)])  # eager mode computed it: released now, recomputed later
                    gone.add(id(n))

    def _cheaper_way(self, node, around, output=False, recompute=None):
        """(how `node` leaves the device — False: recomputed; the toolbox's Budget may answer a Store —, what that
        costs in seconds; `recompute`: the seconds of recomputing it, where that is more than its own op's)."""
        return False, self.cost_model.compute_seconds(node) if recompute is None else recompute


def boundary_keep_order(n):
    """A stack's n children (0 .. n-1) in the order to keep their outputs, and how many are never dropped.
    Backward holds a dropped run of boundaries (Chen's scheme), so the kept ones stay evenly spread: the middle
    child first, then the quarters, ... The first ceil(sqrt(n + 1)) - 1 (Chen's spine) are never dropped: beyond
    them, the runs backward holds grow more than the bytes saved. The Budget drops the rest in reverse order."""
    order, gaps = [], [(0, n + 1)]
    for a, b in gaps:  # boundaries 1 .. n between the stack's input (0) and output (n + 1)
        if b - a > 1:
            order.append((a + b) // 2 - 1)
            gaps += [(a, (a + b) // 2), ((a + b) // 2, b)]
    return order, math.ceil(math.sqrt(n + 1)) - 1


def _stack_boundaries(candidates):
    """([(child, its outputs)] of a stack's boundaries the Budget may drop, in the order it drops them; the same of
    those it never drops, Chen's spine)."""
    children = stack_children(candidates)
    order, spine = boundary_keep_order(len(children))
    outputs = [(child, [candidates[i] for i in children[child]]) for child in order]
    return outputs[spine:][::-1], outputs[:spine]


def _rebuild_seconds(regions, cost_model):
    """{id of a stack's boundary: the seconds of rebuilding it, its layer's interior dropped too}: the stack's mean
    layer (the same for all, so `_stack_boundaries`' order stands), shared by a child's outputs (h and c)."""
    seconds = {}
    for _, candidates in regions:
        children = stack_children(candidates)
        if not children:
            continue
        layers = sum(cost_model.compute_seconds(n) for n in candidates[:children[-1][-1] + 1])
        seconds.update({id(candidates[i]): layers / len(children) / len(ps) for ps in children for i in ps})
    return seconds


def _checked_bytes(value):
    """The bound in bytes: a positive integer (a bool, a float with a fraction, a string or a non-positive number
    is a ValueError naming Budget)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf") \
            or value != int(value):
        raise ValueError(f"Budget: the bound must be a positive number of bytes (e.g. Budget(64 << 20) for 64 MiB), "
                         f"got {value!r}")
    return int(value)


def _ranked(groups, how):
    """The groups in the order the Budget takes them off the device: cheapest per byte freed first.

    A view holds no buffer of its own, so dropping it frees nothing, yet while it is kept the buffer of the value
    it views cannot be freed. So each view's group goes with the group of the value it views (followed through
    views), just before it, its cost counted in that bundle's, freeing nothing itself; a view of a value that is
    no candidate goes last (it may be the last holder of its base's buffer).
    """
    group_of = {id(n): key for key, ns in groups.items() for n in ns}
    views_of, loose = {key: [] for key in groups}, []
    for key, ns in groups.items():
        base = ns[0]
        while holds_base(base):
            base = base.inputs[0]
        if not holds_base(ns[0]):
            continue
        owner = group_of.get(id(base))
        (views_of[owner] if owner is not None else loose).append(key)

    def seconds(key):
        return how[id(groups[key][0])][1] * len(groups[key])

    def nbytes(key):
        return sum(map(value_bytes, groups[key]))
    bases = [key for key in groups if not holds_base(groups[key][0])]
    bases.sort(key=lambda k: ((seconds(k) + sum(map(seconds, views_of[k]))) / max(nbytes(k), 1), -nbytes(k)))
    return [groups[k] for base in bases for k in views_of[base] + [base]] + [groups[k] for k in loose]


def _bytes_freed_before(group, least, clock):
    """Bytes the `least` walk (everything off the device) had freed, of the buffers a group's values made in forward,
    by forward's moment `clock`: what keeping them would add then (a view holds no buffer of its own)."""
    return sum(least.size[key] for n in group if not holds_base(n) for key in least.forward_buffers.get(id(n), ())
               if least.born[key] <= clock and least.freed.get(key, clock) < clock)


def _suffix_sums(values):
    """[sum(values[t:]) for t in range(len(values) + 1)]."""
    return list(itertools.accumulate(reversed(values)))[::-1] + [0]


def _chosen(ranked, how, t):
    """{id: decision} of the values off the device with the t cheapest groups of `ranked` off it: False
    (recomputed) or a Store."""
    return {id(n): how[id(ns[0])][0] for ns in ranked[:t] for n in ns}


def fewest_that_fit(peak, n, target, estimate=None):
    """The least t in [0, n] with peak(t) <= target, given peak(n) <= target (peak: falling as t grows).

    Each walk of the ledger costs about a backward pass, so the search starts where a cheap model says the peak
    crosses the target: `estimate(t)`, a guess at peak(t) from bytes alone (the Budget's: its lower bound, exact on
    a stack of layers: see `_search`). It walks there, then toward the crossing: down one step (doubling while the
    walks fit), or up to where the estimate, shifted by how far it was off, says the crossing is; once walks have
    been on both sides, it halves the interval. With a good estimate, two walks.
    Without one (None), the estimate is the straight line between peak(0) and peak(n).
    """
    if estimate is None:
        high, low = peak(0), peak(n)
        estimate = lambda t: high + (low - high) * t / max(n, 1)  # noqa: E731
    lo, hi = -1, n  # lo: -1 or a t known not to fit; hi: a t known to fit
    t = next((t for t in range(n + 1) if estimate(t) <= target), n)
    step, direction, bracketed = 1, 0, False
    while hi - lo > 1:
        t = min(max(t, lo + 1), hi - 1)
        fits = peak(t) <= target
        toward = -1 if fits else 1  # fits: the least t may lie below; does not: it lies above
        bracketed = bracketed or (direction != 0 and toward != direction)
        step = step * 2 if toward == direction else 1
        direction = toward
        if fits:
            hi = t
        else:
            lo = t
        if bracketed:
            t = (lo + hi) // 2
        elif fits:
            t -= step
        else:  # up to where the estimate, shifted by how far it was off here, says the peak crosses the target
            shift = peak(t) - estimate(t)
            t = max(t + step, next((u for u in range(lo + 1, hi) if estimate(u) + shift <= target), hi))
    return hi
