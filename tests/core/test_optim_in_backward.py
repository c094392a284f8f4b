"""The optimizer in backward (issue 47): `in_backward=True` updates each parameter inside backward the moment its
gradient is final, and releases that gradient (LOMO).

Rules checked here, on a chain of residual blocks with a tied weight and a vector parameter:
  the parameters after 5 steps are bit-identical to the ordinary loop's, for every optimizer, every gc policy, lazy
  and eager (the update is step()'s arithmetic, applied one parameter at a time);
  when backward returns no parameter holds a gradient, and the allocator holds at most the largest parameter's
  bytes more than before the forward pass;
  the plan holds each update as a step of its own, after every step that reads the parameter;
  what cannot be exact raises one clear error: a second backward() before step() (accumulation).
"""
import gc as python_gc

import numpy as np
import pytest

import needle as ndl
from needle import backward, nn
from needle.backend_ndarray import ndarray as nd
from stack_cases import Block

OPTIMIZERS = {
    "sgd": lambda ps, **kw: ndl.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01, **kw),
    "adam": lambda ps, **kw: ndl.optim.Adam(ps, lr=0.01, weight_decay=0.01, **kw),
    "adam8bit": lambda ps, **kw: ndl.optim.Adam8bit(ps, lr=0.01, min_8bit_size=16, **kw),
    "adafactor": lambda ps, **kw: ndl.optim.Adafactor(ps, beta1=0.9, weight_decay=0.01, **kw),
    "adam-offloaded": lambda ps, **kw: ndl.optim.Adam(ps, lr=0.01, offload_state=True, **kw),
}
POLICIES = [None, "all", "sqrt", "selective", "layers"]


class TiedChain(nn.Module):
    """Residual blocks in a stack, then a head that reads the first block's weight again (a tied weight: read by
    the first layer's recomputation and by the head) and adds a vector parameter."""

    def __init__(self, length=5, width=8, seed=0):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.blocks = nn.Sequential(*[Block(width, rng) for _ in range(length)])
        self.bias = nn.Parameter(rng.standard_normal((2 * width,)).astype("float32"))

    def forward(self, x):
        y = self.blocks(x) @ self.blocks.modules[0].w
        return y + self.bias.broadcast_to(y.shape)


def batch(step, rows=4, width=8):
    return ndl.Tensor(np.random.default_rng(100 + step).standard_normal((rows, width)).astype("float32"),
                      requires_grad=False)


def train(optimizer, policy, lazy, in_backward, steps=5):
    """The parameters (NumPy) after `steps` steps of the usual loop: reset_grad, backward, step."""
    model = TiedChain()
    if policy is not None:
        model.enable_gc(policy=policy)
    opt = OPTIMIZERS[optimizer](model.parameters(), in_backward=in_backward)
    for step in range(steps):
        opt.reset_grad()
        with ndl.autograd.lazy_mode(lazy):
            loss = (model(batch(step)) ** 2).sum()
            loss.backward()
        opt.step()
    return [p.numpy() for p in model.parameters()]


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p or "off")
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_in_backward_gives_the_ordinary_loops_parameters_to_the_bit(optimizer, policy, lazy):
    ordinary = train(optimizer, policy, lazy, in_backward=False)
    fused = train(optimizer, policy, lazy, in_backward=True)
    assert all(np.array_equal(a, b) for a, b in zip(ordinary, fused))
    assert not all(np.array_equal(a, b) for a, b in zip(ordinary, train(optimizer, policy, lazy, False, steps=4)))


def test_the_plan_updates_each_parameter_once_after_every_step_that_reads_it():
    model = TiedChain()
    model.enable_gc(policy="all")
    ndl.optim.Adam(model.parameters(), lr=0.01, in_backward=True)
    loss = (model(batch(0)) ** 2).sum()
    plan = backward.plan_backward(loss)
    updated = plan.updated()
    assert sorted(map(id, updated)) == sorted(map(id, model.parameters()))
    position = {id(step): i for i, step in enumerate(plan.steps)}
    for step in plan.steps:
        if step.update:
            later = plan.steps[position[id(step)] + 1:]
            assert not any(step.node is s.node or any(step.node in n.inputs for n in s.recompute) or
                           (s.node.op is not None and step.node in s.node.inputs) for s in later)


@pytest.mark.parametrize("policy", [None, "all"], ids=lambda p: p or "off")
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_when_backward_returns_no_parameter_holds_a_gradient_nor_the_allocator_its_bytes(optimizer, policy):
    device = ndl.cpu() if nd.cpu().enabled() else ndl.cpu_numpy()
    model = TiedChain(length=4, width=64)
    if policy:
        model.enable_gc(policy=policy)
    opt = OPTIMIZERS[optimizer](model.parameters(), in_backward=True)
    largest = max(p.numpy().nbytes for p in model.parameters())
    for step in range(3):  # from the second step on, Adam's state exists before the forward pass
        x = batch(step, rows=32, width=64)
        python_gc.collect()
        before = nd.memory_stats(device)["current_bytes"]
        (model(x) ** 2).sum().backward()
        assert all(p.grad is None for p in model.parameters())
        after = nd.memory_stats(device)["current_bytes"]
        opt.step()
        if step:
            assert after - before <= largest, (after - before, largest)


def test_a_second_backward_before_step_is_an_error_not_an_accumulation():
    model = TiedChain()
    opt = ndl.optim.Adam(model.parameters(), lr=0.01, in_backward=True)
    (model(batch(0)) ** 2).sum().backward()
    before = [p.numpy() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"Adam\(in_backward=True\): backward\(\) ran again before step\(\)"):
        (model(batch(1)) ** 2).sum().backward()
    assert all(np.array_equal(a, p.numpy()) for a, p in zip(before, model.parameters()))  # nothing updated
    opt.step()
    (model(batch(1)) ** 2).sum().backward()  # after step(), the next backward updates again


