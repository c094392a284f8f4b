"""Checkpointing on real layers and the Transformer language model; each test names the rule it checks.

The user's question: "is the recomputation exact?" Gradients with gc on must be bit-identical (np.array_equal)
to gc off, for every annotating module, every policy, segment lengths 1..5 and both LAZY_MODE values.
"""
import gc as python_gc
import tracemalloc

import numpy as np
import pytest

import needle as ndl
from needle import autograd, checkpoint, checkpoint_budget, nn
from needle import backend_ndarray as nd

from conftest import count_computes
from models import LanguageModel

GC_SETTINGS = [dict(segment_len=k) for k in range(1, 6)] + [
    dict(), dict(policy="sqrt"), dict(policy="selective")]
GC_IDS = [f"seg{k}" for k in range(1, 6)] + ["all", "sqrt", "selective"]
DEVICE = nd.cpu() if nd.cpu().enabled() else nd.cpu_numpy()


def _modules():
    """(name, constructor, input shapes) of every module that annotates its interior."""
    return [
        ("Linear", lambda: nn.Linear(6, 5, device=DEVICE), [(4, 6)]),
        ("ReLU", lambda: nn.Sequential(nn.Linear(6, 5, device=DEVICE), nn.ReLU()), [(4, 6)]),
        ("LayerNorm1d", lambda: nn.LayerNorm1d(6, device=DEVICE), [(4, 6)]),
        ("Embedding", lambda: nn.Embedding(10, 6, device=DEVICE), "ids"),
        ("MultiHeadAttention", lambda: nn.MultiHeadAttention(dropout=0.2, causal=True, device=DEVICE),
         [(2, 3, 5, 4)] * 3),
        ("AttentionLayer", lambda: nn.AttentionLayer(8, 2, 4, dropout=0.2, device=DEVICE), [(2, 5, 8)]),
        ("TransformerLayer", lambda: nn.TransformerLayer(8, 2, 4, 16, dropout=0.2, device=DEVICE), [(2, 5, 8)]),
        ("Transformer", lambda: nn.Transformer(8, 16, 2, num_head=2, dim_head=4, dropout=0.2, device=DEVICE,
                                               sequence_len=8), [(5, 2, 8)]),
    ]


