"""How good is a checkpointing plan? optimal(root, bytes): the least added step time under a peak, as a MILP.

The Budget chooses greedily: cheapest per byte first, until the predicted peak fits. `optimal` solves the same
choice exactly (keep, drop or offload each group of values) as a mixed-integer linear program with SciPy's
`milp` (HiGHS), so the Budget's predicted time can be put beside the least one reachable at the same budget.

    plan = checkpoint_budget.optimal(loss, 64 << 20, offload=True)    # loss: a traced graph, computed or not
    plan.predicted_peak, plan.predicted_time, len(plan.dropped), len(plan.offloaded)

How, in four steps:
  1. Groups. The candidates are the graph's non-leaf values other than the root, one-element values
     (`backward.always_kept`), views (they hold their base's buffer) and what cannot be recomputed (a collective's
     output). They are grouped as the Budget groups them — a value of an annotated region by its region's structure
     and its place there, so the layers of a stack share one decision per place — and a value outside every region
     by (op class, shape, dtype). A view goes with the value whose buffer it holds (kept, it would keep that
     buffer on the device; recomputed, it costs nothing). A stack's boundaries (its layers' outputs) are grouped
     twice over: each a group of its own, or at its layer's place; the program is solved for both groupings and
     the faster verified plan is returned (many small interacting choices can mislead the linearization).
  2. Deltas. The peak is not linear in the choice, so it is linearized: the step is walked by the Budget's ledger
     once with nothing off the device, and once per (group, way) with only that group dropped (or offloaded),
     writing down the device bytes at fixed points of the walk — after every value computed, in forward and in
     backward (each point holds the most bytes since the one before: a recomputation or a fetch falls into the
     point of the next computed value). Every walk computes the same forward values and the same gradient values
     in the same order, so the points align; a group's delta at a point is its walk's bytes there minus the base's.
  3. The program. Binary x_drop and x_offload per group (x_offload only with offload=True, for groups of arrays:
     `offload.offloadable`; their views are recomputed from the fetched value), x_drop + x_offload <= 1; at every
     point base + sum(delta * x) <= bytes; minimize the seconds added: a dropped group's recomputation
     (`CostModel.compute_seconds` of the members its walk recomputed), an offloaded group's copies each way that no
     compute hides (all of them on a device whose copies do not overlap compute, as on cpu()).
  4. The check. The deltas are not exactly additive (two groups recomputed in one step are alive together), so the
     solution is walked once more by the ledger the Budget trusts: if its true peak exceeds `bytes`, the bound is
     tightened by the excess at each point where the walk held more than the program predicted (`Program.learn`),
     and the program solved again (a few rounds). The plan's figures are `walk_step`'s.

So "optimal" means: optimal for the linearized model, with its peak verified by the ledger. The least peak, which an
infeasible `bytes` is told, is the least the ledger verifies among three plans: every group off the device
(offloaded where it may be), the same with the annotated regions' outputs kept, and the program's plan of least
linearized peak (min t subject to base + sum(delta * x) <= t). Should no round of step 4 verify (at the least peak
itself the model has no slack), that least-peak plan is returned: it fits.
The step is modelled as lazy mode runs it (realization releases a dropped value after its last consumer), and the
graph's own drop flags and offload marks are ignored: it works on any traced graph, planned by a Budget or not.
"""
import math
import time
from dataclasses import dataclass

import numpy

from .. import costs
from ..autograd import find_topo_sort, infer_spec, placeholder, realize, spec_nbytes
from ..backward import always_kept, plan_backward, run_backward
from ..checkpoint_budget import boundary_keep_order
from ..ledger import Ledger, holds_base, walk_step
from ..regions import keep_reason, region_of
from .cost_model import CostModel, device_copies_overlap
from .offload import OFFLOAD, offloadable

__all__ = ["OptimalPlan", "PointLedger", "added_seconds", "find_groups", "optimal", "walk_points"]

