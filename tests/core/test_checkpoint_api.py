"""The user-facing checkpointing API: checkpoint(), checkpoint_sequential(), print_saved_residuals(), enable_gc's
argument check and viz.to_dot. Each test names the rule of needle/checkpoint.py it checks, where one applies."""
import gc as python_gc
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import needle as ndl
from needle import autograd, checkpoint, nn, ops
from needle import backend_ndarray as nd



def _weights(device, n=3, width=8, seed=0):
    rs = np.random.RandomState(seed)
    return [ndl.Tensor(rs.randn(width, width).astype(np.float32) / width, device=device) for _ in range(n)]


def _chain(x, *ws):
    """relu(... relu(relu(x @ w1) @ w2) ...): a few matmuls and relus."""
    for w in ws:
        x = ops.relu(x @ w)
    return x


def _interior(out, inputs):
    """The non-leaf nodes strictly between `inputs` and `out`."""
    stop = {id(n) for n in inputs}
    order = autograd.find_topo_sort([out], expand=lambda n: id(n) not in stop)
    return [n for n in order if id(n) not in stop and n is not out and not n.is_leaf()]


def _parse_dot(dot):
    pydot = pytest.importorskip("pydot", reason="pydot (a DOT parser) is a test dependency")
    with warnings.catch_warnings():  # pydot's parser uses pyparsing names that newer pyparsing deprecates
        warnings.simplefilter("ignore", DeprecationWarning)
        graphs = pydot.graph_from_dot_data(dot)
    assert graphs, "pydot could not parse the DOT text"
    return graphs[0]


# ----- checkpoint(fn, *args) --------------------------------------------------------------------------------------
@pytest.mark.devices("cpu", "cpu_numpy")
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.smoke
def test_rule4_checkpoint_gradients_bit_identical(device, lazy):
    """Rule 4b: checkpoint(fn, x) gives the output and gradients of fn(x) bit for bit, eager and lazy."""
    ws = _weights(device)
    x = ndl.Tensor(np.random.RandomState(1).randn(5, 8).astype(np.float32), device=device)

    def fn(h):
        return _chain(h, *ws)  # the weights: leaves read from the closure

    results = []
    for use_checkpoint in (False, True):
        with autograd.lazy_mode(lazy):
            out = checkpoint.checkpoint(fn, x) if use_checkpoint else fn(x)
            loss = ops.logsumexp(out, axes=(1,)).sum()
            loss.backward()
        recomputed = checkpoint.last_backward_stats()["recomputed_nodes"]
        results.append((loss.numpy(), x.grad.numpy(), [w.grad.numpy() for w in ws], recomputed))
    (loss0, gx0, gw0, rec0), (loss1, gx1, gw1, rec1) = results
    np.testing.assert_array_equal(loss0, loss1)
    np.testing.assert_array_equal(gx0, gx1)
    for a, b in zip(gw0, gw1):
        np.testing.assert_array_equal(a, b)
    assert rec0 == 0 and rec1 > 0  # the checkpointed run really recomputed its interior


def test_rule1_checkpoint_drops_the_interior_only():
    """Rule 1: checkpoint() drops the interior; its Tensor args, leaves and output are kept; fn's output is returned."""
    device = nd.cpu_numpy()
    ws = _weights(device)
    x = ndl.Tensor(np.ones((4, 8), np.float32), device=device)
    made = []
    out = checkpoint.checkpoint(lambda h: made.append(_chain(h, *ws)) or made[-1], x)
    assert out is made[0]
    interior = _interior(out, [x])
    assert len(interior) == 5  # matmul, relu, matmul, relu, matmul
    assert all(n.drop and n.cached_data is None for n in interior)  # eager: released at once (rule 3)
    assert not out.drop and not x.drop and not any(w.drop for w in ws)
    assert checkpoint.keep_reason(out) == "boundary"