def _module_grads(make, shapes, gc, lazy):
    np.random.seed(0)
    module = make()
    if gc is not None:
        module.enable_gc(**gc)
    rs = np.random.RandomState(1)
    if shapes == "ids":
        inputs = [ndl.Tensor(rs.randint(0, 10, size=(3, 2)).astype(np.float32), device=DEVICE, requires_grad=False)]
    else:
        inputs = [ndl.Tensor(rs.randn(*s).astype(np.float32), device=DEVICE) for s in shapes]
    np.random.seed(2)  # dropout masks: the same draws with gc on and off
    with autograd.lazy_mode(lazy):
        out = module(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        loss = (out * out).sum()
        loss.backward()
    grads = [p.grad.numpy() for p in module.parameters()]
    grads += [x.grad.numpy() for x in inputs if x.requires_grad]
    return loss.numpy(), grads, checkpoint.last_backward_stats()


@pytest.mark.filterwarnings("ignore::needle.checkpoint.NothingToDropWarning")  # one-op layers: nothing to drop
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("gc", GC_SETTINGS, ids=GC_IDS)
@pytest.mark.parametrize("name, make, shapes", _modules(), ids=[m[0] for m in _modules()])
def test_rule4_module_gradients_bit_identical(name, make, shapes, gc, lazy):
    """Rule 4 (and rule 2): every annotating module, every policy: gradients equal gc off bit for bit."""
    loss_off, grads_off, _ = _module_grads(make, shapes, None, lazy=False)
    loss_on, grads_on, stats = _module_grads(make, shapes, gc, lazy)
    assert np.array_equal(loss_off, loss_on)
    assert len(grads_off) == len(grads_on)
    for g_off, g_on in zip(grads_off, grads_on):
        assert np.array_equal(g_off, g_on)
    assert stats["max_recomputes_per_node"] <= 1


def _lm(gc, dropout=0.1, layers=2):
    np.random.seed(0)
    model = LanguageModel(8, 30, 16, num_layers=layers, seq_model="transformer", seq_len=6, device=DEVICE,
                          num_head=2, dim_head=4, dropout=dropout)
    if gc is not None:
        model.enable_gc(**gc)
    return model


def _batch(seed=0, T=6, B=3):
    rs = np.random.RandomState(seed)
    X = ndl.Tensor(rs.randint(0, 30, size=(T, B)).astype(np.float32), device=DEVICE, requires_grad=False)
    y = ndl.Tensor(rs.randint(0, 30, size=(T * B,)).astype(np.float32), device=DEVICE, requires_grad=False)
    return X, y


def _adam_losses(gc, lazy, steps=5):
    model = _lm(gc)
    opt = ndl.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for step in range(steps):
        X, y = _batch(step)
        np.random.seed(100 + step)
        opt.reset_grad()
        with autograd.lazy_mode(lazy):
            out, _ = model(X)
            loss = nn.SoftmaxLoss()(out, y)
            losses.append(loss.numpy().copy())
            loss.backward()
        opt.step()
    return losses, [p.numpy() for p in model.parameters()]


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("gc", GC_SETTINGS, ids=GC_IDS)
def test_rule5_language_model_adam_steps_bit_identical(gc, lazy):
    """Rules 4 and 5: 5 Adam steps of LanguageModel(transformer, dropout 0.1): losses and weights bit-identical.

    This catches gradients realized after an in-place update (the earlier project's 43.4 vs 21.2 drift).
    """
    losses_off, params_off = _adam_losses(None, lazy=False)
    losses_on, params_on = _adam_losses(gc, lazy)
    assert all(np.array_equal(a, b) for a, b in zip(losses_off, losses_on))
    assert all(np.array_equal(a, b) for a, b in zip(params_off, params_on))


def _step_memory(gc, lazy=True, batch=16, layers=2):
    """(M_act, M_peak, residual bytes the graph says it keeps) of one LM step, exact allocator bytes."""
    model = _lm(gc, dropout=0.0, layers=layers)
    X, y = _batch(0, T=6, B=batch)
    params = model.parameters()
    python_gc.collect()
    nd.reset_peak_memory_stats(DEVICE)
    base = nd.memory_stats(DEVICE)["current_bytes"]
    with autograd.lazy_mode(lazy):
        out = model(X)[0]  # (not holding the transformer's zeros state, which is no activation)
        loss = nn.SoftmaxLoss()(out, y)
        loss.realize_cached_data()
        act = nd.memory_stats(DEVICE)["current_bytes"] - base
        kept = sum(b for _, _, b in checkpoint.saved_residuals(loss, exclude=params + [X, y]))
        del out
        loss.backward()
    peak = nd.memory_stats(DEVICE)["peak_bytes"] - base
    return act, peak, kept


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_rule3_activation_bytes_are_exactly_what_the_graph_keeps(lazy):
    """Rule 3: at the start of backward the allocator holds exactly the values the graph keeps, no more."""
    for gc in (None, dict(), dict(policy="sqrt"), dict(policy="selective")):
        act, _, kept = _step_memory(gc, lazy=lazy)
        assert act == kept, gc


def test_rule3_policies_shrink_activation_and_peak_memory():
    """Rule 3: "all" keeps least, then sqrt, then selective, then gc off; the step's peak is lower with gc on.

    Stated margins for this small model (batch 16, 2 layers): "all" holds at most 40% of gc off's activation
    bytes at the start of backward, and its step peak is at least 15% lower.
    """
    act = {}
    peak = {}
    for name, gc in (("off", None), ("all", dict()), ("sqrt", dict(policy="sqrt")),
                     ("selective", dict(policy="selective"))):
        act[name], peak[name], _ = _step_memory(gc, batch=16)
    assert act["all"] <= act["sqrt"] <= act["selective"] < act["off"]
    assert act["all"] <= 0.40 * act["off"]
    assert peak["all"] <= 0.85 * peak["off"]


def test_rule2_language_model_recomputes_each_dropped_node_at_most_once():
    """Rule 2 on the full model, its layers a stack (issue 46): count op.compute calls per node during backward.
    A value backward holds is recomputed at most once; a dropped boundary of the stack is one of them. What is
    computed only on the way to a dropped boundary (an earlier layer's interior, `passing_nodes`) is not held, and
    computed once more when its own layer is differentiated: at most twice, each counted."""
    model = _lm(dict(), dropout=0.1)
    X, y = _batch(0)
    with autograd.lazy_mode(True):
        out, _ = model(X)
        loss = nn.SoftmaxLoss()(out, y)
        loss.realize_cached_data()
    nodes = [n for n in autograd.find_topo_sort([loss]) if not n.is_leaf()]
    counts = count_computes(nodes)
    loss.backward()
    dropped = [n for n in nodes if n.drop]
    stats = checkpoint.last_backward_stats()
    assert dropped and any(n.boundary for n in dropped)  # the stack dropped a layer's output
    assert stats["max_recomputes_per_node"] == 1 and max(counts.values()) <= 2
    assert all(counts.get(id(n), 0) <= 1 for n in nodes if n.boundary)
    assert 0 < sum(c - 1 for c in counts.values()) <= stats["passing_nodes"]
    assert stats["recomputed_nodes"] == sum(counts.values())


@pytest.mark.parametrize("gc", [None, dict(), dict(policy="sqrt")], ids=["off", "all", "sqrt"])
def test_rule3_no_leak_over_50_steps(gc):
    """Rule 3: after each step (grads reset) current bytes return to parameters + optimizer state."""
    model = _lm(gc, dropout=0.1, layers=1)
    params = model.parameters()
    opt = ndl.optim.Adam(params, lr=0.01)
    X, y = _batch(0)
    python_gc.collect()  # earlier tests' garbage (an exception's frames) must not be collected mid-measurement
    after = []
    for step in range(50):
        opt.reset_grad()
        out, _ = model(X)
        loss = nn.SoftmaxLoss()(out, y)
        loss.backward()
        opt.step()
        del out, loss
        opt.reset_grad()
        after.append(nd.memory_stats(DEVICE)["current_bytes"])
    param_bytes = sum(4 * int(np.prod(p.shape)) for p in params)
    assert after[-1] == after[1]  # flat: nothing accumulates step after step
    assert after[-1] - nd.memory_stats(DEVICE)["current_bytes"] == 0
    held = after[-1]
    assert held >= 3 * param_bytes  # parameters + Adam's two moments are alive...
    python_gc.collect()


def test_budget_infeasible_raises_with_minimum():
    """A Budget below what checkpointing can reach says so, with the minimum, before anything is computed."""
    budget = checkpoint.Budget(1)
    model = _lm(None, dropout=0.0)
    model.enable_gc(policy=budget)
    X, y = _batch(0)
    with autograd.lazy_mode(True):
        loss = nn.SoftmaxLoss()(model(X)[0], y)
        with pytest.raises(ValueError, match=r"infeasible: the least peak activation memory .* is \d+ bytes"):
            loss.backward()
        assert all(n.cached_data is None for n in autograd.find_topo_sort([loss]) if not n.is_leaf())
    assert budget.minimum_peak > 1


def _measured_peak(model, forward, make_batch, lazy=True, predict=False):
    """The allocator's peak over one training step, minus the bytes held when it started (before the batch is
    made, as Budget counts it); with `predict`, also predict_peak's prediction for the step's drops."""
    for p in model.parameters():  # as an optimizer's reset_grad: last step's gradients are not freed in this one's
        p.grad = None
    python_gc.collect()
    nd.reset_peak_memory_stats(DEVICE)
    base = nd.memory_stats(DEVICE)["current_bytes"]
    X, y = make_batch()
    predicted = None
    with autograd.lazy_mode(lazy):
        loss = nn.SoftmaxLoss()(forward(model, X), y)
        if predict:
            dropped = {id(n) for n in autograd.find_topo_sort([loss]) if n.drop}
            predicted = checkpoint_budget.predict_peak(loss, dropped)
        loss.backward()
    return predicted, nd.memory_stats(DEVICE)["peak_bytes"] - base


@pytest.mark.parametrize("gc", [None, dict(), dict(policy="sqrt"), dict(policy="selective"), dict(segment_len=2)],
                         ids=["off", "all", "sqrt", "selective", "seg2"])
def test_predicted_peak_matches_the_allocator(gc):
    """The Budget's prediction of a step (predict_peak: the backward plan walked by the ledger), uncalibrated
    and made before anything is computed, is within 1% of the measured peak.

    It counts buffers, not values: a kept reshape of a dropped value holds that value's bytes, and a reshape
    of a transposed value owns a copy. Budget plans rest on this prediction.
    """
    predicted, measured = _measured_peak(_lm(gc, dropout=0.1, layers=2), lambda m, X: m(X)[0],
                                         lambda: _batch(0, T=6, B=16), predict=True)
    assert abs(predicted / measured - 1) <= 0.01, (predicted, measured)


def _relu_mlp():
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(16, 64, device=DEVICE), nn.ReLU(), nn.Linear(64, 64, device=DEVICE),
                          nn.Sigmoid(), nn.Linear(64, 10, device=DEVICE))
    return model, lambda m, X: m(X), (np.random.randn(32, 16), np.random.randint(0, 10, 32))


