"""Memory-efficient optimizers: Adafactor against a float64 transcription of the reference algorithm, Adam8bit
against Adam, offloaded state, and state_bytes() against the allocator."""
import json
import math

import numpy as np
import pytest

import needle as ndl
from needle import backend_ndarray as nd
from needle import nn, optim
from needle.toolbox.optim.quantization import dynamic_map

from conftest import DEVICES, GC_TINY, run_gc, tiny_ptb
from experiment.ablations import ABLATIONS

CPU = nd.cpu()
requires_cpu = pytest.mark.skipif(not CPU.enabled(), reason="C++ backend not built (run `make`)")
STEPS = 8


def _param(shape, device, seed=0):
    rs = np.random.RandomState(seed)
    return nn.Parameter(ndl.Tensor(rs.randn(*shape).astype(np.float32), device=device))


def _targets(shape, seed=1):
    return np.random.RandomState(seed).randn(*shape).astype(np.float32)


def _train(params, targets, opt, steps=STEPS):
    """Minimize sum_p sum(A_p * p) + 0.5 |p|^2 (gradient A_p + p) for `steps` steps; the parameters after each."""
    history = []
    for _ in range(steps):
        opt.reset_grad()
        loss = None
        for p, a in zip(params, targets):
            term = (p * ndl.Tensor(a, device=p.device)).sum() + (p * p).sum() * 0.5
            loss = term if loss is None else loss + term
        loss.backward()
        opt.step()
        history.append([p.numpy().copy() for p in params])
    return history


# ----- Adafactor --------------------------------------------------------------------------------------------------
def _reference_adafactor(p0, a, steps=STEPS, lr=None, beta1=None, eps=(1e-30, 1e-3), clip_threshold=1.0,
                         decay_rate=-0.8, relative_step=True, scale_parameter=True, warmup_init=False,
                         weight_decay=0.0, factored=None):
    """Shazeer & Stern's Adafactor as the common reference implementations write it, in float64."""
    p, a = p0.astype(np.float64), a.astype(np.float64)
    factored = p.ndim >= 2 if factored is None else factored
    row = col = v = m = None
    history = []
    for t in range(1, steps + 1):
        g = a + p
        rel = lr
        if relative_step:
            rel = min(1e-6 * t if warmup_init else 1e-2, 1 / math.sqrt(t))
        lr_t = rel * (max(eps[1], np.sqrt(np.mean(p * p))) if scale_parameter else 1.0)
        beta2 = 1 - t ** decay_rate
        g2 = g * g + eps[0]
        if factored:
            row = (1 - beta2) * g2.mean(-1) if row is None else beta2 * row + (1 - beta2) * g2.mean(-1)
            col = (1 - beta2) * g2.mean(-2) if col is None else beta2 * col + (1 - beta2) * g2.mean(-2)
            r = 1 / np.sqrt(row / row.mean(-1, keepdims=True))
            u = r[..., :, None] / np.sqrt(col[..., None, :]) * g
        else:
            v = (1 - beta2) * g2 if v is None else beta2 * v + (1 - beta2) * g2
            u = g / np.sqrt(v)
        u = u / max(1.0, np.sqrt(np.mean(u * u)) / clip_threshold) * lr_t
        if beta1 is not None:
            m = (1 - beta1) * u if m is None else beta1 * m + (1 - beta1) * u
            u = m
        p = p - weight_decay * lr_t * p - u
        history.append(p)
    return history


ADAFACTOR_CASES = {
    "defaults": {},
    "beta1": {"beta1": 0.9},
    "external lr": {"lr": 0.05, "relative_step": False, "scale_parameter": False},
    "warmup_init": {"warmup_init": True},
    "weight decay, clipped": {"weight_decay": 0.1, "clip_threshold": 0.5, "beta1": 0.5},
    "decay_rate -0.5, eps": {"decay_rate": -0.5, "eps": (1e-3, 1e-2)},
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(6, 5), (3, 4, 5), (7,)], ids=["matrix", "3-d", "vector"])
@pytest.mark.parametrize("case", list(ADAFACTOR_CASES))
def test_adafactor_matches_the_reference(device, shape, case):
    kw = ADAFACTOR_CASES[case]
    p = _param(shape, device)
    p0, a = p.numpy().copy(), _targets(shape)
    mine = _train([p], [a], optim.Adafactor([p], **kw))
    for step, (got, want) in enumerate(zip(mine, _reference_adafactor(p0, a, **kw)), 1):
        np.testing.assert_allclose(got[0], want, rtol=2e-5, atol=2e-6, err_msg=f"{case}, step {step}")