@pytest.mark.devices("cpu", "cpu_numpy")
def test_rule3_checkpoint_holds_less_memory_before_backward(device):
    """Rule 3: on the C++ cpu() device (and the reference), a checkpointed chain holds exactly its interior's bytes
    less."""
    ws = _weights(device, n=3, width=128)
    x = ndl.Tensor(np.ones((64, 128), np.float32), device=device, requires_grad=False)
    held = []
    for use_checkpoint in (False, True):
        python_gc.collect()
        start = nd.memory_stats(device)["current_bytes"]
        out = checkpoint.checkpoint(_chain, x, *ws) if use_checkpoint else _chain(x, *ws)
        held.append(nd.memory_stats(device)["current_bytes"] - start)
        del out
    activation = 64 * 128 * 4
    assert held[0] == 6 * activation  # three matmul and three relu outputs
    assert held[1] == activation  # only the output: the five interior values are gone


def test_checkpoint_passes_policy_and_segment_len_through():
    """checkpoint(..., segment_len=k / policy=...) keeps the policy's checkpoints, as annotate does."""
    device = nd.cpu_numpy()
    ws = _weights(device, n=4)
    x = ndl.Tensor(np.ones((4, 8), np.float32), device=device)
    out = checkpoint.checkpoint(_chain, x, *ws, segment_len=2)
    kept = [n for n in _interior(out, [x]) if not n.drop]
    assert [checkpoint.keep_reason(n) for n in kept] == ["checkpoint"] * 3  # every 2nd of 7 candidates
    out = checkpoint.checkpoint(_chain, x, *ws, policy="selective")
    assert {type(n.op).__name__ for n in _interior(out, [x]) if not n.drop} == {"MatMul"}


def test_rule1_checkpoint_with_tuple_output_and_non_tensor_args():
    """Rule 1: every output of a tuple-returning fn is kept; non-Tensor arguments are passed through."""
    device = nd.cpu_numpy()
    (w,) = _weights(device, n=1)
    x = ndl.Tensor(np.ones((4, 8), np.float32), device=device)

    def two_heads(h, scale):
        z = ops.relu(h @ w)
        return ops.exp(z * scale), ops.tanh(z)

    a, b = checkpoint.checkpoint(two_heads, x, 0.5)
    assert not a.drop and not b.drop
    assert [n.drop for n in _interior(a, [x])] == [True] * 3  # matmul, relu, z * scale
    (a.sum() + b.sum()).backward()
    expected = (np.exp(np.maximum(x.numpy() @ w.numpy(), 0) * 0.5)).sum()
    np.testing.assert_allclose(a.sum().numpy(), expected, rtol=1e-6)


# ----- checkpoint_sequential(modules, segments, x) ----------------------------------------------------------------
def _mlp(device, seed=0):
    np.random.seed(seed)
    return nn.Sequential(nn.Linear(8, 16, device=device), nn.ReLU(), nn.Linear(16, 16, device=device), nn.Tanh(),
                         nn.Linear(16, 4, device=device), nn.ReLU())


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("segments", [1, 2, 4, 6])
def test_rule4_checkpoint_sequential_gradients_bit_identical(lazy, segments):
    """Rule 4b: checkpoint_sequential gives the gradients of running the modules plainly, bit for bit."""
    device = nd.cpu_numpy()
    model = _mlp(device)
    x = ndl.Tensor(np.random.RandomState(2).randn(5, 8).astype(np.float32), device=device)
    grads = []
    for use_checkpoint in (False, True):
        with autograd.lazy_mode(lazy):
            out = checkpoint.checkpoint_sequential(model, segments, x) if use_checkpoint else model(x)
            out.sum().backward()
        grads.append([x.grad.numpy()] + [p.grad.numpy() for p in model.parameters()])
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)