def _rnn_lm(seq_model="rnn"):
    np.random.seed(0)
    model = LanguageModel(16, 30, 32, num_layers=1, seq_model=seq_model, seq_len=6, device=DEVICE)
    rs = np.random.RandomState(0)
    return model, lambda m, X: m(X)[0], (rs.randint(0, 30, (6, 16)), rs.randint(0, 30, 96))


def _lstm_lm():
    return _rnn_lm("lstm")


def _conv_net():
    np.random.seed(0)
    model = nn.Sequential(nn.Conv(3, 8, 3, device=DEVICE), nn.ReLU(), nn.Conv(8, 8, 3, stride=2, device=DEVICE),
                          nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 10, device=DEVICE))
    rs = np.random.RandomState(0)
    return model, lambda m, X: m(X), (rs.randn(4, 3, 8, 8), rs.randint(0, 10, 4))


@pytest.mark.parametrize("gc", [None, dict(), dict(policy="sqrt")], ids=["off", "all", "sqrt"])
@pytest.mark.parametrize("build", [_relu_mlp, _rnn_lm, _lstm_lm, _conv_net],
                         ids=["relu_sigmoid_mlp", "rnn_lm", "lstm_lm", "conv_net"])
@pytest.mark.filterwarnings("ignore::needle.checkpoint.NothingToDropWarning")  # one-op layers: nothing to drop
def test_predicted_peak_matches_the_allocator_beyond_the_transformer(build, gc):
    """The same within 1% for an MLP (ReLU's mask and Sigmoid's temporary are counted), an RNN and an LSTM
    (tuples, and sums of tuple gradients) and a strided conv net (im2col, dilated and sliced gradients)."""
    model, forward, (x, y) = build()
    if gc is not None:
        model.enable_gc(**gc)

    def batch():
        return (ndl.Tensor(x.astype(np.float32), device=DEVICE, requires_grad=False),
                ndl.Tensor(y.astype(np.float32), device=DEVICE, requires_grad=False))

    predicted, measured = _measured_peak(model, forward, batch, predict=True)
    assert abs(predicted / measured - 1) <= 0.01, (predicted, measured)


