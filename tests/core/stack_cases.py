"""A stack of layers for the depth tests (issue 46): a chain of residual blocks, each a region of its own, in an
nn.Sequential (a stack), and a machine that counts the stack's boundaries alive during backward.

Imported by tests/core/test_depth.py and tests/toolbox/test_revolve.py.
"""
import numpy as np

import needle as ndl
from needle import backward, nn


class Block(nn.Module):
    """y = x + relu(x @ w) @ v: a layer with an interior of its own (a region)."""

    def __init__(self, width, rng):
        super().__init__()
        self.w = nn.Parameter(rng.standard_normal((width, 2 * width)).astype("float32") / width)
        self.v = nn.Parameter(rng.standard_normal((2 * width, width)).astype("float32") / width)

    def forward(self, x):
        return self.checkpoint(x + ndl.ops.relu(x @ self.w) @ self.v, [x])


def chain(length, seed=0, width=8, rows=4):
    """(an nn.Sequential of `length` Blocks, an input batch of `rows`)."""
    rng = np.random.default_rng(seed)
    model = nn.Sequential(*[Block(width, rng) for _ in range(length)])
    return model, ndl.Tensor(rng.standard_normal((rows, width)).astype("float32"))


def gradients(length, policy, lazy=False, rows=4):
    """(the parameters' gradients of one backward of the chain under `policy` (None: gc off), its stats)."""
    model, x = chain(length, rows=rows)
    if policy is not None:
        model.enable_gc(policy=policy)
    with ndl.autograd.lazy_mode(lazy):
        model(x).sum().backward()
    return [p.grad.numpy() for p in model.parameters()], backward.last_backward_stats()


class CountHeld(backward.Compute):
    """The real machine, counting the stack's boundaries (`ids`) alive at once during backward; `alive`: those
    that exist when it starts."""

    def __init__(self, ids, alive):
        super().__init__()
        self.ids, self.alive, self.most = ids, set(alive), len(alive)

    def recompute(self, node, passing=False):
        super().recompute(node, passing=passing)
        if id(node) in self.ids:
            self.alive.add(id(node))
            self.most = max(self.most, len(self.alive))

    def release(self, node):
        self.alive.discard(id(node))
        super().release(node)


def most_boundaries_alive(length, policy):
    """(boundaries alive after forward, the most alive at once in backward, the stack's boundary count, stats)."""
    model, x = chain(length)
    model.enable_gc(policy=policy)
    loss = model(x).sum()
    nodes = backward.find_topo_sort([loss])
    ids = {id(n) for n in nodes if n.boundary}
    machine = CountHeld(ids, [id(n) for n in nodes if n.boundary and n.cached_data is not None])
    after_forward = machine.most
    backward.run_backward(backward.plan_backward(loss), ndl.Tensor(np.ones((), "float32"), requires_grad=False),
                          machine)
    return after_forward, machine.most, len(ids), machine.stats