def test_rule1_checkpoint_sequential_keeps_chunk_boundaries_and_drops_interiors():
    """Rule 1: 4 modules in 2 chunks: the output of module 2 (a chunk's end) is kept, modules 1 and 3's dropped."""
    device = nd.cpu_numpy()
    ws = _weights(device, n=4)
    outputs = []

    def layer(w):
        return lambda h: outputs.append(ops.relu(h @ w)) or outputs[-1]

    x = ndl.Tensor(np.ones((4, 8), np.float32), device=device)
    y = checkpoint.checkpoint_sequential([layer(w) for w in ws], 2, x)
    assert y is outputs[3]
    assert [o.drop for o in outputs] == [True, False, True, False]
    # each module a region of its own, their outputs the boundaries of one stack (what enable_gc makes of a
    # Sequential), the chunk ends its checkpoints
    assert [checkpoint.region_of(o)[0] for o in outputs] == [f"modules[{i}]" for i in range(4)]
    assert [bool(o.boundary) for o in outputs] == [True, True, True, False]  # (the last: the stack's output)


@pytest.mark.parametrize("segments", [0, -1, 7])
def test_checkpoint_sequential_rejects_bad_segment_counts(segments):
    model = _mlp(nd.cpu_numpy())
    x = ndl.Tensor(np.ones((2, 8), np.float32), device=nd.cpu_numpy())
    with pytest.raises(ValueError, match=r"segments must be between 1 and the number of modules \(6\), got"):
        checkpoint.checkpoint_sequential(model, segments, x)


# ----- print_saved_residuals ----------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::needle.checkpoint.NothingToDropWarning")  # one-op layers: nothing to drop
def test_print_saved_residuals_table(capsys):
    """One row per buffer of saved_residuals, parameter names, op names, shapes, bytes, reasons and the total."""
    device = nd.cpu_numpy()
    model = _mlp(device).enable_gc()
    x = ndl.Tensor(np.ones((5, 8), np.float32), device=device, requires_grad=False)
    loss = model(x).sum()
    assert checkpoint.print_saved_residuals(loss) is None
    lines = capsys.readouterr().out.splitlines()
    rows = checkpoint.saved_residuals(loss)
    assert lines[0].split() == ["name/op", "shape", "bytes", "reason"]
    assert len(lines) == len(rows) + 2  # header, one line per buffer, total
    assert re.fullmatch(r"modules\.0\.weight +\(8, 16\) +512 +leaf", lines[2])  # after the input x
    assert re.fullmatch(r"leaf +\(5, 8\) +160 +leaf", lines[1])
    # the Sequential is a stack: "all" keeps its input and output only (its last module's, a ReLU's), not the
    # outputs of the modules inside (each a one-op region)
    assert [line for line in lines if "boundary" in line] == ["ReLU              (5, 4)       80  boundary"]
    total = sum(nbytes for _, _, nbytes in rows)
    assert lines[-1] == f"total: {len(rows)} buffers, {total:,} bytes ({total / 2**20:.2f} MiB)"

    checkpoint.print_saved_residuals(loss, exclude=model.parameters() + [x])
    out = capsys.readouterr().out
    assert "weight" not in out and "leaf" not in out and "boundary" in out


# ----- enable_gc(segment_len, policy) -------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["sqrt", "selective", checkpoint.Budget(1 << 20), checkpoint.nothing_saveable],
                         ids=["sqrt", "selective", "budget", "callable"])
def test_enable_gc_rejects_segment_len_with_a_policy_that_chooses_its_own(policy):
    model = _mlp(nd.cpu_numpy())
    with pytest.raises(ValueError, match=r"segment_len=4 and policy=.* conflict"):
        model.enable_gc(segment_len=4, policy=policy)
    assert not model.gc and not model.modules[0].gc  # nothing was switched on


@pytest.mark.parametrize("kwargs", [dict(segment_len=4), dict(policy="sqrt"), dict(policy="all", segment_len=4),
                                    dict()], ids=["segment_len", "sqrt", "all+segment_len", "default"])
def test_enable_gc_still_accepts_one_choice(kwargs):
    model = _mlp(nd.cpu_numpy()).enable_gc(**kwargs)
    assert all(m.gc for m in model.modules)


