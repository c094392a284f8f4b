"""checkpoint_budget.optimal (issue #29's "how good is the plan?"): the least added step time under a peak, solved as a
mixed-integer program over the Budget's groups and verified by the Budget's ledger.

Every plan here is priced by the nominal calibration (not this machine's), so the numbers are the same everywhere.
"""
import re
import sys

import numpy as np
import pytest

import needle as ndl
from needle import checkpoint, checkpoint_budget, nn
from needle.toolbox import offload
from needle.autograd import find_topo_sort, infer_spec, spec_nbytes
from needle.checkpoint_budget import walk_step
from needle.ledger import view_copies
from needle.toolbox.checkpoint_optimal import added_seconds, find_groups, walk_points
from needle.toolbox.cost_model import Calibration, CostModel
from models import LanguageModel


def hosted(ids):
    """{id: the host store} for walk_step's stores: these values go to host memory instead of being recomputed."""
    return {i: offload.OFFLOAD for i in ids}

DEVICE = ndl.cpu()
pytestmark = pytest.mark.skipif(not DEVICE.enabled(), reason="the compiled CPU backend is not built")
NOMINAL = CostModel(DEVICE, calibration=Calibration.nominal())


def lm_loss(policy="all", layers=2, lazy=True):
    """The loss of a small Transformer LM's step (embedding 16, 2 heads of 8), not computed when `lazy`."""
    np.random.seed(0)
    model = LanguageModel(16, 40, 32, num_layers=layers, seq_model="transformer", seq_len=8, device=DEVICE,
                          num_head=2, dim_head=8)
    if policy != "off":
        model.enable_gc(policy=policy)
    rs = np.random.RandomState(0)
    X = ndl.Tensor(rs.randint(0, 40, (8, 4)).astype(np.float32), device=DEVICE, requires_grad=False)
    y = ndl.Tensor(rs.randint(0, 40, (32,)).astype(np.float32), device=DEVICE, requires_grad=False)
    with ndl.autograd.lazy_mode(lazy):
        return nn.SoftmaxLoss()(model(X)[0], y)


def ids(nodes):
    return {id(n) for n in nodes}


def peaks(loss, offload=False):
    """(the least peak `optimal` finds, which its ValueError names; the peak with nothing dropped)."""
    with pytest.raises(ValueError, match="infeasible: the least peak found") as error:
        checkpoint_budget.optimal(loss, 1, offload=offload, cost_model=NOMINAL)
    least = int(re.search(r"is (\d+) bytes", str(error.value)).group(1))
    return least, walk_step(loss, set()).peak


def greedy_prefixes(loss):
    """(peak, added seconds) of every prefix of the Budget-like ranking: recompute seconds per byte saved, cheapest
    first."""
    groups = find_groups(loss)
    per_byte = [added_seconds(loss, ns, cost_model=NOMINAL) / sum(spec_nbytes(infer_spec(n)) for n in ns)
                for ns in groups]
    ranked = [groups[i] for i in np.argsort(per_byte, kind="stable")]
    prefixes = [[n for ns in ranked[:t] for n in ns] for t in range(len(ranked) + 1)]
    return [(walk_step(loss, ids(p)).peak, added_seconds(loss, p, cost_model=NOMINAL)) for p in prefixes]


def test_the_optimum_fits_and_is_no_slower_than_any_greedy_prefix():
    loss = lm_loss(layers=4)
    least, top = peaks(loss)
    prefixes = greedy_prefixes(loss)
    for fraction in (0.15, 0.5, 0.85):
        bytes = int(least + fraction * (top - least))
        plan = checkpoint_budget.optimal(loss, bytes, cost_model=NOMINAL)
        assert plan.predicted_peak <= bytes
        assert plan.predicted_peak == walk_step(loss, ids(plan.dropped)).peak  # the ledger's, for the chosen plan
        assert plan.offloaded == () and plan.predicted_host_peak == 0
        assert plan.added_time == pytest.approx(added_seconds(loss, plan.dropped, cost_model=NOMINAL))
        greedy = [seconds for peak, seconds in prefixes if peak <= bytes]
        assert greedy and plan.added_time <= min(greedy) * (1 + 1e-9), (fraction, plan.added_time, greedy)
        assert 0 < plan.groups <= 30 and plan.solve_seconds > 0
    assert checkpoint_budget.optimal(loss, top, cost_model=NOMINAL).added_time == 0  # all fits: nothing moves
    assert loss.cached_data is None  # nothing computed


