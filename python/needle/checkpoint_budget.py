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
import time
import weakref
from dataclasses import dataclass

from . import offload
from .autograd import defer_until_realized, find_topo_sort
from .backward import always_kept
from .checkpoint_optimal import OptimalPlan, optimal
from .cost_model import CostModel, device_copies_overlap
from .ledger import Ledger, holds_base, predict_peak, value_bytes, walk_step
from .regions import region_structure

__all__ = ["Budget", "InfeasibleBudget", "Ledger", "OptimalPlan", "Planned", "optimal", "predict_peak", "walk_step"]


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
        self.predicted_time = None  # seconds of a step under the plan: its compute plus what the plan adds
        self.predicted_added_time = None  # what the plan adds: recomputations, copies not hidden
        self.predicted_host_peak = None
        self.minimum_peak = None
        self.parks_gradients = False  # offload=True and nothing fit without: parameters' gradients go to the host
        # Seconds the forward pass spent building the graph in Python (lazy mode), timed from the first region it
        # annotated to the plan: not ops, so no cost model sees it (a module's own work, such as Dropout drawing
        # the course's random numbers), yet a step pays it. 0 in eager mode, whose trace computes as it goes.
        self.trace_seconds = 0.0
        self._traced_since = None
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
        flags = self.planned.get(region_structure(nodes))
        if flags is not None:
            return list(flags)
        number, pending = next(self._numbers), self._pending
        if self._traced_since is None:
            self._traced_since = time.perf_counter()

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
        order = find_topo_sort([root])
        above = {id(n) for n in order}
        regions = self._take_regions_above(above)
        if not regions:
            return Planned(tuple(self.planned.items()))
        lazy = root.cached_data is None
        self.trace_seconds = time.perf_counter() - self._traced_since if lazy and self._traced_since else 0.0
        self._traced_since = None
        groups = self._groups(regions, above, lazy)
        # How each group would leave the device, and at what cost in seconds: recomputed, or (offload=True) parked.
        forward = [n for n in order if not n.is_leaf()]
        around = sum(map(self.cost_model.compute_seconds, forward)) / max(len(forward), 1)  # one op's compute
        how = {id(ns[0]): self._cheaper_way(ns[0], around, output=isinstance(place, tuple))
               for (_, place), ns in groups.items()}
        ranked = _ranked(groups, how)
        # Model the forward pass the way later steps will run it: lazily if this one has not been computed yet.
        eager = None if root.cached_data is None else [([o for o in outs if o is not None], c) for outs, c in regions]
        params = [n for n in order if n.is_leaf() and n.requires_grad]
        t, park, walk = self._search(root, ranked, how, eager, params)
        dropped, offloaded = _chosen(ranked, how, t)
        self.predicted_peak, self.predicted_host_peak = walk.peak, walk.host_peak
        # the step (its ops forward and backward, the update, the Python that traced it) plus what the plan adds
        self.predicted_added_time = sum(how[id(ns[0])][1] for ns in ranked[:t] for _ in ns)
        if park:  # each gradient to the host and back for its update
            self.predicted_added_time += sum(self.cost_model.copy_seconds(value_bytes(p), way)
                                             for p in params for way in ("to_host", "to_device"))
        self.predicted_time = self.cost_model.step_seconds(root) + self.trace_seconds + self.predicted_added_time
        self.parks_gradients = park
        offload.unmark_gradients(params)
        for p in params if park else ():
            offload.mark_gradient(p)
        self._apply(regions, dropped, offloaded, lazy)
        return Planned(tuple(self.planned.items()))

    def _search(self, root, ranked, how, eager, params):
        """(t, park, the ledger's walk at t): the fewest of the `ranked` groups off the device that fit, and whether
        parameters' gradients must be parked for it (only where offloading is allowed and nothing fits without).
        Sets `minimum_peak`; an infeasible budget raises here, before anything is computed."""
        walks = {}

        def walk(t, park):  # the ledger's walk with the t cheapest groups off the device (each walked once)
            if (t, park) not in walks:
                dropped, offloaded = _chosen(ranked, how, t)
                walks[t, park] = walk_step(root, dropped, eager, offloaded, park)
            return walks[t, park]

        n = len(ranked)
        least = walk(n, self.offload)  # the least peak: everything off the device, and the gradients too if allowed
        self.minimum_peak = least.peak
        if self.minimum_peak > self.bytes:
            raise InfeasibleBudget(f"{self!r} is infeasible: the least peak activation memory this graph can "
                                   f"reach by checkpointing{' and offloading' if self.offload else ''} is "
                                   f"{self.minimum_peak} bytes ({self.minimum_peak / 2**20:.1f} MB)")
        target = max(self.minimum_peak, self.bytes * (1 - PREDICTION_MARGIN))  # (with room for prediction error)
        # Gradients are parked only where nothing fits without: where everything off the device, the gradients
        # kept, peaks above the target. The least walk (which parked them) counted that peak as it went.
        park = self.offload and least.peak_keeping_gradients > target
        # Bounds no walk can beat, from the least walk alone. Leaving fewer groups off the device only keeps
        # buffers alive longer, so at two moments of forward the least walk's bytes grow by the buffers of the
        # groups kept that it had freed by then: when backward begins (every kept value is alive) and when forward
        # peaks (the kept values made before it). A view that holds a buffer alive anyway adds nothing; parking
        # gradients changes nothing in forward. On a stack of layers the second is exact where the peak sits at
        # the end of forward, so the search starts at the fewest groups it allows and, the walk there fitting, is
        # told without a walk that one group fewer does not.
        at_start = _suffix_sums([_bytes_freed_before(ns, least, least.forward_clock) for ns in ranked])
        at_peak = _suffix_sums([_bytes_freed_before(ns, least, least.forward_peak_clock) for ns in ranked])

        def bound(t):
            return max(least.peak, least.forward_live + at_start[t], least.forward_peak + at_peak[t])

        def peak(t):
            below = bound(t)
            return below if below > target else walk(t, park).peak
        t = fewest_that_fit(peak, n, target, bound)
        return t, park, walk(t, park)

    def _groups(self, regions, above, lazy):
        """{(region structure, place): its values}. A node goes by the first region that lists it and its place
        there: regions of one structure (the layers of a stack) get one decision per place, so the frozen table
        replays them all. With offload=True, in a lazy step, a region's outputs (which recomputation starts from)
        are places too: eager mode never gives an output back in its forward pass."""
        group_of, groups = {}, {}
        for outs, candidates in regions:
            key = region_structure(candidates)
            places = list(enumerate(candidates))
            if self.offload and lazy:
                places += [(("out", position), n) for position, n in enumerate(outs)
                           if n is not None and offload.offloadable(n) and not always_kept(n)]
            for position, n in places:
                if id(n) not in group_of and id(n) in above:  # a value outside the step frees nothing
                    group_of[id(n)] = (key, position)
                    groups.setdefault((key, position), []).append(n)
        return groups

    def _apply(self, regions, dropped, offloaded, lazy):
        """Freeze the decisions per region structure, in annotate's order (inner regions decide first, and what
        they drop is not a candidate of the regions around them), and apply them to this graph."""
        gone = set()
        for outs, candidates in regions:
            remaining = [n for n in candidates if id(n) not in gone]
            flags = tuple(offload.OFFLOAD if id(n) in offloaded else id(n) not in dropped for n in remaining)
            parked_outputs = [o for o in outs if lazy and o is not None and id(o) in offloaded and id(o) not in gone]
            if parked_outputs:  # its outputs' flags follow its candidates' (annotate: offload_outputs)
                flags += tuple(offload.OFFLOAD if n is not None and id(n) in offloaded else True for n in outs)
            self.planned[region_structure(remaining)] = flags
            for n in parked_outputs + remaining:
                if id(n) in dropped:
                    n.drop = True
                    if id(n) in offloaded:
                        offload.mark(n)
                    offload.release_value(n)  # eager mode computed it already: recomputed, or parked, for backward
                    gone.add(id(n))

    def _cheaper_way(self, node, around, output=False):
        """(how `node` leaves the device — False: recomputed, offload.OFFLOAD: parked in host memory —, what that
        costs in seconds). A copy to the host and back; where copies overlap compute, the part of each that the
        compute beside it (`around`: one op's seconds) does not hide. A region's `output` can only be parked."""
        recompute = self.cost_model.compute_seconds(node)
        if not (self.offload and offload.offloadable(node)):
            return False, recompute
        copies = [self.cost_model.copy_seconds(value_bytes(node), way) for way in ("to_host", "to_device")]
        if self.copies_overlap():
            copies = [c - self.cost_model.hidden_seconds(c, around) for c in copies]
        return (offload.OFFLOAD, sum(copies)) if output or sum(copies) < recompute else (False, recompute)


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
    """(ids dropped, ids of those offloaded) with the t cheapest groups of `ranked` off the device."""
    dropped = {id(n) for ns in ranked[:t] for n in ns}
    return dropped, {id(n) for ns in ranked[:t] if how[id(ns[0])][0] is offload.OFFLOAD for n in ns}


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