@pytest.mark.filterwarnings("ignore::needle.checkpoint.NothingToDropWarning")  # one-op layers: nothing to drop
def test_enable_gc_resolves_the_policy_once_and_stores_it_once(monkeypatch):
    """enable_gc resolves its arguments to one policy callable, once, and every module holds that one field (no
    copies of segment_len/policy); forward passes annotate with it without resolving names again."""
    model = _mlp(nd.cpu_numpy()).enable_gc(segment_len=2)
    policy = model.checkpoint_policy
    assert policy == checkpoint.EverySegment(2)
    for m in [model] + model._children():
        assert m.gc and m.checkpoint_policy is policy
        assert not {"gc", "segment_len", "policy"} & set(vars(m))
    resolved = []
    real_resolve = checkpoint.resolve_policy
    monkeypatch.setattr(checkpoint, "resolve_policy", lambda *args: resolved.append(args) or real_resolve(*args))
    model(ndl.Tensor(np.ones((3, 8), np.float32), device=nd.cpu_numpy())).sum().backward()
    assert resolved and all(args[0] is policy for args in resolved)  # handed the callable, never a name
    model.disable_gc()
    assert not any(m.gc or m.checkpoint_policy is not None for m in [model] + model._children())


# ----- viz.to_dot ---------------------------------------------------------------------------------------------------
def _gc_model_loss():
    device = nd.cpu_numpy()
    model = _mlp(device).enable_gc()
    x = ndl.Tensor(np.ones((5, 8), np.float32), device=device, requires_grad=False)
    return model, model(x).sum()


@pytest.mark.filterwarnings("ignore::needle.checkpoint.NothingToDropWarning")  # one-op layers: nothing to drop
def test_to_dot_legend_parameter_names_bytes_and_module_clusters():
    """The legend shows the five styles; leaves carry parameter names; nodes their bytes; modules are clusters."""
    _, loss = _gc_model_loss()
    graph = _parse_dot(ndl.viz.to_dot(loss))
    clusters = {sub.get_name(): sub for sub in graph.get_subgraphs()}
    legend = clusters.pop("cluster_legend")
    assert sorted(n.get_name() for n in legend.get_nodes()) == ["legend_compressed", "legend_dropped", "legend_kept",
                                                                "legend_leaf", "legend_offloaded", "legend_recomputed",
                                                                "legend_updated"]
    labels = {n.get_name(): n.get("label").strip('"') for n in graph.get_nodes() if n.get("label")}
    leaves = [label.split("\\n") for label in labels.values() if label.endswith("\\nleaf")]
    assert leaves == [["modules.0.weight", "(8, 16)", "512 B", "leaf"], ["modules.0.bias", "(1, 16)", "64 B", "leaf"],
                      ["modules.2.weight", "(16, 16)", "1.0 KB", "leaf"], ["modules.2.bias", "(1, 16)", "64 B", "leaf"],
                      ["modules.4.weight", "(16, 4)", "256 B", "leaf"], ["modules.4.bias", "(1, 4)", "16 B", "leaf"]]
    assert labels["n0"] == "leaf\\n(5, 8)\\n160 B"  # the input: no name
    # three Linear, two ReLU, no Tanh region (Tanh does not annotate, so its output is the Sequential's: a stack,
    # the outermost region): one cluster each
    assert [c.get("label").strip('"') for c in clusters.values()] == ["Linear", "ReLU", "Linear", "Sequential",
                                                                       "Linear", "ReLU"]
    first_linear = [n.get_name() for n in next(iter(clusters.values())).get_nodes()]
    assert [labels[n].split("\\n")[0] for n in first_linear] == ["Linear"]  # one fused op (ops.linear)


