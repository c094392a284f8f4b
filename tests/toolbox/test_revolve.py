"""Revolve (needle/toolbox/revolve.py): binomial checkpointing for a stack, issue 46.

The rules checked: the closed form t(l, s) equals the recurrence's optimum; backward rebuilds exactly t(l, s) - (l - 1)
boundaries of a chain; no more than `snapshots` boundaries are held at once, whatever the depth; gradients equal gc
off's, to the bit.
"""
import numpy as np
import pytest

from needle import checkpoint
from needle.toolbox.revolve import Revolve, runs, schedule, steps
from stack_cases import gradients, most_boundaries_alive


@pytest.mark.parametrize("snapshots", [1, 2, 3, 4, 6])
def test_the_binomial_formula_is_the_recurrences_optimum(snapshots):
    assert [runs(length, snapshots) for length in range(1, 80)] == [steps(length, snapshots)
                                                                    for length in range(1, 80)]


def test_the_formula_on_griewanks_examples():
    """beta(s, r) = C(s + r, s) layers reverse with r runs each: then t = r * l - C(s + r, r - 1)."""
    assert runs(64, 4) == 200 and runs(70, 4) == 4 * 70 - 56  # C(8, 4) = 70: the longest chain of 4 runs
    assert runs(10, 1) == 45  # one snapshot: every boundary from x_0 again, l (l - 1) / 2
    assert runs(10, 9) == 9  # a snapshot per boundary: the forward pass alone


@pytest.mark.parametrize("length,snapshots", [(10, 2), (16, 3), (33, 4), (7, 1)])
def test_the_schedule_keeps_at_most_snapshots_in_forward_and_names_each_boundary_once(length, snapshots):
    held_for = schedule(length, snapshots)
    assert sorted(held_for) == list(range(1, length))
    kept = [p for p, rule in held_for.items() if rule is None]
    assert length - 1 in kept and len(kept) <= snapshots
    assert all(rule is None or p <= rule for p, rule in held_for.items())  # held on the way up to its child


def test_revolve_needs_a_snapshot():
    for bad in (0, -2, 2.5, True, "3"):
        with pytest.raises(ValueError, match="snapshots must be an int >= 1"):
            Revolve(bad)
    with pytest.raises(ValueError, match="at least 1 snapshot"):
        schedule(5, 0)


@pytest.mark.parametrize("length,snapshots", [(10, 2), (16, 3), (24, 4), (6, 1)])
def test_backward_rebuilds_the_formulas_count_and_gives_gc_offs_gradients(length, snapshots):
    off, _ = gradients(length, None)
    on, stats = gradients(length, checkpoint.Revolve(snapshots))
    assert stats["recomputed_boundaries"] == runs(length, snapshots) - (length - 1)
    assert all(np.array_equal(a, b) for a, b in zip(off, on))


@pytest.mark.parametrize("length", [8, 32])
def test_no_more_than_snapshots_boundaries_are_alive_whatever_the_depth(length):
    """M_act O(s): at most s of the stack's boundaries exist at once, kept from forward or rebuilt, plus the one a
    rebuild is making before the one it passed through is let go (a residual block reads its input last)."""
    snapshots = 3
    after_forward, most, boundaries, stats = most_boundaries_alive(length, checkpoint.Revolve(snapshots))
    assert boundaries == length - 1 and after_forward <= snapshots and most <= snapshots + 1
    assert stats["recomputed_boundaries"] == runs(length, snapshots) - (length - 1)