@pytest.mark.parametrize("device", DEVICES)
def test_adafactor_on_a_vector_is_its_unfactored_form_and_factoring_is_exact_for_rank_one(device):
    # A vector keeps the full second moment: the reference's unfactored branch.
    p = _param((9,), device)
    p0, a = p.numpy().copy(), _targets((9,))
    mine = _train([p], [a], optim.Adafactor([p], lr=0.1, relative_step=False))
    np.testing.assert_allclose(mine[-1][0], _reference_adafactor(p0, a, lr=0.1, relative_step=False,
                                                                 factored=False)[-1], rtol=2e-5, atol=2e-6)
    # With a constant rank-1 g^2 (and eps1 = 0) the row/column factorization reproduces V exactly, so the
    # factored matrix update equals the unfactored one; the gradient g = outer(x, y) stays rank-1 when the
    # parameter does not enter it: the loss is sum(A * p).
    x, y = np.linspace(0.5, 2, 4), np.linspace(1, 3, 3)
    A = np.outer(x, y).astype(np.float32)
    w = nn.Parameter(ndl.Tensor(np.zeros((4, 3), np.float32), device=device))
    opt = optim.Adafactor([w], lr=0.1, relative_step=False, scale_parameter=False, eps=(0.0, 1e-3))
    for _ in range(3):
        opt.reset_grad()
        (w * ndl.Tensor(A, device=device)).sum().backward()
        opt.step()
    full = optim.Adafactor([], lr=0.1, relative_step=False, scale_parameter=False, eps=(0.0, 1e-3))
    g = A.astype(np.float64)
    expected = np.zeros_like(g)
    v = None
    for t in range(1, 4):
        beta2 = 1 - t ** full.decay_rate
        v = (1 - beta2) * g * g if v is None else beta2 * v + (1 - beta2) * g * g
        u = g / np.sqrt(v)
        expected -= 0.1 * u / max(1.0, np.sqrt(np.mean(u * u)))
    np.testing.assert_allclose(w.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_adafactor_state_of_a_256_x_1024_weight_is_under_one_percent_of_adams():
    device = ndl.cpu_numpy()
    sizes = {}
    for make in (lambda ps: optim.Adam(ps, lr=1e-3), lambda ps: optim.Adafactor(ps)):
        w = _param((256, 1024), device)
        opt = make([w])
        _train([w], [np.zeros((256, 1024), np.float32)], opt, steps=1)
        sizes[type(opt).__name__] = opt.state_bytes()
    assert sizes["Adam"] == 2 * 256 * 1024 * 4
    assert sizes["Adafactor"] == (256 + 1024) * 4  # a row and a column statistic, no first moment
    assert sizes["Adafactor"] <= 0.01 * sizes["Adam"]


# ----- Adam8bit ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_adam8bit_is_adam_exactly_below_min_8bit_size(device):
    shapes = [(8, 16), (1, 16), (5,)]
    runs = []
    for make in (lambda ps: optim.Adam(ps, lr=0.05, weight_decay=0.01),
                 lambda ps: optim.Adam8bit(ps, lr=0.05, weight_decay=0.01)):
        params = [_param(s, device, seed=i) for i, s in enumerate(shapes)]
        opt = make(params)
        runs.append(_train(params, [_targets(s, seed=10 + i) for i, s in enumerate(shapes)], opt))
        assert not any(isinstance(s, tuple) for s in opt._stored())  # nothing quantized below 4096 elements
    for got, want in zip(*runs):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("device", DEVICES)
def test_adam8bit_follows_adam_and_stores_about_two_bytes_per_parameter(device):
    shape = (64, 128)  # 8192 elements: quantized; 32 blocks of 256
    runs, opts = [], []
    for make in (lambda ps: optim.Adam(ps, lr=0.01), lambda ps: optim.Adam8bit(ps, lr=0.01)):
        p = _param(shape, device)
        opts.append(make([p]))
        runs.append(_train([p], [_targets(shape)], opts[-1], steps=20))
    adam, adam8 = runs[0][-1][0], runs[1][-1][0]
    start = _param(shape, device).numpy()
    moved = np.abs(adam - start).mean()
    # 8-bit moments carry a relative error of a few percent on small elements of a block (the map's resolution),
    # so the trajectories part slightly: on average by a few percent of the distance travelled, not more.
    assert 0 < np.abs(adam8 - adam).mean() < 0.05 * moved, (np.abs(adam8 - adam).mean(), moved)
    n = shape[0] * shape[1]
    assert opts[1].state_bytes() == 2 * (n + 4 * (n // 256)) + 2 * 256 * 4  # two moments + the two maps
    assert (opts[1].state_bytes() - 2 * 256 * 4) / n <= 2.05
    assert opts[0].state_bytes() == 8 * n


@pytest.mark.parametrize("device", DEVICES)
def test_adam8bit_keeps_fp32_state_for_the_parameters_it_is_told(device):
    emb, w = _param((80, 64), device), _param((64, 80), device, seed=1)
    opt = optim.Adam8bit([emb, w], lr=0.01, fp32_state_params=[emb])
    _train([emb, w], [_targets((80, 64)), _targets((64, 80))], opt, steps=1)
    assert not opt.quantizes(emb) and opt.quantizes(w)
    assert isinstance(opt.m[w], tuple) and not isinstance(opt.m[emb], tuple)
    assert opt.m[emb].dtype == "float32" and opt.m[w][0].dtype == "uint8"


def test_adam8bit_moments_round_trip_within_the_maps_resolution():
    """After a step, the stored moments dequantize to the float32 ones Adam computes, within half a code gap of
    each block's absmax."""
    device = ndl.cpu_numpy()
    shape = (32, 256)
    p, q = _param(shape, device), _param(shape, device)
    adam, adam8 = optim.Adam([p], lr=0.01), optim.Adam8bit([q], lr=0.01)
    a = _targets(shape)
    _train([p], [a], adam, steps=1)
    _train([q], [a], adam8, steps=1)
    for slot, signed in (("m", True), ("v", False)):
        exact = adam.__dict__[slot][p].numpy().reshape(-1, 256)
        got = adam8._decode(q, slot, adam8.__dict__[slot][q]).numpy().reshape(-1, 256)
        if slot == "v":  # stored as sqrt(v): the bound holds for the square roots
            exact, got = np.sqrt(exact), np.sqrt(got)
        gap = np.diff(dynamic_map(signed)).max() / 2
        bound = np.abs(exact).max(axis=1, keepdims=True) * gap
        assert np.all(np.abs(got - exact) <= bound * (1 + 1e-5)), slot


@pytest.mark.parametrize("device", DEVICES)
def test_adam8bit_steps_stay_adam_sized_for_elements_far_below_their_blocks_largest(device):
    """A block whose gradients span many decades (an output layer: frequent and rare words): Adam's step is at
    most about lr per element, and so must Adam8bit's be, also after the gradient of the small elements stops."""
    g = np.full((4096,), 1e-5, np.float32)
    g[::256] = 1.0  # one large gradient per block
    p = nn.Parameter(ndl.Tensor(np.zeros(4096, np.float32), device=device))
    opt = optim.Adam8bit([p], lr=1e-3)
    for step in range(20):
        before = p.numpy().copy()
        p.grad = ndl.Tensor(g if step < 10 else np.where(g == 1.0, g, 0).astype(np.float32), device=device)
        opt.step()
        assert np.abs(p.numpy() - before).max() <= 3e-3, (step, np.abs(p.numpy() - before).max())


@pytest.mark.parametrize("kwargs, message", [
    ({"lr": -1.0}, "lr"), ({"lr": 0.1, "block_size": 100}, "block_size"), ({"lr": 0.1, "block_size": 0}, "block_size"),
    ({"lr": 0.1, "beta1": 1.0}, "beta1"), ({"lr": 0.1, "beta2": -0.1}, "beta2"), ({"lr": 0.1, "eps": -1}, "eps"),
    ({"lr": 0.1, "min_8bit_size": -5}, "min_8bit_size"),
])
def test_adam8bit_refuses_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        optim.Adam8bit([_param((2, 2), ndl.cpu_numpy())], **kwargs)


@pytest.mark.parametrize("make, message", [
    (lambda ps: optim.Adafactor(ps, lr=0.1), "relative_step"),
    (lambda ps: optim.Adafactor(ps, relative_step=False), "lr"),
    (lambda ps: optim.Adafactor(ps, lr=0.1, relative_step=False, warmup_init=True), "warmup_init"),
    (lambda ps: optim.Adafactor(ps, beta1=1.5), "beta1"),
    (lambda ps: optim.Adafactor(ps, decay_rate=0.5), "decay_rate"),
    (lambda ps: optim.Adafactor(ps, eps=(1e-30,)), "eps"),
    (lambda ps: optim.Adam(ps, lr=-0.1), "lr"),
    (lambda ps: optim.SGD(ps, momentum=1.5), "momentum"),
    (lambda ps: optim.Adam8bit(ps, lr=0.1, fp32_state_params=[_param((2, 2), ndl.cpu_numpy())]),
     "fp32_state_params"),
])
def test_optimizers_refuse_bad_arguments(make, message):
    with pytest.raises(ValueError, match=message):
        make([_param((2, 2), ndl.cpu_numpy())])


# ----- offload and state_bytes, for every optimizer -------------------------------------------------------------
OPTIMIZERS = {
    "sgd": lambda ps, **kw: optim.SGD(ps, lr=0.05, momentum=0.9, **kw),
    "adam": lambda ps, **kw: optim.Adam(ps, lr=0.01, **kw),
    "adam8bit": lambda ps, **kw: optim.Adam8bit(ps, lr=0.01, **kw),
    "adafactor": lambda ps, **kw: optim.Adafactor(ps, beta1=0.9, **kw),
}
SHAPES = [(64, 96), (1, 96), (96,)]  # 6144 elements: quantized by Adam8bit


def _params(device, dtype="float32"):
    return [nn.Parameter(_param(s, device, seed=i).astype(dtype)) for i, s in enumerate(SHAPES)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_offloaded_state_gives_the_same_update(device, name):
    runs = []
    for offload in (False, True):
        params = _params(device)
        opt = OPTIMIZERS[name](params, offload_state=offload)
        runs.append(_train(params, [_targets(s, seed=7) for s in SHAPES], opt, steps=3))
        if offload:
            assert opt.state_bytes() == 0 and opt.host_state_bytes() > 0
            assert all(isinstance(a, np.ndarray) for s in opt._stored() for a in (s if isinstance(s, tuple) else [s]))
    for got, want in zip(*runs):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def _grads(params):
    for p in params:
        p.grad = None
    loss = None
    for p, s in zip(params, SHAPES):
        term = (p * ndl.Tensor(_targets(s), device=p.device)).sum() + (p * p).sum()
        loss = term if loss is None else loss + term
    loss.backward()
    for p in params:
        p.grad = p.grad.detach()  # only the gradient arrays stay alive, not the graph
        p.grad.realize_cached_data()


@requires_cpu
@pytest.mark.parametrize("offload", [False, True], ids=["on device", "offloaded"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_bytes_is_what_the_allocator_holds(name, offload):
    """A step replaces each parameter by a new array of the same size and frees every temporary, so the
    allocator's bytes grow by exactly the new state: state_bytes() (0 when offloaded)."""
    params = _params(CPU)
    opt = OPTIMIZERS[name](params, offload_state=offload)
    for _ in range(2):
        _grads(params)
        before = nd.memory_stats(CPU)["current_bytes"]
        held = opt.state_bytes()
        opt.step()
        assert nd.memory_stats(CPU)["current_bytes"] - before == opt.state_bytes() - held
    assert (opt.state_bytes() == 0) == offload
    assert opt.state_bytes() + opt.host_state_bytes() > 0


@requires_cpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_state_is_allocated_when_the_optimizer_is_built(name, dtype):
    """Rule: an optimizer allocates its state (and master copies) when built, so no step allocates anything that
    stays and the first step's peak is no higher than the next ones' (it may be lower: a first update has no old
    state to widen); a parameter that takes no gradient gets no state."""
    params = _params(CPU, dtype)
    frozen = nn.Parameter(_param((64, 64), CPU, seed=9))
    frozen.requires_grad = False
    before = nd.memory_stats(CPU)["current_bytes"]
    opt = OPTIMIZERS[name](params + [frozen])
    assert opt.state_bytes() > 0 and nd.memory_stats(CPU)["current_bytes"] - before == opt.state_bytes()
    assert opt.state_dict()["state"] == {}  # allocated, not yet written: nothing to save
    assert all(p is not frozen for slot in ("master",) + opt.slots for p in getattr(opt, slot))
    held, peaks = opt.state_bytes(), []
    for _ in range(3):
        _grads(params)
        nd.reset_peak_memory_stats(CPU)
        before = nd.memory_stats(CPU)["current_bytes"]
        opt.step()
        peaks.append(nd.memory_stats(CPU)["peak_bytes"] - before)
        assert nd.memory_stats(CPU)["current_bytes"] == before and opt.state_bytes() == held
    assert peaks[0] <= peaks[1] == peaks[2], peaks


@requires_cpu
def test_master_weights_are_offloaded_too():
    params = _params(CPU, "bfloat16")
    opt = optim.Adam(params, lr=0.01, offload_state=True)
    _grads(params)
    before = nd.memory_stats(CPU)["current_bytes"]
    opt.step()
    assert nd.memory_stats(CPU)["current_bytes"] == before  # bf16 parameters replaced in place, state on the host
    assert opt.host_state_bytes() == sum(3 * 4 * p.realize_cached_data().size for p in params)  # master, m, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "uint8"])
def test_host_copies_for_offload_round_trip(device, dtype):
    """to_host / from_host_async / wait_for_copies: the bytes come back in their dtype; on a device with
    asynchronous copies (cuda) the host buffer is page-locked and reused for the next copy of the same shape."""
    rng = np.random.default_rng(0)
    values = rng.integers(0, 256, (5, 7)) if dtype == "uint8" else rng.standard_normal((5, 7))
    values = values.astype(nd.DTYPES[dtype])
    a = nd.array(values, device=device, dtype=dtype)
    host = nd.to_host(a)
    nd.wait_for_copies(device)
    assert isinstance(host, np.ndarray) and host.dtype == nd.DTYPES[dtype] and host.shape == (5, 7)
    np.testing.assert_array_equal(host.view(np.uint8), values.view(np.uint8))
    again = nd.to_host(nd.array(values[::-1].copy(), device=device, dtype=dtype), host)
    nd.wait_for_copies(device)
    assert (again is host) == hasattr(device.mod, "copy_to_host_async")
    np.testing.assert_array_equal(again.view(np.uint8), values[::-1].view(np.uint8))
    back, ready = nd.from_host_async(again, device)
    ready()
    assert back.dtype == dtype and back.shape == (5, 7) and back.device == device
    np.testing.assert_array_equal(back.numpy().view(np.uint8), values[::-1].view(np.uint8))


@requires_cpu
@pytest.mark.parametrize("name", ["adam", "adam8bit"])
def test_offload_brings_the_next_parameters_state_in_before_this_update(name, monkeypatch):
    """The copy schedule that lets a device with asynchronous copies (cuda) overlap them with the updates: the
    state of parameter k+1 is requested before parameter k's update runs, each copy is made ready just before its
    first use, and the step waits for the host copies before it returns. Recorded here on the cpu, whose copies
    are synchronous but follow the same schedule."""
    from needle.optim import optimizer as base

    params = _params(CPU)
    opt = OPTIMIZERS[name](params, offload_state=True)
    _grads(params)
    opt.step()  # the first step makes the state
    events = []
    api = base.array_api  # NDArray's functions, or the NumPy face's under NEEDLE_BACKEND=np
    real_from, real_to, real_wait = api.from_host_async, api.to_host, api.wait_for_copies
    owner = {}  # host array -> the index of its parameter
    for k, p in enumerate(params):
        for slot in opt.slots:
            stored = getattr(opt, slot)[p]
            owner.update({id(a): k for a in (stored if isinstance(stored, tuple) else [stored])})

    def from_host_async(host, device):
        array, ready = real_from(host, device)
        k = owner.get(id(host))
        events.append(("bring", k))
        return array, lambda: (events.append(("ready", k)), ready())

    def to_host(a, out=None):
        events.append(("store", owner.get(id(out))))
        return real_to(a, out)

    monkeypatch.setattr(api, "from_host_async", from_host_async)
    monkeypatch.setattr(api, "to_host", to_host)
    monkeypatch.setattr(api, "wait_for_copies", lambda device: (events.append(("wait", None)), real_wait(device)))
    _grads(params)
    opt.step()
    brings = [k for e, k in events if e == "bring"]
    assert brings == sorted(brings) and set(brings) == {0, 1, 2}  # each parameter's slots, in order
    for k in range(len(params) - 1):  # k+1's state is requested before k's state is first used (ready) ...
        assert events.index(("bring", k + 1)) < events.index(("ready", k))
        assert events.index(("bring", k + 1)) < events.index(("store", k))  # ... and before k's update is stored
    assert events[-1] == ("wait", None) and ("wait", None) not in events[:-1]
    assert sum(e == "ready" for e, _ in events) == sum(e == "bring" for e, _ in events)  # every copy used


# ----- gc.py -----------------------------------------------------------------------------------------------------
def test_gc_script_trains_with_each_optimizer_and_reports_their_bytes(tmp_path):
    data = tiny_ptb(tmp_path)
    records = {}
    for opt_name, extra in (("adam", []), ("adam8bit", []), ("adafactor", []), ("sgd", []),
                            ("adam", ["--offload-state"])):
        path = tmp_path / f"{opt_name}{len(extra)}.json"
        run_gc(GC_TINY + ["--data", data, "--policy", "off", "--optimizer", opt_name, "--json", str(path),
                          "--embedding-size", "64", "--hidden-size", "64", *extra])
        with open(path) as f:
            records[opt_name + "".join(extra)] = r = json.load(f)
        assert r["optimizer"] == opt_name and r["offload_state"] == bool(extra)
        assert np.isfinite(r["loss"])
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "offloaded_bytes"):
            assert r["steps"][-1][key] >= 0, key
    step = {k: r["steps"][-1] for k, r in records.items()}
    assert step["adam"]["optimizer_bytes"] == 2 * step["adam"]["param_bytes"]
    assert step["adam"]["grad_bytes"] == step["adam"]["param_bytes"]
    assert step["adam8bit"]["optimizer_bytes"] < step["adam"]["optimizer_bytes"]
    assert step["adafactor"]["optimizer_bytes"] < 0.5 * step["adam"]["optimizer_bytes"]
    assert step["adam--offload-state"]["optimizer_bytes"] == 0
    assert step["adam--offload-state"]["offloaded_bytes"] == step["adam"]["optimizer_bytes"]
    assert step["adam--offload-state"]["loss"] == step["adam"]["loss"]


def test_the_readme_table_rows_exist_in_gc_ablate():
    for row in ("adam8bit", "adafactor", "offload", "toolbox", "mixed-bf16", "mixed-fp16", "bf16"):
        assert row in ABLATIONS, row
    assert ABLATIONS["toolbox"][1]["optimizer"] == "adam8bit"


# ----- an update works in place (issue 47) ---------------------------------------------------------------------------
INPLACE_SHAPE = (1100, 256)  # 1.1 MB in float32: a whole-parameter temporary would break the 1 MB bound
INPLACE_OPTIMIZERS = {
    "sgd": lambda ps, **kw: optim.SGD(ps, lr=0.05, **kw),
    "sgd-momentum": lambda ps, **kw: optim.SGD(ps, lr=0.05, momentum=0.9, **kw),
    "adam": lambda ps, **kw: optim.Adam(ps, lr=0.01, **kw),
    "adam8bit": lambda ps, **kw: optim.Adam8bit(ps, lr=0.01, **kw),
    "adafactor": lambda ps, **kw: optim.Adafactor(ps, **kw),
    "adafactor-beta1": lambda ps, **kw: optim.Adafactor(ps, beta1=0.9, **kw),
}
PRECISIONS = {"fp32": ("float32", {}), "bf16-master": ("bfloat16", {}),
              "bf16-pure": ("bfloat16", {"master_weights": False}),
              "bf16-stochastic": ("bfloat16", {"stochastic_rounding": True})}


def _run_inplace(name, precision, weight_decay, offload, steps=3, shape=INPLACE_SHAPE):
    """(the parameter as float32 after each step, the workspace of the last step): the allocator's peak during
    step() less what was live before it, less the state an offloaded optimizer brings to the device for it."""
    dtype, kw = PRECISIONS[precision]
    rs = np.random.RandomState(0)
    p = nn.Parameter(ndl.Tensor(rs.randn(*shape).astype(np.float32), device=CPU).astype(dtype))
    opt = INPLACE_OPTIMIZERS[name]([p], weight_decay=weight_decay, offload_state=offload, **kw)
    history, workspace = [], None
    for g in _inplace_grads(shape, steps):
        p.grad = ndl.Tensor(g, device=CPU).astype(dtype)
        p.grad.realize_cached_data()
        before = nd.memory_stats(CPU)["current_bytes"]
        nd.reset_peak_memory_stats(CPU)
        opt.step()
        workspace = nd.memory_stats(CPU)["peak_bytes"] - before - opt.host_state_bytes()
        history.append(p.numpy().astype(np.float32))
    return history, workspace


def _inplace_grads(shape, steps):
    rs = np.random.RandomState(1)
    return [(rs.randn(*shape) * 0.1).astype(np.float32) for _ in range(steps)]


def _reference_inplace(name, precision, weight_decay, steps=3, shape=INPLACE_SHAPE):
    """SGD and Adam in NumPy float32, one rounding per operation as every backend computes them (the whole-array
    arithmetic the optimizers had before they worked in place): the parameter after each step."""
    import ml_dtypes
    from needle.backend_ndarray import ndarray_backend_numpy as ref
    f, bf16 = np.float32, ml_dtypes.bfloat16
    low = precision != "fp32"
    param = np.random.RandomState(0).randn(*shape).astype(np.float32)
    param = param.astype(bf16).astype(f) if low else param
    master, state, history = param, {}, []
    for t, g in enumerate(_inplace_grads(shape, steps), 1):
        g = g.astype(bf16).astype(f) if low else g
        theta = master if precision in ("fp32", "bf16-master") else param
        if weight_decay:
            g = g + theta * f(weight_decay)
        if name == "adam":
            new, state["m"], state["v"] = ref.adam_update(theta, g, state.get("m"), state.get("v"), 0.01, 0.9, 0.999,
                                                          1e-8, 1 - 0.9**t, 1 - 0.999**t)
        else:
            u = g
            if name == "sgd-momentum":
                u = state["u"] = g * f(1 - 0.9) if t == 1 else state["u"] * f(0.9) + g * f(1 - 0.9)
            new = theta - u * f(0.05)
        if precision in ("bf16-pure", "bf16-stochastic"):  # 16-bit state: stored rounded
            state = {k: s.astype(bf16).astype(f) for k, s in state.items()}
        master = new
        if precision == "bf16-stochastic":
            param = ref.stochastic_bfloat16(new, t).astype(f).reshape(shape)  # seed: step base + position + 1
        else:
            param = new.astype(bf16).astype(f) if low else new
        history.append(param)
    return history


@requires_cpu
@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "offloaded"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01], ids=["no-decay", "decay"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("name", list(INPLACE_OPTIMIZERS))
def test_an_update_needs_at_most_1_mb_beyond_the_parameter_and_its_state(name, precision, weight_decay, offload):
    """Issue 47: every optimizer updates in place (a chunk at a time, or in one fused pass), so a step's workspace
    is at most 1 MB whatever the parameter's size; SGD and Adam give the bytes of the whole-array arithmetic."""
    history, workspace = _run_inplace(name, precision, weight_decay, offload)
    assert workspace <= 2**20, f"{name} ({precision}): {workspace / 2**20:.2f} MiB of workspace"
    if name in ("sgd", "sgd-momentum", "adam"):
        for got, want in zip(history, _reference_inplace(name, precision, weight_decay)):
            np.testing.assert_array_equal(got, want)


@requires_cpu
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("name", ["adam8bit", "adafactor-beta1"])
def test_updates_in_chunks_give_the_one_chunk_numbers(name, precision, monkeypatch):
    """Chunks change nothing element-wise (Adam8bit's chunks are whole blocks: the same bytes); Adafactor's sums over
    chunks (RMS, column sums) are added in another order, so only its last bits may move."""
    from needle.optim import optimizer
    from needle.toolbox.optim import adafactor
    chunked, _ = _run_inplace(name, precision, 0.01, False)
    for module in (optimizer, adafactor):
        monkeypatch.setattr(module, "CHUNK", 1 << 30)
    whole, _ = _run_inplace(name, precision, 0.01, False)
    for got, want in zip(chunked, whole):
        if name == "adam8bit":
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5 if precision == "fp32" else 1e-2, atol=1e-6)


@requires_cpu
def test_an_in_place_update_counts_one_write_and_leaves_the_array_in_place():
    """Rule 4c: the parameter's array is written in place, and its version counts the write once per step."""
    p = _param((64, 96), CPU)
    data = p.realize_cached_data()
    opt = optim.SGD([p], lr=0.1)
    for step in range(2):
        p.grad = ndl.Tensor(_targets((64, 96)), device=CPU)
        opt.step()
        assert p.realize_cached_data() is data and p.version == step + 1