def test_to_dot_hide_views_drops_view_nodes_and_keeps_edges_consistent():
    """hide_views=True: no Reshape/BroadcastTo/Transpose node, fewer nodes, and every edge joins shown nodes
    along a path of the real graph (a view's input is drawn straight to the view's consumers)."""
    device = nd.cpu_numpy()
    x = ndl.Tensor(np.ones((2, 3, 4), np.float32), device=device)
    w, bias = (ndl.Tensor(np.ones(shape, np.float32), device=device) for shape in ((4, 5), (1, 5)))
    loss = None
    for _ in range(3):  # three "Linear layers" written out with their views: reshape, bias broadcast, transpose
        h = ops.matmul(ops.reshape(x, (6, 4)), w) + ops.broadcast_to(bias, (6, 5))
        loss = ops.transpose(h).sum() if loss is None else loss + ops.transpose(h).sum()
    full, hidden = (_parse_dot(ndl.viz.to_dot(loss, hide_views=v)) for v in (False, True))
    node_labels = {}
    for graph in (full, hidden):
        node_labels[graph] = {n.get_name(): n.get("label").strip('"').split("\\n")[0]
                              for n in graph.get_nodes() if n.get("label")}
    view_ops = {"Reshape", "BroadcastTo", "Transpose"}
    n_views = sum(op in view_ops for op in node_labels[full].values())
    assert n_views == 9  # a reshape, a bias broadcast and a transpose per layer
    assert len(node_labels[hidden]) == len(node_labels[full]) - n_views
    assert not view_ops & set(node_labels[hidden].values())
    edges = [(e.get_source(), e.get_destination()) for e in hidden.get_edges()]
    assert all(s in node_labels[hidden] and d in node_labels[hidden] for s, d in edges)
    # each layer's bias leaf now feeds its EWiseAdd directly; edges = inputs counted through the views
    order = autograd.find_topo_sort([loss])
    expected = sum(1 if not (x.op is not None and x.op.view) else len(x.inputs)
                   for n in order if not (n.op is not None and n.op.view) for x in n.inputs)
    assert len(edges) == expected == len(full.get_edges()) - n_views
    labels = node_labels[hidden]
    assert sum(labels[s] == "leaf" and labels[d] == "EWiseAdd" for s, d in edges) == 3


def test_to_dot_styles_match_the_backward_plan_on_real_nodes():
    """The recomputed style sits on graph nodes (not just the legend), exactly those the backward plan recomputes."""
    device = nd.cpu_numpy()
    x = ndl.Tensor(np.ones((2, 2), np.float32), device=device)
    out = checkpoint.checkpoint(lambda h: ops.exp(ops.exp(h * 0.5)) + 1.0, x)
    loss = ops.exp(out).sum()
    graph = _parse_dot(ndl.viz.to_dot(loss))
    recomputed = [n.get("label").strip('"').split("\\n")[0] for n in graph.get_nodes()
                  if n.get("fillcolor") == '"#ffcc80"']
    plan = autograd.plan_backward(loss, lambda n: n.is_leaf() or not n.drop)
    assert sorted(recomputed) == sorted(type(n.op).__name__ for n in plan.recomputed()) and recomputed


# ----- enable_gc on a model with nothing to drop says so, once ---------------------------------------------------
def _course_mlp(seed=0):
    np.random.seed(seed)  # needle's init draws from NumPy's global generator
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _course_batch(seed=0):
    return ndl.Tensor(np.random.RandomState(seed).randn(4, 8).astype(np.float32))


@pytest.mark.parametrize("policy", [None, "sqrt", "selective"])
def test_enable_gc_with_nothing_to_drop_warns_once_naming_the_regions(policy):
    """A model of one one-op layer has nothing to drop: enable_gc says so, once."""
    model, x = nn.Linear(8, 16), _course_batch()
    model.enable_gc(policy=policy)
    with pytest.warns(checkpoint.NothingToDropWarning, match=r"nothing to drop.*Linear x1.*nn.Sequential") as record:
        model(x).sum().backward()
    assert len(record) == 1
    assert checkpoint.last_backward_stats()["recomputed_nodes"] == 0  # what the warning announced
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per model: the next steps say nothing
        model(x).sum().backward()