def _budget_peaks(fraction, off_peak, lazy=True, steps=2):
    """(budget, measured peak of each step) of an LM trained with Budget(fraction * off_peak) and no plan() call."""
    model = _lm(None, dropout=0.0, layers=2)
    budget = checkpoint.Budget(int(off_peak * fraction))
    model.enable_gc(policy=budget)
    peaks = [_measured_peak(model, lambda m, X: m(X)[0], lambda: _batch(0, T=6, B=16), lazy=lazy)[1]
             for _ in range(steps)]
    return budget, peaks


def test_budget_every_lazy_step_stays_under_the_budget_and_shrinks_with_it():
    """Budget(b), lazy mode, no plan() call: every step, the first included, peaks at most 1.05 b and within 1%
    of the prediction; a smaller b never gives a larger peak."""
    _, off_peak = _measured_peak(_lm(None, dropout=0.0), lambda m, X: m(X)[0], lambda: _batch(0, T=6, B=16))
    measured = []
    for fraction in (0.9, 0.75, 0.6):
        budget, peaks = _budget_peaks(fraction, off_peak)
        for peak in peaks:
            assert peak <= 1.05 * budget.bytes, (fraction, peak, budget.bytes)
            assert abs(budget.predicted_peak / peak - 1) <= 0.01, (fraction, budget.predicted_peak, peak)
        measured.append(peaks[-1])
    assert measured == sorted(measured, reverse=True)