ROUNDS = 8  # solves at most: each corrects the points where the last solution held more than the model predicted
# Seconds added to every way in the objective: among plans of equal time (a value no gradient reads costs nothing
# to drop) the program prefers the one that moves fewer groups. Not counted in predicted_time.
TIE_BREAK = 1e-9


@dataclass(frozen=True)
class OptimalPlan:
    """The optimum of `optimal`: what leaves the device, and what the ledger predicts for it.

    `dropped` (recomputed in backward) and `offloaded` (parked in host memory, fetched back) are disjoint tuples of
    the graph's nodes (a plan holds its graph alive). `predicted_time` is a step's seconds under the plan, by the cost
    model, as the Budget's `predicted_time`: the step's compute (`CostModel.step_seconds`) plus what the plan adds,
    `added_time` (recomputations, copy time not hidden under compute).
    """

    predicted_peak: int  # device bytes (M_peak), walked by the Budget's ledger
    predicted_time: float  # seconds: the step's compute + added_time
    added_time: float  # recompute + exposed copies
    predicted_host_peak: int  # host bytes held by parked values, at most
    dropped: tuple
    offloaded: tuple
    groups: int  # how many groups the program chose among
    solve_seconds: float  # in scipy.optimize.milp, all rounds (the walks that build the program not included)


# ----- groups ---------------------------------------------------------------------------------------------------
def _candidate(node, root):
    return (node is not root and not node.is_leaf() and not holds_base(node) and node.op.recomputable
            and not always_kept(node))



def _describe(node):
    shape, dtype, _ = infer_spec(node)
    return type(node.op).__name__, tuple(shape), str(dtype)


def find_groups(root, split_boundaries=True):
    """The candidates above `root` (see the module doc), grouped: a list of lists of nodes, in program order.

    A value of an annotated region (`checkpoint.region_of`) joins the values at its place in every region of the
    same structure (its candidates' ops, shapes and dtypes), as the Budget groups them; a stack's boundary (a
    layer's output, `Value.boundary`) is a group of its own with `split_boundaries` (as with the Budget), else at
    its layer's place like the rest; any other value joins those of its op class, shape and dtype. A view (not a
    candidate) goes with the value whose buffer it holds: a kept view would keep its dropped base's bytes on the
    device, and recomputing a view costs nothing.
    """
    order = find_topo_sort([root])
    by_region, groups, place = {}, {}, {id(n): i for i, n in enumerate(order)}
    for node in order:
        if not _candidate(node, root):
            continue
        region = region_of(node)
        if node.boundary and split_boundaries:  # a layer's output in a stack: which to keep is a choice of its own
            groups.setdefault(("boundary", node.boundary.stack, node.boundary.child), []).append(node)
        elif region is None:
            groups.setdefault(("op",) + _describe(node), []).append(node)
        else:
            by_region.setdefault(region, []).append(node)
    for members in by_region.values():
        structure = tuple(_describe(n) for n in members)
        for position, node in enumerate(members):
            groups.setdefault(("region", structure, position), []).append(node)
    group_of = {id(n): members for members in groups.values() for n in members}
    for node in order:  # in program order, so a view of a view finds its input's group
        if node is not root and not node.is_leaf() and holds_base(node) and not always_kept(node):
            members = group_of.get(id(node.inputs[0]))
            if members is not None:
                members.append(node)
                group_of[id(node)] = members
    return sorted(groups.values(), key=lambda ns: place[id(ns[0])])


def parkable(group):
    """The members of a group that offloading it parks in host memory (the rest, its views, are recomputed), or
    None where one of them cannot be parked (a tuple value: `offload.offloadable`)."""
    owners = [n for n in group if not holds_base(n)]
    return owners if all(map(offloadable, owners)) else None