@pytest.mark.parametrize("policy", [None, "sqrt"])
def test_the_courses_mlp_is_a_stack_whose_layer_outputs_gc_drops(policy):
    """Issue 46: an nn.Sequential is a stack; the course's MLP of one-op layers (which had nothing to drop: every
    region's output is kept) drops its layers' outputs, and gives gc off's gradients, to the bit."""
    def grads(gc):
        model, x = _course_mlp(), _course_batch()
        if gc:
            model.enable_gc(policy=policy)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(x).sum().backward()
        return [p.grad.numpy() for p in model.parameters()], checkpoint.last_backward_stats()["recomputed_nodes"]
    (off, _), (on, recomputed) = grads(False), grads(True)
    assert recomputed > 0 and all(np.array_equal(a, b) for a, b in zip(off, on))


def test_enable_gc_with_regions_that_have_an_interior_does_not_warn():
    class CheckpointedMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = _course_mlp()

        def forward(self, x):
            return checkpoint.checkpoint_sequential(self.layers, 2, x)

    model = CheckpointedMLP().enable_gc()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(_course_batch()).sum().backward()
    assert checkpoint.last_backward_stats()["recomputed_nodes"] > 0


@pytest.mark.parametrize("offload_on", [False, True], ids=["recompute", "offload"])
@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "eager"])
@pytest.mark.parametrize("variant", ["input view", "output view"])
def test_the_budgets_shortcut_bound_never_exceeds_a_walk_so_it_finds_what_walks_alone_would(variant, lazy, offload_on,
                                                                                            monkeypatch):
    """Budget._search skips a walk where a lower bound on the peak exceeds the target. Views of a region's input
    or of its candidates share buffers that are alive anyway: the bound must not count them, or it would call a t
    that fits too big and drop more than needed. Checked against the walks themselves, recomputing or offloading,
    with the forward pass run lazily or eagerly."""
    from needle import checkpoint_budget
    found = []
    search = checkpoint_budget.fewest_that_fit

    def checked(peak, n, target, estimate=None):
        walk = dict(zip(peak.__code__.co_freevars, (c.cell_contents for c in peak.__closure__)))["walk"]
        park = dict(zip(peak.__code__.co_freevars, (c.cell_contents for c in peak.__closure__)))["gradients"]
        assert all(peak(t) <= walk(t, park).peak for t in range(n + 1))  # a bound, or the walk itself
        found.append((search(peak, n, target, estimate), search(lambda t: walk(t, park).peak, n, target, estimate)))
        return found[-1][0]
    monkeypatch.setattr(checkpoint_budget, "fewest_that_fit", checked)
    B, S, D = 16, 32, 64
    rs = np.random.RandomState(0)
    ws = [ndl.Tensor(rs.randn(D, D).astype(np.float32) * 0.1, requires_grad=True) for _ in range(4)]
    x0 = ndl.Tensor(rs.randn(B * S, D).astype(np.float32), requires_grad=True)
    budget = checkpoint.Budget(2 << 20, offload=offload_on)
    with ndl.autograd.lazy_mode(lazy):
        x = x0 if variant == "input view" else ops.reshape(x0, (B, S, D))
        for w in ws:
            if variant == "input view":
                nx = ops.reshape(ops.tanh(ops.tanh(ops.reshape(x, (B, S, D)) @ w)), (B * S, D)) * 1.0
            else:
                nx = ops.reshape(ops.tanh(ops.tanh(x @ w)), (B * S, D))
            checkpoint.annotate(nx, [x], policy=budget)
            x = nx if variant == "input view" else ops.reshape(nx, (B, S, D))
        (x * x).sum().backward()
    assert found and all(a == b for a, b in found)