def test_budget_eager_traces_the_first_step_then_replays():
    """Budget(b), eager mode: the first step traces (nothing dropped in its forward), its backward already uses
    the plan, and every later step replays the frozen decisions and stays under 1.05 b."""
    _, off_peak = _measured_peak(_lm(None, dropout=0.0), lambda m, X: m(X)[0], lambda: _batch(0, T=6, B=16),
                                 lazy=False)
    budget, peaks = _budget_peaks(0.75, off_peak, lazy=False, steps=3)
    assert budget.planned and all(peak <= 1.05 * budget.bytes for peak in peaks[1:]), (peaks, budget.bytes)
    assert checkpoint.last_backward_stats()["recomputed_nodes"] > 0
    # The frozen decisions are a pure policy of their own: a fresh model under it drops the same nodes.
    frozen = budget.plan(ndl.Tensor(np.ones(()), device=DEVICE))  # nothing pending: the frozen table as it is
    assert frozen(autograd.find_topo_sort([ndl.Tensor(np.ones(1))])) == [True]  # an unknown region keeps all
    twin = _lm(None, dropout=0.0, layers=2).enable_gc(policy=frozen)
    X, y = _batch(0, T=6, B=16)
    loss = nn.SoftmaxLoss()(twin(X)[0], y)
    assert any(n.drop for n in autograd.find_topo_sort([loss]))


def test_budget_needs_no_plan_call_survives_eval_and_failed_steps_and_does_not_grow():
    """docs/checkpointing.md's one-liner: enable_gc(policy=Budget(b)) under a memory cap, 50 lazy steps with an
    eval forward and a failed step among them; allocator bytes and live graph nodes do not grow."""
    model = _lm(None, dropout=0.0, layers=1)
    opt = ndl.optim.Adam(model.parameters(), lr=0.01)
    _, off_peak = _measured_peak(_lm(None, dropout=0.0, layers=1), lambda m, X: m(X)[0], lambda: _batch(0))
    budget = checkpoint.Budget(int(0.95 * off_peak))
    model.enable_gc(policy=budget)
    X, y = _batch(0)
    held, nodes = [], []
    python_gc.collect()
    adam_state = 2 * sum(4 * int(np.prod(p.shape)) for p in model.parameters())
    cap = nd.memory_stats(DEVICE)["current_bytes"] + adam_state + int(1.1 * budget.bytes)
    nd.set_memory_limit(cap, DEVICE)
    try:
        for step in range(50):
            if step == 10:  # an eval forward: a graph that never runs backward
                model.eval()
                with autograd.lazy_mode(True):
                    model(X)[0].realize_cached_data()
                model.train()
            if step == 20:  # a step that fails in backward
                with autograd.lazy_mode(True):
                    loss = nn.SoftmaxLoss()(model(X)[0], y)
                    with pytest.raises(ValueError):
                        loss.backward(ndl.Tensor(np.ones((2,), np.float32), device=DEVICE, requires_grad=False))
                del loss
            opt.reset_grad()
            with autograd.lazy_mode(True):
                loss = nn.SoftmaxLoss()(model(X)[0], y)
                loss.backward()
            opt.step()
            del loss
            opt.reset_grad()
            python_gc.collect()
            held.append(nd.memory_stats(DEVICE)["current_bytes"])
            nodes.append(autograd.TENSOR_COUNTER)
    finally:
        nd.set_memory_limit(0, DEVICE)
    assert budget.planned
    assert held[-1] == held[2] and nodes[-1] == nodes[2], (held[:3], held[-3:], nodes[:3], nodes[-3:])


