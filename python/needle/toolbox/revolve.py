"""Revolve: Griewank and Walther's binomial checkpointing, the fewest recomputations for a chain and a memory.

A stack of l layers x_0 -> x_1 -> ... -> x_l (x_0 its input, x_l its output, both kept) is reversed with at most
`snapshots` of its boundaries x_1 .. x_{l-1} held at once. Chen's sqrt schedule holds ~2 sqrt(l) and rebuilds each
boundary once; Revolve holds s, whatever the depth, and rebuilds some boundaries several times, as few as possible.

The number: count the runs of the layers that make a boundary (layers 1 .. l-1), the forward pass's included. Let
beta(s, r) be the longest chain reversible with s snapshots if none of them runs more than r times. The first
snapshot, placed at x_m, splits the chain: the part above it is reversed first, with s - 1 snapshots and r runs;
then the part below it, again from x_0, whose layers have run once already: s snapshots, r - 1 runs. So
beta(s, r) = beta(s - 1, r) + beta(s, r - 1) with beta(s, 0) = beta(0, r) = 1: Pascal's rule, beta(s, r) =
C(s + r, s). For a chain of l layers, r is the least with l <= C(s + r, s), and the runs of the whole reversal are
(Griewank 1992; Griewank and Walther 2000)

    t(l, s) = r * l - C(s + r, r - 1),    e.g. t(64, 4) = 4 * 64 - C(8, 3) = 200   (C(8, 4) = 70 >= 64).

The forward pass made the l - 1 boundaries once, so backward rebuilds t(l, s) - (l - 1) of them (137 for 64
layers and 4 snapshots; `last_backward_stats()["recomputed_boundaries"]`), and recomputes each layer's interior
once more as it differentiates it, as with any policy. `schedule` finds the splits; `steps(l, s)` is the dynamic
program the recurrence gives, checked against the formula by tests/toolbox/test_revolve.py.

    model.enable_gc(policy=checkpoint.Revolve(4))   # every stack holds at most 4 boundaries, whatever its depth

needle's backward plan carries the schedule out: a boundary kept from the forward pass is a snapshot; one rebuilt
later is held (a snapshot) only when backward rebuilds the child its schedule names, and otherwise passes
(regions.HeldFor, backward.plan_backward). Inside a layer (no stack), Revolve drops every value, like "all".
"""
import functools
import math
from dataclasses import dataclass

from .. import regions

__all__ = ["Revolve", "runs", "schedule", "steps"]


def runs(length, snapshots):
    """t(l, s): the runs of boundary-making layers, forward pass included, of reversing a chain of `length` layers
    holding at most `snapshots` of its boundaries (Griewank's closed form; the module docstring derives it)."""
    if length <= 1:
        return 0
    if snapshots < 1:
        return math.inf
    r = 0
    while math.comb(snapshots + r, snapshots) < length:
        r += 1
    return r * length - math.comb(snapshots + r, r - 1)


@functools.lru_cache(maxsize=256)
def steps(length, snapshots):
    """t(l, s) again, from the recurrence: reversing [a, a + l) with s snapshots costs, for the best first split j,
    j runs to reach x_{a+j}, then [a+j, a+l) with s - 1 and [a, a+j) with s (bottom-up, not recursive)."""
    table = [[0] * (snapshots + 1)] + [[0] * (snapshots + 1)]  # table[l][s]; a chain of 0 or 1 layer: nothing
    for n in range(2, length + 1):
        table.append([math.inf] + [min(j + table[n - j][s - 1] + table[j][s] for j in range(1, n))
                                   for s in range(1, snapshots + 1)])
    return table[length][snapshots]


def _best_split(length, snapshots):
    """The first split j of a chain of `length` layers that reaches t(l, s) (the lowest such j)."""
    return min(range(1, length), key=lambda j: (j + runs(length - j, snapshots - 1) + runs(j, snapshots), j))


@functools.lru_cache(maxsize=64)
def schedule(length, snapshots):
    """{boundary p (1 .. length-1): None where the forward pass keeps it, else the boundary q whose rebuilding
    holds it}. Each call reverse(a, b, s) splits at m: reverse(m, b, s - 1) first, then reverse(a, m, s); x_m is
    held when backward rebuilds x_{b-1} (the boundary the reversal of layer b needs). The forward pass is the
    first descent: its splits, x_{length-1} last, are kept."""
    if snapshots < 1 and length > 1:
        raise ValueError(f"Revolve: a chain of {length} layers needs at least 1 snapshot, got {snapshots}")
    held_for, work = {}, [(0, length, snapshots, True)]
    while work:
        a, b, s, in_forward = work.pop()
        if b - a < 2:
            continue
        m = a + _best_split(b - a, s)
        held_for[m] = None if in_forward else b - 1
        work.append((a, m, s, False))
        work.append((m, b, s - 1, in_forward))  # popped first: backward reverses the upper part first
    return held_for


@dataclass(frozen=True)
class Revolve:
    """Binomial checkpointing for a stack: at most `snapshots` of its boundaries held at once (module docstring)."""

    snapshots: int

    def __post_init__(self):
        if isinstance(self.snapshots, bool) or not isinstance(self.snapshots, int) or self.snapshots < 1:
            raise ValueError(f"Revolve(snapshots): snapshots must be an int >= 1, got {self.snapshots!r}")

    def __call__(self, nodes, outputs=()):
        children = regions.stack_children(nodes)
        decisions = [False] * len(nodes)  # a layer's interior, and what its children kept inside: dropped
        held_for = schedule(len(children) + 1, self.snapshots)  # children 0 .. l-2 made boundaries 1 .. l-1
        for child, positions in enumerate(children):
            rule = held_for[child + 1]
            for i in positions:
                decisions[i] = True if rule is None else regions.HeldFor(rule - 1)
        return decisions