def test_step_and_reset_grad_do_nothing_and_the_last_optimizer_built_decides():
    model = TiedChain()
    opt = ndl.optim.SGD(model.parameters(), lr=0.1, in_backward=True)
    (model(batch(0)) ** 2).sum().backward()
    after_backward = [p.numpy() for p in model.parameters()]
    opt.step()
    opt.reset_grad()
    assert all(np.array_equal(a, p.numpy()) for a, p in zip(after_backward, model.parameters()))
    ordinary = ndl.optim.SGD(model.parameters(), lr=0.1)  # built last: backward leaves the gradients to it
    (model(batch(1)) ** 2).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert all(np.array_equal(a, p.numpy()) for a, p in zip(after_backward, model.parameters()))
    ordinary.step()


def test_a_grad_hook_waiting_for_the_gradient_is_an_error():
    model = TiedChain()
    ndl.optim.Adam(model.parameters(), lr=0.01, in_backward=True)
    model.bias.register_grad_hook(lambda p: None)
    before = [p.numpy() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"a grad hook waits for the gradient of a parameter of shape \(16,\)"):
        (model(batch(0)) ** 2).sum().backward()
    assert all(np.array_equal(a, p.numpy()) for a, p in zip(before, model.parameters()))  # none updated first


def test_to_dot_draws_the_parameters_updated_in_backward():
    model = TiedChain(length=2)
    ndl.optim.Adam(model.parameters(), lr=0.01, in_backward=True)
    dot = ndl.viz.to_dot((model(batch(0)) ** 2).sum())
    assert dot.count("penwidth=2") == len(model.parameters()) + 1  # each parameter, and the legend's entry
    assert "parameter updated inside backward" in dot



@pytest.mark.parametrize("policy", [None, "all", "sqrt"], ids=lambda p: p or "off")
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_the_ledger_walks_the_updates_and_predicts_the_allocators_peak(optimizer, policy):
    """The Budget's ledger walks the same plan, update steps included: the gradients they free, the state the first
    one makes, their workspace (declared as a bound: `Optimizer.workspace_bytes`). Its prediction is the
    allocator's peak to 1% where the update is one fused kernel in place (Adam, float32), and never below it, nor
    above by more than the declared workspace, where it goes a chunk at a time."""
    from needle.ledger import walk_step
    device = ndl.cpu() if nd.cpu().enabled() else ndl.cpu_numpy()
    model = TiedChain(length=4, width=64)
    if policy:
        model.enable_gc(policy=policy)
    opt = OPTIMIZERS[optimizer](model.parameters(), in_backward=True)
    bound = max(opt.workspace_bytes(p) for p in model.parameters())
    for step in range(2):  # the first step's updates make the state; the second's find it
        x = batch(step, rows=32, width=64)
        with ndl.autograd.lazy_mode(True):
            loss = (model(x) ** 2).sum()
        dropped = {id(n) for n in ndl.autograd.find_topo_sort([loss]) if n.drop}
        predicted = walk_step(loss, dropped).peak - x.numpy().nbytes  # (the ledger counts the batch)
        python_gc.collect()
        nd.reset_peak_memory_stats(device)
        base = nd.memory_stats(device)["current_bytes"]
        loss.backward()
        measured = nd.memory_stats(device)["peak_bytes"] - base
        assert measured - 0.01 * measured <= predicted <= measured + 0.01 * measured + bound, (step, predicted,
                                                                                              measured, bound)
        if optimizer == "adam-offloaded" or bound == 0:
            assert abs(predicted - measured) <= 0.01 * measured
        opt.step()


def test_a_budget_plans_with_the_updates_in_backward_and_its_bound_holds():
    """The Budget's ledger walks the update steps: with the gradients freed as backward goes, its least feasible
    peak falls (here by a third of the gradients' bytes: the rest of the peak is the recomputation's), and a bound at
    that least peak holds on the allocator."""
    from needle.checkpoint_budget import Budget, InfeasibleBudget
    device = ndl.cpu() if nd.cpu().enabled() else ndl.cpu_numpy()

    def least_peak(in_backward):
        model = TiedChain(length=8, width=64)
        model.enable_gc(policy=(budget := Budget(1)))
        ndl.optim.SGD(model.parameters(), lr=0.01, in_backward=in_backward)
        with ndl.autograd.lazy_mode(True):
            loss = (model(batch(0, rows=32, width=64)) ** 2).sum()
            with pytest.raises(InfeasibleBudget):
                loss.backward()
        return budget.minimum_peak

    ordinary, fused = least_peak(False), least_peak(True)
    gradients = sum(p.numpy().nbytes for p in TiedChain(length=8, width=64).parameters())
    assert fused <= ordinary - gradients // 4, (ordinary, fused, gradients)
    model = TiedChain(length=8, width=64)
    model.enable_gc(policy=(budget := Budget(fused)))
    opt = ndl.optim.SGD(model.parameters(), lr=0.01, in_backward=True)
    for step in range(2):
        x = batch(step, rows=32, width=64)
        with ndl.autograd.lazy_mode(True):
            loss = (model(x) ** 2).sum()
        python_gc.collect()
        nd.reset_peak_memory_stats(device)
        base = nd.memory_stats(device)["current_bytes"]
        loss.backward()
        assert nd.memory_stats(device)["peak_bytes"] - base <= fused
        opt.step()
    assert budget.predicted_peak <= fused