def test_offloading_is_never_worse_and_is_priced_with_the_given_bandwidth():
    loss = lm_loss(layers=4)
    least, top = peaks(loss)
    for fraction in (0.1, 0.5):
        bytes = int(least + fraction * (top - least))
        recompute = checkpoint_budget.optimal(loss, bytes, cost_model=NOMINAL)
        both = checkpoint_budget.optimal(loss, bytes, offload=True, cost_model=NOMINAL)
        assert both.predicted_peak <= bytes and both.added_time <= recompute.added_time
        assert both.offloaded and not ids(both.offloaded) & ids(both.dropped)
        assert both.predicted_host_peak > 0
        off_device = ids(both.dropped + both.offloaded)
        assert both.predicted_peak == walk_step(loss, off_device, None, hosted(ids(both.offloaded))).peak
    # copies at a kilobyte a second cost more than any recomputation: nothing is offloaded
    slow = checkpoint_budget.optimal(loss, bytes, offload=True, host_bandwidth=1e3, cost_model=NOMINAL)
    assert slow.offloaded == () and slow.added_time == pytest.approx(recompute.added_time)


def test_offloading_reaches_below_recompute_only_least_peak():
    loss = lm_loss()
    least, _ = peaks(loss)
    least_offloading, _ = peaks(loss, offload=True)
    assert least_offloading < least
    plan = checkpoint_budget.optimal(loss, least_offloading, offload=True, cost_model=NOMINAL)
    assert plan.predicted_peak <= least_offloading


def test_an_infeasible_peak_raises_naming_the_least_one():
    loss = lm_loss()
    least, _ = peaks(loss)
    with pytest.raises(ValueError, match=f"least peak found for this graph is {least} bytes"):
        checkpoint_budget.optimal(loss, least - 1, cost_model=NOMINAL)
    assert checkpoint_budget.optimal(loss, least, cost_model=NOMINAL).predicted_peak <= least  # the least is feasible
    probe = checkpoint.Budget(1)  # the recompute-only Budget's least peak on the same step: optimal reaches it too
    with pytest.raises(ValueError):
        probe.plan(lm_loss(probe))
    assert least <= probe.minimum_peak


def test_a_view_goes_with_the_value_whose_buffer_it_holds():
    loss = lm_loss()
    groups = find_groups(loss)
    group_of = {id(n): i for i, ns in enumerate(groups) for n in ns}
    views = [n for n in find_topo_sort([loss]) if id(n) in group_of and n.op.view and not view_copies(n)]
    assert views and all(group_of[id(v)] == group_of[id(v.inputs[0])] for v in views)
    # a group starts with a candidate, never a view of one; a view op that copies (a reshape of a transposed value)
    # holds a buffer of its own: a candidate, as the Budget ranks it
    assert all(not n.op.view or view_copies(n) for ns in groups for n in ns[:1])
    assert any(n.op.view and view_copies(n) for ns in groups for n in ns[:1])


def test_it_works_without_annotations_and_ignores_a_budgets_drop_flags():
    off = lm_loss("off")
    assert not any(checkpoint.region_of(n) for n in find_topo_sort([off]))
    least, top = peaks(off)
    bytes = (least + top) // 2
    plan = checkpoint_budget.optimal(off, bytes, cost_model=NOMINAL)
    assert plan.groups > 1 and plan.dropped and plan.predicted_peak <= bytes

    # The same graph under policy "all" and under a Budget that planned it: the same regions, other drop flags.
    budget = checkpoint.Budget(bytes)
    planned = lm_loss(budget)
    budget.plan(planned)
    flags = [n.drop for n in find_topo_sort([planned])]
    assert any(flags) and flags != [n.drop for n in find_topo_sort([lm_loss("all")])]
    a, b = (checkpoint_budget.optimal(loss, bytes, cost_model=NOMINAL) for loss in (lm_loss("all"), planned))
    assert (a.predicted_peak, a.added_time, len(a.dropped), a.groups) == (
        b.predicted_peak, b.added_time, len(b.dropped), b.groups)
    assert [n.drop for n in find_topo_sort([planned])] == flags  # optimal changes no flag