# ----- the walk that writes down the bytes at fixed points -------------------------------------------------------
class PointLedger(Ledger):
    """The Budget's ledger, writing down the device bytes at fixed points of its walk, and what the walk recomputed,
    fetched and parked (the seconds a plan adds are read from those).

    A point closes at every value computed (forward values and gradient values alike: the same ones, in the same
    order, whatever is dropped); it holds the most bytes seen since the point before, so a recomputation or a fetch
    counts in the point of the next computed value. `points[-1]` holds what follows the last computed value.
    """

    def __init__(self, root, out_grad, offloaded=frozenset()):
        super().__init__(root, out_grad, {i: OFFLOAD for i in offloaded})
        self.points, self.since_point = [], 0
        self.recomputed, self.fetched, self.parked_nodes = [], [], []

    def _local_peak(self, make, node):
        """Run `make(node)` (the ledger's compute or fetch) and return the most bytes it held; `peak` goes on."""
        peak, self.peak = self.peak, 0
        make(node)
        local, self.peak = self.peak, max(peak, self.peak)
        return local

    def compute(self, node):
        self.points.append(max(self.since_point, self._local_peak(super().compute, node)))
        self.since_point = 0

    def recompute(self, node, passing=False):
        self.since_point = max(self.since_point, self._local_peak(super().compute, node))
        self.recomputed.append(node)

    def bring_back(self, node):
        self.since_point = max(self.since_point, self._local_peak(super().bring_back, node))
        self.fetched.append(node)

    def release(self, node):
        out_before = self.host_bytes_out
        super().release(node)
        if self.host_bytes_out > out_before:
            self.parked_nodes.append(node)

    def finish(self):
        self.points.append(self.since_point)
        return self


def walk_points(root, dropped, offloaded=frozenset()):
    """The PointLedger after walking the step lazily, `dropped` (ids) off the device, those also in `offloaded`
    parked: checkpoint_budget.walk_step's walk (regions None), with its points written down."""
    out_grad = placeholder(infer_spec(root))
    ledger = PointLedger(root, out_grad, offloaded)
    realize([root], lambda n: id(n) not in dropped, ledger)
    run_backward(plan_backward(root, ledger.has, lambda n: id(n) in offloaded), out_grad, ledger)
    return ledger.finish()


def _seconds(ledger, cost_model, consumers):
    """Seconds a walk adds to the step: its recomputations, and its copies that no compute hides. On a device whose
    copies overlap compute a copy hides under its value's consumers' forward compute (a stand-in for the ops around
    it, which backward repeats); elsewhere (cpu_numpy()) nothing hides."""
    overlap = device_copies_overlap(cost_model.device)
    seconds = cost_model.recompute_seconds(ledger.recomputed)
    for nodes, direction in ((ledger.parked_nodes, "to_host"), (ledger.fetched, "to_device")):
        for node in nodes:
            copy = cost_model.copy_seconds(spec_nbytes(infer_spec(node)), direction)
            around = cost_model.recompute_seconds(consumers.get(id(node), ())) if overlap else 0.0
            seconds += copy - cost_model.hidden_seconds(copy, around)
    return seconds


def _consumers(root):
    consumers = {}
    for node in find_topo_sort([root]):
        for x in node.inputs:
            consumers.setdefault(id(x), []).append(node)
    return consumers


def added_seconds(root, dropped=(), offloaded=(), cost_model=None):
    """Seconds that dropping `dropped` and offloading `offloaded` (nodes) add to a step on the graph above `root`,
    by `cost_model` (default: this machine's): what `OptimalPlan.predicted_time` measures, for any plan."""
    cost_model = cost_model or costs.CostModel()
    off = {id(n) for n in offloaded}
    ledger = walk_points(root, {id(n) for n in dropped} | off, off)
    return _seconds(ledger, cost_model, _consumers(root))


