"""Checkpointing across the whole depth (issue 46): a stack's boundaries are its policy's candidates.

Rules checked here, on a chain of residual blocks in an nn.Sequential (stack_cases.py):
  "sqrt" keeps every k-th of a stack's n boundaries (k = ceil(sqrt(n + 1))), and backward holds at most k more while
  it rebuilds a segment, each boundary rebuilt once: O(sqrt L) boundaries alive, not L;
  "all" keeps none of them; every policy gives gc off's gradients, to the bit;
  recomputation stays under two forward passes' nodes (one to rebuild the boundaries, one for the interiors);
  the Budget sees the boundaries: its least feasible peak grows sublinearly with depth, and its bound holds.
"""
import math

import numpy as np
import pytest

import needle as ndl
from needle import autograd, backward, checkpoint, nn
from needle.checkpoint_budget import Budget, InfeasibleBudget
from stack_cases import chain, gradients, most_boundaries_alive


@pytest.mark.parametrize("length", [4, 16, 64])
def test_sqrt_keeps_every_kth_boundary_and_holds_one_segment_more_in_backward(length):
    after_forward, most, boundaries, stats = most_boundaries_alive(length, "sqrt")
    k = math.ceil(math.sqrt(boundaries + 1))
    assert after_forward == boundaries // k  # O(sqrt L) after forward, not L
    assert most <= after_forward + k  # and one segment more while backward rebuilds it
    assert stats["max_recomputes_per_node"] == 1  # each boundary and interior value held at most once


def test_all_keeps_none_of_a_stacks_boundaries():
    after_forward, _, boundaries, _ = most_boundaries_alive(16, "all")
    assert boundaries == 15 and after_forward == 0


def test_layers_keeps_every_boundary_and_drops_every_interior():
    """Policy "layers": Hugging Face's per-layer checkpointing (what "all" did before stacks were regions): no
    boundary rebuilt, each layer's interior recomputed once."""
    after_forward, most, boundaries, stats = most_boundaries_alive(16, "layers")
    assert after_forward == most == boundaries == 15
    assert stats["recomputed_boundaries"] == stats["passing_nodes"] == 0 and stats["recomputed_nodes"] > 0


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("policy", ["all", "sqrt", "selective", "layers"])
def test_a_stack_under_every_policy_gives_gc_offs_gradients(policy, lazy):
    off, _ = gradients(12, None, lazy)
    on, stats = gradients(12, policy, lazy)
    assert all(np.array_equal(a, b) for a, b in zip(off, on))
    assert stats["recomputed_nodes"] > 0


def test_sqrt_recomputes_less_than_two_forward_passes():
    """Goal of issue 46: recomputed nodes <= 2x the forward's node count (the boundaries' layers once, on the way,
    then every interior once as its layer is differentiated)."""
    model, x = chain(64)
    model.enable_gc(policy="sqrt")
    loss = model(x).sum()
    forward_nodes = sum(1 for n in autograd.find_topo_sort([loss]) if not n.is_leaf())
    loss.backward()
    assert 0 < backward.last_backward_stats()["recomputed_nodes"] <= 2 * forward_nodes


def _least_peak(length, rows):
    model, x = chain(length, rows=rows)
    budget = Budget(1)
    model.enable_gc(policy=budget)
    with autograd.lazy_mode(True):
        loss = model(x).sum()
        with pytest.raises(InfeasibleBudget):
            loss.backward()
    return budget.minimum_peak


def test_the_budgets_least_peak_grows_sublinearly_with_depth():
    """Its candidates include the layers' outputs (Chen's spine kept): beyond the gradients, which grow as L, the
    least peak grows as about sqrt L. Activations dominate here (256 rows of 8; a layer's weights 1 KB)."""
    least = {length: _least_peak(length, rows=256) for length in (4, 16, 64)}
    weights = {length: length * 2 * 8 * 16 * 4 for length in least}  # their gradients, alive at the end
    beyond = {length: least[length] - weights[length] for length in least}
    p = math.log((beyond[64] - beyond[16]) / (beyond[16] - beyond[4])) / math.log(4)
    assert p <= 0.6, (least, p)


def test_a_budget_below_one_boundary_per_layer_holds_and_gives_gc_offs_gradients():
    length, rows = 32, 256
    least = _least_peak(length, rows)
    budget = Budget(least)
    on, stats = gradients(length, budget, lazy=True, rows=rows)
    off, _ = gradients(length, None, lazy=True, rows=rows)
    assert budget.predicted_peak <= least and stats["recomputed_boundaries"] > 0
    assert all(np.array_equal(a, b) for a, b in zip(off, on))


def _lstm_held_after_forward(steps, policy):
    """Bytes the graph of an LSTM's loss holds after forward (its stacked output not kept by the caller, the loss
    read from the final state), besides the parameters and the input; and the parameters' gradients."""
    np.random.seed(0)
    lstm = nn.LSTM(4, 8)
    if policy is not None:
        lstm.enable_gc(policy=policy)
    x = ndl.Tensor(np.random.RandomState(1).randn(steps, 2, 4).astype("float32"))
    _, (h, _) = lstm(x)
    loss = (h * h).sum()
    held = sum(b for _, _, b in checkpoint.saved_residuals(loss, exclude=lstm.parameters() + [x]))
    loss.backward()
    return held, [p.grad.numpy() for p in lstm.parameters()]


def test_backpropagation_through_time_holds_about_sqrt_t_states_with_sqrt():
    """Issue 46's goal for time steps: what an LSTM holds after forward grows as T^p, p <= 0.6 (fitted to the
    increments; 8 -> 32 -> 128 steps here, 16 -> 256 in docs/checkpointing.md), gc off's as T; gradients equal gc
    off's. (Not longer: the gradient of taking one of T slices builds T nodes, so a test of T steps costs T^2.)"""
    held = {}
    for steps in (8, 32, 128):
        off_bytes, off = _lstm_held_after_forward(steps, None)
        held[steps], on = _lstm_held_after_forward(steps, "sqrt")
        assert all(np.array_equal(a, b) for a, b in zip(off, on))
        assert held[steps] < off_bytes
    p = math.log((held[128] - held[32]) / (held[32] - held[8])) / math.log(4)
    assert p <= 0.6, (held, p)