def test_a_computed_graph_gets_the_lazy_graphs_plan():
    lazy, eager = lm_loss(lazy=True), lm_loss(lazy=False)
    assert eager.cached_data is not None
    least, top = peaks(lazy)
    a, b = (checkpoint_budget.optimal(loss, (least + top) // 2, cost_model=NOMINAL) for loss in (lazy, eager))
    assert (a.predicted_peak, a.added_time, len(a.dropped)) == (b.predicted_peak, b.added_time, len(b.dropped))


def test_the_points_of_a_walk_hold_its_peak():
    """The linearization's base: the most bytes at any point of a walk is the ledger's peak for it."""
    loss = lm_loss()
    groups = find_groups(loss)
    for dropped in ([], groups[len(groups) // 2], [n for ns in groups for n in ns]):
        walk = walk_points(loss, ids(dropped))
        assert max(walk.points) == walk.peak == walk_step(loss, ids(dropped)).peak
        assert len(walk.points) == len(walk_points(loss, set()).points)  # the points align, whatever is dropped


def test_without_scipy_it_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy", None)  # `import scipy` now raises ImportError
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)
    with pytest.raises(ImportError, match=r"needs? .*SciPy|SciPy is not installed.*pip install"):
        checkpoint_budget.optimal(lm_loss(layers=1), 1 << 30, cost_model=NOMINAL)


def test_the_budget_and_the_optimum_report_a_steps_time_alike():
    """predicted_time is a step's compute (CostModel.step_seconds) plus what the plan adds, for both planners (the
    toolbox's Budget, calibrate=True, also has the trace it timed; the core's times nothing), so the Budget's can be
    set beside the optimum's (benchmarks/bench_budget.py)."""
    off = checkpoint_budget.walk_step(lm_loss("off", layers=4), set()).peak
    for calibrate in (False, True):
        budget = checkpoint.Budget(int(0.6 * off), cost_model=NOMINAL, calibrate=calibrate)
        loss = lm_loss(budget, layers=4)
        budget.plan(loss)
        plan = checkpoint_budget.optimal(loss, int(0.6 * off), cost_model=NOMINAL)
        base = NOMINAL.step_seconds(loss)
        # the lazy trace, timed as it was built (not an op, so not the optimum's); the core's Budget has no stopwatch
        assert (budget.trace_seconds > 0) if calibrate else budget.trace_seconds == 0.0
        assert budget.predicted_time == pytest.approx(base + budget.trace_seconds + budget.predicted_added_time)
        assert plan.predicted_time == pytest.approx(base + plan.added_time)
        assert plan.added_time <= budget.predicted_added_time * (1 + 1e-9)


def test_a_walk_that_parks_gradients_knows_the_peak_were_they_kept():
    """The ledger's walk with a gradient store also counts the peak the same walk reaches with the gradients kept on
    the device (`peak_keeping_gradients`: the Budget decides from it whether to park, without a walk of its own): it
    equals the walk that keeps them, for plans with nothing, half and everything off the device, recomputed or
    parked."""
    loss = lm_loss("all")
    groups = find_groups(loss)
    strictly_lower = 0
    for t in (0, len(groups) // 2, len(groups)):
        dropped = ids(n for ns in groups[:t] for n in ns)
        for offloaded in (set(), {i for ns in groups[:t] for n in ns if offload.offloadable(n) for i in ids([n])}):
            parked = walk_step(loss, dropped, None, hosted(offloaded), offload.GRADIENTS)
            kept = walk_step(loss, dropped, None, hosted(offloaded))
            assert parked.peak_keeping_gradients == kept.peak
            assert parked.peak <= kept.peak
            strictly_lower += parked.peak < kept.peak
    assert strictly_lower > 0  # parking gradients lowers some of these peaks: the two numbers are not one