def _tightest_budget(X, y, lazy, low):
    """A Budget at the least peak checkpointing can reach on a one-layer _lm's step: it drops all it can."""
    probe = checkpoint.Budget(1)
    model = _lm(None, layers=1).enable_gc(policy=probe)
    with autograd.lazy_mode(lazy), pytest.raises(checkpoint_budget.InfeasibleBudget):
        (_lm_loss(model, X, y, low) * 1.0).backward()
    return checkpoint.Budget(probe.minimum_peak)


def _lm_loss(model, X, y, low):
    np.random.seed(7)  # dropout's masks: the same draws in every run
    with ndl.autocast("float16", enabled=low):
        return nn.SoftmaxLoss()(model(X)[0], y)


@pytest.mark.parametrize("read_before", [True, False], ids=["read", "unread"])
@pytest.mark.parametrize("loop", ["mul", "scaler"])
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("gc", [None, dict(), dict(policy="sqrt"), dict(policy="selective"), "budget"],
                         ids=["off", "all", "sqrt", "selective", "budget"])
def test_rule1_the_loss_read_after_backward_and_step_is_the_forward_loss(gc, lazy, loop, read_before):
    """Rule 1: a one-element value (the loss) is never released by backward nor dropped, so the everyday loop
    reads the forward's loss after the step, read before backward or not (AMP loops call loss.item() after
    scaler.step), with every policy, lazy and eager, float32 or float16 with GradScaler. It used to read the
    loss of the updated model."""
    X, y = _batch(0)
    expected = _lm_loss(_lm(None, layers=1), X, y, low=loop == "scaler").numpy()
    model = _lm(None, layers=1)
    model.enable_gc(**(dict(policy=_tightest_budget(X, y, lazy, loop == "scaler")) if gc == "budget" else gc or {}))
    if gc is None:
        model.disable_gc()
    opt = ndl.optim.SGD(model.parameters(), lr=0.5)
    with autograd.lazy_mode(lazy):
        loss = _lm_loss(model, X, y, low=loop == "scaler")
        if read_before:
            assert np.array_equal(loss.numpy(), expected)
        if loop == "scaler":
            scaler = ndl.amp.GradScaler(init_scale=2.0**8)
            scaler.scale(loss).backward()
            assert scaler.step(opt)
            scaler.update()
        else:
            (loss * 1.0).backward()
            opt.step()
    if gc is not None:
        assert checkpoint.last_backward_stats()["recomputed_nodes"] > 0  # the policy dropped something
    assert np.array_equal(loss.numpy(), expected)
    assert not np.array_equal(_lm_loss(model, X, y, low=loop == "scaler").numpy(), expected)  # the step was taken


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_budget_bookkeeping_stays_bounded_over_many_steps(lazy):
    """A Budget's bookkeeping of undecided regions is bounded: a region leaves once it is decided or its graph is
    gone, so after every step nothing is pending and 25 steps leave the Python heap as it was (it held 1,170
    regions after 90 steps and grew by 2-4 KB a step: regions with nothing to decide were never let go)."""
    model = _lm(None, dropout=0.0, layers=1)
    budget = checkpoint.Budget(10**9)
    model.enable_gc(policy=budget)
    opt = ndl.optim.SGD(model.parameters(), lr=0.01)
    X, y = _batch(0)

    def step():
        opt.reset_grad()
        with autograd.lazy_mode(lazy):
            nn.SoftmaxLoss()(model(X)[0], y).backward()
        opt.step()
        assert not budget._pending

    tracemalloc.start()  # before the first step: memory allocated untraced and freed later would read as growth
    try:
        for _ in range(10):  # the first steps plan and fill the caches (and the weak dictionaries reach their size)
            step()
        python_gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(25):
            step()
        python_gc.collect()
        growth = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert budget.planned and growth < 4096, growth