# ----- the program ----------------------------------------------------------------------------------------------
def optimal(root, bytes, offload=False, host_bandwidth=None, cost_model=None, calibrate=False):
    """The plan that adds the least time to a step while its predicted peak stays at or under `bytes`.

    Trade-off: every value taken off the device lowers the peak at the points it would be alive, and costs its
    recomputation (dropped) or its copies to the host and back (offloaded, with `offload=True`). The Budget picks
    greedily; this solves the choice as an integer program over the Budget's groups (see the module doc), so its
    `predicted_time` is the yardstick for the Budget's. It is optimal for the linearized peak, and its peak is
    verified by the ledger (`walk_step`), not assumed. It computes nothing and changes no drop flag.

    Args:
        root: the loss of a traced graph (lazy and not computed yet, or computed; annotated or not).
        bytes: the bound on the step's predicted activation peak M_peak (device bytes), as Budget(bytes).
        offload: may a group of arrays be parked in host memory instead of recomputed?
        host_bandwidth: bytes/s to price copies with (16e9: as if over PCIe 4); default: the cost model's.
        cost_model: a CostModel (default: the core's fixed rates, as the Budget's; with `calibrate=True` this
            machine's calibration, measured once and cached, as `Budget(b, calibrate=True)`'s).
    Returns an `OptimalPlan`. Raises ValueError naming the least peak found (see the module doc) when it exceeds
    `bytes`, and ImportError when SciPy is missing (it is the `optimal` extra).

        plan = optimal(loss, 32 << 20, offload=True, cost_model=CostModel(calibration=Calibration.nominal()))
        plan.predicted_peak <= 32 << 20, plan.predicted_time, plan.offloaded
    """
    try:
        from scipy import optimize as scipy_optimize
    except ImportError as error:
        raise ImportError("checkpoint_budget.optimal solves a mixed-integer program with SciPy's milp (HiGHS), and "
                          "SciPy is not installed: pip install 'needle[optimal]' (or pip install scipy)") from error
    cost_model = _cost_model(cost_model, host_bandwidth, calibrate)
    # A stack's boundaries, each a choice of its own or one per layer's place: the linearized peak of many small
    # choices that interact (a dropped run of boundaries is held together in backward) can mislead the solver
    # where the coarser choice does not, so both are solved, each plan verified by the ledger; the faster wins.
    solutions = [_solve_grouping(scipy_optimize, root, bytes, offload, cost_model, split)
                 for split in (True, False)]
    feasible = [found for found in solutions if found[0] is not None]
    if not feasible:
        least = min(found[1] for found in solutions)
        raise ValueError(f"optimal: a peak of {bytes} bytes is infeasible: the least peak found for this graph"
                         f"{' (offloading)' if offload else ''} is {least} bytes ({least / 2**20:.1f} MB)")
    (dropped, parked, walk), _, groups, solve_seconds = min(
        feasible, key=lambda found: added_seconds(root, found[0][0], found[0][1], cost_model))
    added = added_seconds(root, dropped, parked, cost_model)
    return OptimalPlan(walk.peak, cost_model.step_seconds(root) + added, added, walk.host_peak, tuple(dropped),
                       tuple(parked), groups, solve_seconds)


def _solve_grouping(scipy_optimize, root, bytes, offload, cost_model, split_boundaries):
    """((dropped, offloaded, walk) or None where infeasible, the least peak found, the number of groups, the
    seconds solving took) for one grouping of the candidates."""
    groups = find_groups(root, split_boundaries)
    ways = [(g, False) for g in range(len(groups))]  # (group, how it leaves the device): False is recomputed
    if offload:
        ways += [(g, OFFLOAD) for g, members in enumerate(groups) if parkable(members) is not None]
    program = Program(scipy_optimize, root, groups, ways, cost_model)
    least = _least_peak(program)
    if least[2].peak > bytes:
        return None, least[2].peak, len(groups), program.solve_seconds
    return _solve(program, int(bytes)) or least, least[2].peak, len(groups), program.solve_seconds