@pytest.mark.parametrize("seed", range(20))
def test_the_budget_search_finds_the_fewest_that_fit_whatever_its_first_guess(seed):
    """checkpoint_budget.fewest_that_fit: the least t whose peak fits, as a scan would find it, for an estimate that
    is exact, off by some groups, or absent; and with an exact estimate, two walks."""
    from needle.checkpoint_budget import fewest_that_fit
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    peaks = np.concatenate([[0], np.sort(rng.integers(0, 50, n))])[::-1].cumsum()[::-1]  # falling in t
    target = int(rng.integers(peaks[-1], peaks[0] + 2))
    fewest = next(t for t in range(n + 1) if peaks[t] <= target)
    for estimate in (lambda t: peaks[t], lambda t: peaks[min(t + 3, n)], lambda t: peaks[max(t - 5, 0)], None):
        walked = []

        def peak(t):
            walked.append(t)
            return peaks[t]
        assert fewest_that_fit(peak, n, target, estimate) == fewest
        assert len(walked) <= 2 * int(np.log2(n + 1)) + 4, walked
    walked = []
    fewest_that_fit(lambda t: walked.append(t) or peaks[t], n, target, lambda t: peaks[t])
    assert len(set(walked)) <= 2


_PLAN_IN_A_FRESH_PROCESS = """
import sys, time
import numpy as np
import needle as ndl
from needle import checkpoint, nn
from models import LanguageModel

np.random.seed(0)
model = LanguageModel(16, 40, 16, num_layers=2, seq_model="transformer", seq_len=8, device=ndl.cpu_numpy(),
                      num_head=2, dim_head=8)
budget = checkpoint.Budget(int(sys.argv[1]))
model.enable_gc(policy=budget)
x = ndl.Tensor(np.random.randint(0, 40, (8, 4)).astype("float32"), device=ndl.cpu_numpy(), requires_grad=False)
y = ndl.Tensor(np.random.randint(0, 40, (32,)).astype("float32"), device=ndl.cpu_numpy(), requires_grad=False)
def no_clock(*args):
    raise AssertionError("the Budget read a clock")
time.perf_counter = time.time = time.monotonic = time.process_time = no_clock
with ndl.autograd.lazy_mode(True):
    loss, _ = model.loss(x, y)
    loss.backward()
print(sorted((repr(k), [str(f) for f in v]) for k, v in budget.planned.items()), budget.predicted_peak,
      budget.predicted_time, sorted(m for m in sys.modules if m.startswith("needle.toolbox")))
"""


def test_the_budget_plans_without_a_clock_or_a_file_the_same_plan_in_every_process(tmp_path):
    """Budget(b) ranks by fixed prices (costs.py): planning reads no clock (every clock raises in the process) and
    writes no file (HOME, an empty folder, stays empty), loads no toolbox module, and two fresh processes plan
    alike."""
    home = tmp_path / "home"
    home.mkdir()
    repo = Path(__file__).resolve().parents[2]
    env = {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "PYTHONPATH": os.pathsep.join(str(repo / d) for d in ("python", "apps"))}
    runs = [subprocess.run([sys.executable, "-c", _PLAN_IN_A_FRESH_PROCESS, str(60_000)], capture_output=True,
                           text=True, env=env, cwd=tmp_path, timeout=120) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:]
    assert runs[0].stdout == runs[1].stdout and "False" in runs[0].stdout  # the same plan, which drops something
    assert runs[0].stdout.rstrip().endswith("[]")  # no toolbox module
    assert list(home.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["home"]


@pytest.mark.parametrize("bound", [0, -1, "64MB", 2.5, True, float("nan"), float("inf")])
def test_a_budget_refuses_a_bound_that_is_not_a_positive_number_of_bytes_when_made(bound):
    """Issue 45: Budget(0) and Budget(-1) were accepted until the first backward, Budget("64MB") was a bare int()
    error: each is refused when the Budget is made, naming it."""
    with pytest.raises(ValueError, match=r"Budget: the bound must be a positive number of bytes \(e.g. Budget"):
        checkpoint.Budget(bound)