def test_rule2_lazy_forward_computes_each_node_once_with_gc():
    """Rule 2 for the forward: layers read their inputs' shapes while the lazy graph is built; shape inference
    answers without computing, so a dropped region is not computed once early and again for its boundary."""
    computed = []
    for gc in (None, dict()):
        model = _lm(gc, dropout=0.0)
        X, y = _batch(0)
        with autograd.lazy_mode(True):
            loss = nn.SoftmaxLoss()(model(X)[0], y)
            graph = [n for n in autograd.find_topo_sort([loss]) if not n.is_leaf()]
            assert all(n.cached_data is None for n in graph)  # nothing computed while building
            counts = count_computes(graph)
            loss.realize_cached_data()
        computed.append(sum(counts.values()))
        assert max(counts.values()) == 1
    assert computed[0] == computed[1]


@pytest.mark.parametrize("seq_model", ["rnn", "lstm"])
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_rule2_recurrent_backward_recomputes_nothing_with_gc_off(seq_model, lazy):
    """With gc off no forward value is computed again in backward: the per-step tuple gradients (make_tuple of
    the time step's gradient and zeros) keep their elements, so summing them never rebuilds released nodes."""
    model, forward, (x, y) = _rnn_lm(seq_model)
    X = ndl.Tensor(x.astype(np.float32), device=DEVICE, requires_grad=False)
    Y = ndl.Tensor(y.astype(np.float32), device=DEVICE, requires_grad=False)
    with autograd.lazy_mode(lazy):
        loss = nn.SoftmaxLoss()(forward(model, X), Y)
        loss.realize_cached_data()
        graph = [n for n in autograd.find_topo_sort([loss]) if not n.is_leaf()]
        counts = count_computes(graph)
        loss.backward()
    assert sum(counts.values()) == 0 and checkpoint.last_backward_stats()["recomputed_nodes"] == 0


def test_the_lstms_step_peak_follows_checkpointing():
    """Issue 45: `LanguageModel(256, 1000, 256, num_layers=2, seq_model="lstm")`, T 32, B 16: with "all" the step's
    peak (M_peak) was 122.6 of gc off's 135.3 MB, because backward kept one weight-gradient part per time step until
    the end. Summed as they arrive (backward._accumulate), "all" now peaks at least 40% below gc off."""
    def peak(gc):
        model = LanguageModel(256, 1000, 256, num_layers=2, seq_model="lstm", seq_len=32, device=DEVICE)
        if gc is not None:
            model.enable_gc(**gc)
        rs = np.random.RandomState(0)
        X = ndl.Tensor(rs.randint(0, 1000, (32, 16)).astype(np.float32), device=DEVICE, requires_grad=False)
        y = ndl.Tensor(rs.randint(0, 1000, (512,)).astype(np.float32), device=DEVICE, requires_grad=False)
        python_gc.collect()
        base = nd.memory_stats(DEVICE)["current_bytes"]
        nd.reset_peak_memory_stats(DEVICE)
        nn.SoftmaxLoss()(model(X)[0], y).backward()
        return nd.memory_stats(DEVICE)["peak_bytes"] - base
    off, on = peak(None), peak(dict(policy="all"))
    assert on <= 0.6 * off, (on, off)