def _cost_model(cost_model, host_bandwidth, calibrate=False):
    if cost_model is None:
        return (CostModel if calibrate else costs.CostModel)(host_bandwidth=host_bandwidth)
    if host_bandwidth is None:
        return cost_model
    return type(cost_model)(cost_model.device, host_bandwidth, cost_model.calibration)


class Program:
    """The linearized choice: a binary x per way (`ways`: (group, False or OFFLOAD)); at every point of the walk,
    base + correction + deltas . x <= bound (one constraint per distinct row of deltas, at its worst point);
    x_drop + x_offload <= 1 per group; the seconds of each way. `correction` is what the ledger taught it: at each
    point, the most bytes a verified solution held beyond the linear prediction (`learn`)."""

    def __init__(self, scipy_optimize, root, groups, ways, cost_model):
        self.optimize, self.root, self.groups, self.ways = scipy_optimize, root, groups, ways
        self.base, self.deltas, self.seconds = _linearize(root, groups, ways, cost_model)
        # Most points of a long walk repeat another's changes: one constraint per distinct row, at its worst point.
        self.rows, inverse = numpy.unique(self.deltas, axis=0, return_inverse=True)
        self.row_of = numpy.ravel(inverse)
        self.correction = numpy.zeros(len(self.base))
        pairs = [(ways.index((g, False)), i) for i, (g, way) in enumerate(ways) if way is OFFLOAD]
        self.one_way = numpy.zeros((len(pairs), len(ways)))
        for row, (drop, park) in enumerate(pairs):
            self.one_way[row, drop] = self.one_way[row, park] = 1.0
        self.solve_seconds = 0.0

    @property
    def worst(self):
        """Per distinct row, the most bytes any of its points holds besides the changes."""
        worst = numpy.full(len(self.rows), -math.inf)
        numpy.maximum.at(worst, self.row_of, self.base + self.correction)
        return worst

    def learn(self, picked, walk):
        """Where the walk of the ways `picked` (a PointLedger) held more bytes than base + deltas . x predicted,
        raise those points' correction to the excess: the interaction of the groups chosen together."""
        predicted = self.base + self.deltas[:, picked].sum(axis=1)
        self.correction = numpy.maximum(self.correction, numpy.asarray(walk.points) - predicted)

    def _milp(self, cost, rows, upper, integrality):
        constraints = [self.optimize.LinearConstraint(rows, -numpy.inf, upper)]
        if len(self.one_way):
            one_way = numpy.pad(self.one_way, ((0, 0), (0, rows.shape[1] - len(self.ways))))
            constraints.append(self.optimize.LinearConstraint(one_way, -numpy.inf, 1.0))
        start = time.perf_counter()
        result = self.optimize.milp(cost, integrality=integrality, constraints=constraints,
                                    bounds=self.optimize.Bounds(0, [1] * len(self.ways) + [numpy.inf] * (
                                        rows.shape[1] - len(self.ways))))
        self.solve_seconds += time.perf_counter() - start
        return None if result.x is None else numpy.flatnonzero(result.x[:len(self.ways)] > 0.5)

    def least_time(self, bound):
        """The ways (numbers) of least seconds whose linearized peak is at most `bound`, or None."""
        return self._milp(numpy.asarray(self.seconds) + TIE_BREAK, self.rows, bound - self.worst,
                          numpy.ones(len(self.ways)))

    def least_peak(self):
        """The ways of least linearized peak (t: a continuous variable over every row), then of least seconds."""
        rows = numpy.hstack([self.rows, -numpy.ones((len(self.rows), 1))])  # changes . x - t <= -base
        cost = numpy.append(self.seconds, 1.0)  # a byte outweighs every second: seconds only break ties
        return self._milp(cost, rows, -self.worst, numpy.append(numpy.ones(len(self.ways)), 0))

    def nodes(self, picked):
        """(dropped nodes, offloaded nodes) of the ways numbered `picked`."""
        parked_groups = {self.ways[i][0] for i in picked if self.ways[i][1] is OFFLOAD}
        off_groups = {self.ways[i][0] for i in picked}
        parked = [n for g in sorted(parked_groups) for n in parkable(self.groups[g])]
        parked_ids = {id(n) for n in parked}
        return [n for g in sorted(off_groups) for n in self.groups[g] if id(n) not in parked_ids], parked

    def plan(self, picked):
        """(dropped nodes, offloaded nodes, the ledger's walk of them) for the ways numbered `picked`."""
        return self.nodes_plan(*self.nodes(picked))

    def nodes_plan(self, dropped, parked):
        parked_ids = {id(n) for n in parked}
        return dropped, parked, walk_step(self.root, {id(n) for n in dropped} | parked_ids, None,
                                          {i: OFFLOAD for i in parked_ids})


