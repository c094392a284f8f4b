"""Revolve (needle/toolbox/revolve.py): binomial checkpointing for a stack, issue 46.

The rules checked: the closed form t(l, s) equals the recurrence's optimum; backward rebuilds exactly t(l, s) - (l - 1)
boundaries of a chain; no more than `snapshots` boundaries are held at once, whatever the depth; gradients equal gc
off's, to the bit.
"""
import numpy as np
import pytest

import needle as ndl
from needle import backward, checkpoint, nn
from needle.toolbox.revolve import Revolve, runs, schedule, steps


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
    with pytest.raises(ValueError, match="snapshots must be an int >= 1"):
        Revolve(0)
    with pytest.raises(ValueError, match="at least 1 snapshot"):
        schedule(5, 0)


class Block(nn.Module):
    """y = x + relu(x @ w) @ v: a layer with an interior of its own (a region)."""

    def __init__(self, width, rng):
        super().__init__()
        self.w = nn.Parameter(rng.standard_normal((width, 2 * width)).astype("float32") / width)
        self.v = nn.Parameter(rng.standard_normal((2 * width, width)).astype("float32") / width)

    def forward(self, x):
        return self.checkpoint(x + ndl.ops.relu(x @ self.w) @ self.v, [x])


def _chain(length, seed=0, width=8):
    rng = np.random.default_rng(seed)
    model = nn.Sequential(*[Block(width, rng) for _ in range(length)])
    x = ndl.Tensor(rng.standard_normal((4, width)).astype("float32"))
    return model, x


def _grads(length, policy):
    model, x = _chain(length)
    if policy is not None:
        model.enable_gc(policy=policy)
    model(x).sum().backward()
    return [p.grad.numpy() for p in model.parameters()], backward.last_backward_stats()


@pytest.mark.parametrize("length,snapshots", [(10, 2), (16, 3), (24, 4), (6, 1)])
def test_backward_rebuilds_the_formulas_count_and_gives_gc_offs_gradients(length, snapshots):
    off, _ = _grads(length, None)
    on, stats = _grads(length, checkpoint.Revolve(snapshots))
    assert stats["recomputed_boundaries"] == runs(length, snapshots) - (length - 1)
    assert all(np.array_equal(a, b) for a, b in zip(off, on))


class CountHeld(backward.Compute):
    """The real machine, counting the stack's boundaries alive at once during backward."""

    def __init__(self, boundaries, alive):
        super().__init__()
        self.boundaries, self.alive, self.most = boundaries, set(alive), len(alive)

    def recompute(self, node, passing=False):
        super().recompute(node, passing=passing)
        if id(node) in self.boundaries:
            self.alive.add(id(node))
            self.most = max(self.most, len(self.alive))

    def release(self, node):
        self.alive.discard(id(node))
        super().release(node)


@pytest.mark.parametrize("length", [8, 32])
def test_no_more_than_snapshots_boundaries_are_alive_whatever_the_depth(length):
    """M_act O(s): at most s of the stack's boundaries exist at once, kept from forward or rebuilt, plus the one a
    rebuild is making before the one it passed through is let go."""
    snapshots = 3
    model, x = _chain(length)
    model.enable_gc(policy=checkpoint.Revolve(snapshots))
    loss = model(x).sum()
    nodes = backward.find_topo_sort([loss])
    boundaries = {id(n) for n in nodes if n.boundary}
    assert len(boundaries) == length - 1
    machine = CountHeld(boundaries, [id(n) for n in nodes if n.boundary and n.cached_data is not None])
    assert machine.most <= snapshots  # after forward
    out_grad = ndl.Tensor(np.ones((), "float32"), requires_grad=False)
    backward.run_backward(backward.plan_backward(loss), out_grad, machine)
    assert machine.most <= snapshots + 1 and machine.stats["recomputed_boundaries"] == runs(length, snapshots) - (
        length - 1)