def _least_peak(program):
    """(dropped, offloaded, walk) of the least peak the ledger verifies among: every group off the device
    (offloaded where it may be), the same but the annotated regions' outputs kept (the checkpoints that spare a
    recomputation the walk back to the inputs), that with Chen's spine of each stack's boundaries kept too (the
    Budget's least: checkpoint_budget.boundary_keep_order), and the program's plan of least linearized peak."""
    plans = [program.plan(range(len(program.ways)))]
    every_dropped, every_parked, _ = plans[0]
    outputs = {id(n) for ns in program.groups for n in ns if keep_reason(n) == "boundary" and not n.boundary}
    for kept in (outputs, outputs | _spine(program.groups)) if outputs else ():
        plans.append(program.nodes_plan([n for n in every_dropped if id(n) not in kept],
                                        [n for n in every_parked if id(n) not in kept]))
    picked = program.least_peak()
    if picked is not None:
        plans.append(program.plan(picked))
    return min(plans, key=lambda plan: plan[2].peak)


def _spine(groups):
    """The ids of the stacks' boundaries that the Budget never drops (checkpoint_budget.boundary_keep_order)."""
    children = {}
    for ns in groups:
        if ns[0].boundary:
            children.setdefault(ns[0].boundary.stack, {})[ns[0].boundary.child] = ns
    spine = set()
    for by_child in children.values():
        order, kept = boundary_keep_order(len(by_child))
        spine |= {id(n) for child in order[:kept] if child in by_child for n in by_child[child]}
    return spine


def _solve(program, bytes):
    """(dropped, offloaded, walk) of least seconds whose walk the ledger puts at or under `bytes`, or None: solve,
    walk the solution, and where it held more than predicted, correct those points and solve again (ROUNDS)."""
    for _ in range(ROUNDS):
        picked = program.least_time(bytes)
        if picked is None:  # infeasible: the corrected linear peak is too pessimistic here
            return None
        dropped, parked = program.nodes(picked)
        parked_ids = {id(n) for n in parked}
        walk = walk_points(program.root, {id(n) for n in dropped} | parked_ids, parked_ids)
        if walk.peak <= bytes:
            return program.nodes_plan(dropped, parked)
        program.learn(picked, walk)
    return None


def _linearize(root, groups, ways, cost_model):
    """(the base's bytes at each point, each way's change of them: one column per way, each way's seconds)."""
    base = numpy.asarray(walk_points(root, set()).points, dtype=numpy.float64)
    consumers = _consumers(root)
    columns, seconds = [], []
    for g, way in ways:
        ids = {id(n) for n in groups[g]}
        walk = walk_points(root, ids, {id(n) for n in parkable(groups[g])} if way is OFFLOAD else frozenset())
        if len(walk.points) != len(base):
            raise RuntimeError(f"optimal: the walk with group {g} off the device has {len(walk.points)} points, the "
                               f"base {len(base)}: the gradient graph should not depend on what is dropped")
        columns.append(numpy.asarray(walk.points, dtype=numpy.float64) - base)
        seconds.append(_seconds(walk, cost_model, consumers))
    return base, numpy.column_stack(columns) if columns else numpy.zeros((len(base), 0)), seconds
