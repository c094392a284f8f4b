"""Shared test helpers: the tiers and their devices, one gradient checker used by every test file, and gc.py's
command line as the tests run it.

The tiers (`make test` runs every one this machine can; `make test-core` the first alone):
  tests/core         the graph core (autograd, ops, nn, init, optim, data, saving, checkpointing, the architecture
                     checks) on the NumPy reference device, cpu_numpy: nothing compiled is needed;
  tests/backend      NDArray and the compiled backends against the reference, and the build;
  tests/toolbox      offloading, compression, few-bit, the cost model, the memory timeline, mixed precision, the
                     memory-efficient optimizers, distributed;
  tests/integration  gc.py and its experiment, the apps, resuming, the docs, the figures, the package, the
                     notebooks.
A compiled device's cases are collected only where it is there: `cpu` once the C++ module is built, `cuda` with a
GPU; the terminal summary says in one line which were left out.

Tests seed their own RNGs (the `rng` fixture, or np.random.seed inside the test), never at import.
"""
import contextlib
import gc as python_gc
import importlib.abc
import io
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "apps"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


class _WithoutCompiledModules(importlib.abc.MetaPathFinder):
    """NEEDLE_TESTS_WITHOUT_COMPILED=1 (`make test-core`): needle imports as if nothing were compiled, whatever is
    built here, so tests/core shows on every machine that it needs nothing compiled (in this process and in the
    pytest subprocess of np_backend_checks.py, which loads this file too)."""

    def find_spec(self, name, path=None, target=None):
        if name.startswith("needle.backend_ndarray.ndarray_backend_c"):
            raise ModuleNotFoundError(f"No module named {name!r} (NEEDLE_TESTS_WITHOUT_COMPILED)", name=name)
        return None


if os.environ.get("NEEDLE_TESTS_WITHOUT_COMPILED") == "1":
    sys.meta_path.insert(0, _WithoutCompiledModules())

import needle as ndl  # noqa: E402
from needle import autograd  # noqa: E402
from needle import backend_ndarray as nd  # noqa: E402
from needle import nn  # noqa: E402

from experiment.cli import main as run_gc  # noqa: E402,F401  (gc.py's main, in this process: run_gc(argv))

# ----- the tiers, and the devices each one runs on -----------------------------------------------------------------
TESTS = pathlib.Path(__file__).resolve().parent
TIERS = ("core", "backend", "toolbox", "integration")
GPU = nd.cuda().enabled()
CPU_BUILT = nd.cpu().enabled()

_PARAMS = {"cpu": pytest.param(nd.cpu(), id="cpu"), "cpu_numpy": pytest.param(nd.cpu_numpy(), id="cpu_numpy"),
           "cuda": pytest.param(nd.cuda(), id="cuda")}
_AVAILABLE = {"cpu": CPU_BUILT, "cpu_numpy": True, "cuda": GPU}


def device_params(*names):
    """pytest.params of the named devices that this machine has: `cpu` once the C++ module is built, `cuda` only
    with a GPU (neither is collected otherwise: pytest_terminal_summary says so in one line)."""
    return [_PARAMS[name] for name in names if _AVAILABLE[name]]


# Backend devices: the C++ CPU backend, the NumPy reference, and CUDA where a GPU is.
DEVICES = device_params("cpu", "cpu_numpy", "cuda")
# Devices that run compiled code (the ones a model is trained on): cpu and cuda.
COMPILED_DEVICES = device_params("cpu", "cuda")
# What a test that takes `device` without parametrizing it runs on, by the tier of the module that collects it: the
# NumPy reference in tests/core (nothing compiled is needed there); in tests/backend, where the test_*_compiled.py
# modules import tests of tests/core, the compiled devices, compared there with the same oracles.
TIER_DEVICES = {"core": device_params("cpu_numpy"), "backend": COMPILED_DEVICES}


def tier_of(path):
    parts = pathlib.Path(path).resolve().relative_to(TESTS).parts
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


def _parametrizes_device(marker):
    names = marker.args[0] if marker.args else marker.kwargs.get("argnames", ())
    names = names.replace(" ", "").split(",") if isinstance(names, str) else list(names)
    return "device" in names


def pytest_generate_tests(metafunc):
    """A test that takes `device` and does not parametrize it runs on its tier's devices (TIER_DEVICES), narrowed
    by its `devices` marker."""
    if "device" not in metafunc.fixturenames:
        return
    if any(_parametrizes_device(m) for m in metafunc.definition.iter_markers("parametrize")):
        return
    tier = tier_of(metafunc.definition.path)
    if tier not in TIER_DEVICES:
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: `device` is not parametrized, and only tests/core and "
                                "tests/backend choose a test's devices (conftest.TIER_DEVICES)")
    params = TIER_DEVICES[tier]
    only = metafunc.definition.get_closest_marker("devices")
    if only is not None:
        params = [p for p in params if p.id in only.args]
    metafunc.parametrize("device", params)


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector, name, obj):
    """Tests of cuda() alone (marked `gpu`) are not collected without a GPU (pytest_terminal_summary says so)."""
    if not GPU and callable(obj) and any(mark.name == "gpu" for mark in getattr(obj, "pytestmark", [])):
        return []
    return None


def pytest_terminal_summary(terminalreporter):
    """One line for each device whose cases were not collected here (rather than thousands of skips)."""
    if not GPU:
        terminalreporter.write_line("needle: the CUDA cases were not collected: no GPU here (cuda() is not enabled)")
    if os.environ.get("NEEDLE_TESTS_WITHOUT_COMPILED") == "1":
        terminalreporter.write_line("needle: run as if nothing were compiled (NEEDLE_TESTS_WITHOUT_COMPILED=1)")
    elif not CPU_BUILT:
        terminalreporter.write_line("needle: the compiled CPU cases were not collected: the C++ backend is not built "
                                    "(make lib)")


@pytest.fixture(autouse=True, scope="session")
def nominal_costs():
    """Every Budget made in a test plans with fixed rates (costs.Rates.nominal()), the calibrated ones too
    (`Budget(b, calibrate=True)`, gc.py's): what a Budget chooses is the same on every machine and every run (the
    calibration itself is tested in test_cost_model.py). The core's Budget needs no patch: it never measures."""
    from needle.toolbox import cost_model

    with pytest.MonkeyPatch.context() as patch:
        nominal = staticmethod(lambda device: cost_model.Calibration.nominal())
        patch.setattr(cost_model.CostModel, "default_rates", nominal)
        yield


@pytest.fixture(autouse=True, scope="module")
def frozen_long_lived_objects():
    """At each test file's start, collect the garbage, then gc.freeze() what is still alive (imported modules,
    PyTorch's hundreds of thousands of objects, earlier files' parameters): the garbage collector stops walking
    them, so the tests' many gc.collect() calls (each exact memory measurement starts with one) cost milliseconds,
    not a walk over the whole session's heap. Everything a test makes is collected as before."""
    python_gc.collect()
    python_gc.freeze()
    yield


@pytest.fixture(autouse=True, scope="session")
def unfrozen_while_recording():
    """ndl.memory.record() finds the buffers already alive through gc.get_objects(), which does not list frozen
    objects: recording first gives them back to the collector (gc.unfreeze), so it sees the heap as without the
    freeze; the next test file freezes again."""
    from needle.toolbox.memory.recorder import Recorder

    begin = Recorder.begin

    def unfrozen_begin(self):
        python_gc.unfreeze()
        return begin(self)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Recorder, "begin", unfrozen_begin)
        yield


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def requires_torch():
    """Import torch, or skip the test with a clear reason (PyTorch is only a test oracle)."""
    return pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")


def numerical_gradient(f, arrays, eps=1e-6):
    """Central differences of the scalar f(*arrays) (float64 arrays) with respect to each array."""
    grads = []
    for x in arrays:
        g = np.zeros_like(x)
        for i in range(x.size):
            old = x.flat[i]
            x.flat[i] = old + eps
            plus = f(*arrays)
            x.flat[i] = old - eps
            minus = f(*arrays)
            x.flat[i] = old
            g.flat[i] = (plus - minus) / (2 * eps)
        grads.append(g)
    return grads


def check_gradients(fn, *arrays, device=None, seed=0, rtol=1e-2, atol=1e-3):
    """Check needle's gradient of `fn` (Tensors -> Tensor) against central differences.

    The output is reduced with a fixed random projection (a random direction, as JAX's check_grads), so every
    output element's gradient is exercised. The numerical oracle runs needle's forward on the NumPy reference
    device in float64-perturbed inputs rounded to float32, with a step large enough for float32 round-off.
    Returns the needle output (for forward checks by the caller).
    """
    device = device or nd.cpu_numpy()
    rs = np.random.RandomState(seed)
    arrays = [np.asarray(a, dtype=np.float32) for a in arrays]
    tensors = [ndl.Tensor(a, device=device) for a in arrays]
    out = fn(*tensors)
    projection = np.asarray(rs.randn(*out.shape), dtype=np.float32)  # (randn() of shape () is a float)
    (out * ndl.Tensor(projection, device=device, requires_grad=False)).sum().backward()

    def scalar(*xs):
        ts = [ndl.Tensor(x.astype(np.float32), device=nd.cpu_numpy()) for x in xs]
        return float((fn(*ts).numpy().astype(np.float64) * projection).sum())

    numeric = numerical_gradient(scalar, [a.astype(np.float64) for a in arrays], eps=1e-2)
    for i, (t, g) in enumerate(zip(tensors, numeric)):
        assert t.grad is not None, f"input {i} got no gradient"
        np.testing.assert_allclose(t.grad.numpy(), g, rtol=rtol, atol=atol, err_msg=f"gradient of input {i}")
    return out


# ----- the op contract: a random out_grad for a node, and the probe that checks an op's `saves` ----------------
def random_out_grad(node, rng):
    """A random out_grad for `node`, as run_backward passes it (a TensorTuple of them for a tuple-valued node)."""
    def tensor(shape):
        return ndl.Tensor(np.asarray(rng.standard_normal(shape), dtype=np.float32), device=nd.cpu_numpy())

    if isinstance(node, ndl.TensorTuple):
        return ndl.make_tuple(*[tensor(shape) for shape in node.shape])
    return tensor(node.shape)


class _HiddenRead(Exception):
    """A gradient needed the data of a forward value its op does not declare in `saves`."""


class _Hidden(autograd.TensorOp):
    """The op of a stand-in for a hidden forward value: computing it is reading the hidden value."""

    def __init__(self, what):
        self.what = what

    def compute(self, *args):
        raise _HiddenRead(self.what)


def _stand_in(value, what, inputs=()):
    """A node of `value`'s type and spec (shape, dtype, device) but no data, which raises when computed."""
    node = type(value).__new__(type(value))
    node._init(_Hidden(what), inputs, requires_grad=value.requires_grad)
    node._spec = autograd.spec_of(value.realize_cached_data())
    return node


def _as_numpy(data):
    return tuple(_as_numpy(x) for x in data) if isinstance(data, tuple) else np.asarray(data.numpy())


def _gradient_values(op, out_grad, node):
    """`op`'s gradient at `node`, built lazily (as run_backward builds it), then realized: NumPy arrays."""
    with autograd.lazy_mode(True):
        grads = op.gradient_as_tuple(out_grad, node)
    return [None if g is None else _as_numpy(g.realize_cached_data()) for g in grads]


def _same(a, b):
    if a is None or b is None:
        return a is b
    if isinstance(a, tuple) or isinstance(b, tuple):
        return isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and all(map(_same, a, b))
    return a.dtype == b.dtype and np.array_equal(a, b)


def saves_violation(node, out_grad):
    """None if `node.op.gradient` reads no forward data beyond what its `saves` declares; else what went wrong.

    `saves` is what the backward plan keeps or recomputes, so a gradient reading anything else would read a released
    value (test_autograd checks every op with this, test_attention and test_linear_cross_entropy the fused ones).
    The gradient is built on a probe: a node like `node` whose undeclared inputs, and whose output unless declared,
    are stand-ins (same spec, no data, raise when computed); declared values are the real ones. Shapes stay
    readable, as autograd keeps `_spec` for released values. The probe's gradient must equal the gradient built on
    `node` itself, bit for bit.
    """
    op = node.op
    declared = {id(v) for v in autograd.reads(node)}
    stand_ins = {}
    inputs = [x if id(x) in declared else stand_ins.setdefault(id(x), _stand_in(x, f"input {i}"))
              for i, x in enumerate(node.inputs)]
    probe = _stand_in(node, "its output", inputs)
    if id(node) in declared:
        probe.cached_data = node.cached_data
    try:
        got = _gradient_values(op, out_grad, probe)
    except _HiddenRead as hidden:
        return f"{type(op).__name__} declares saves={op.saves!r}, but its gradient read {hidden}"
    expected = _gradient_values(op, out_grad, node)
    if len(got) != len(expected) or not all(map(_same, got, expected)):
        return f"{type(op).__name__}: the gradient with only its declared values differs from the full one"
    return None


def count_computes(nodes):
    """Wrap each node's op.compute with a counter; returns {id(node): calls} (filled as computes happen).

    Counting beats eyeballing: the checkpoint tests assert that no node is computed twice in one backward.
    """
    counts = {}
    for node in nodes:
        compute = node.op.compute

        def counted(*args, _node_id=id(node), _compute=compute):
            counts[_node_id] = counts.get(_node_id, 0) + 1
            return _compute(*args)

        node.op.compute = counted
    return counts


def peak_during(device, fn):
    """(the allocator's peak while fn() runs, above the bytes held when it starts; fn's result)."""
    python_gc.collect()
    nd.reset_peak_memory_stats(device)
    base = nd.memory_stats(device)["current_bytes"]
    out = fn()
    return nd.memory_stats(device)["peak_bytes"] - base, out


# ----- gc.py, the experiment: its command line as the tests run it ------------------------------------------------

GC_ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), ".."))
GC_DEVICE = "cpu" if nd.cpu().enabled() else "cpu_numpy"
# The smallest model gc.py trains: 3 steps of it take about a second.
GC_TINY = ["--batch_size", "4", "--seq_len", "5", "--embedding_size", "8", "--hidden_size", "8", "--num_layers", "1",
           "--num_head", "2", "--max_batches", "3", "--warmup", "1", "--device", GC_DEVICE]


def tiny_ptb(tmp_path, num_lines=40):
    """A PTB-shaped folder (train.txt, test.txt) of 30 words, deterministic."""
    folder = tmp_path / "ptb"
    folder.mkdir()
    words = [f"w{i}" for i in range(30)]
    rs = np.random.RandomState(0)
    lines = [" ".join(rs.choice(words, size=8)) for _ in range(num_lines)]
    (folder / "train.txt").write_text("\n".join(lines) + "\n")
    (folder / "test.txt").write_text("\n".join(lines[:5]) + "\n")
    return str(folder)


def gc_process(*argv, cwd=None, script=None, timeout=120):
    """gc.py as a user runs it: a fresh process; (exit status, stdout, stderr)."""
    proc = subprocess.run([sys.executable, script or os.path.join(GC_ROOT, "gc.py"), *map(str, argv)],
                          capture_output=True, text=True, cwd=cwd, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def gc_in_process(*argv):
    """gc.py's main in this process, as gc_process runs it in a fresh one: (exit status, stdout, stderr), the exit
    status as the interpreter would turn the SystemExit into one. For what is decided before any training (bad
    input, --help): a second of interpreter start-up each saved. An exception other than SystemExit propagates
    (in a process of its own it would be a traceback, which the tests reject). The tests of the process boundary
    itself (exit status and stderr as a shell sees them, signals, a checkout of its own) use gc_process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            run_gc([str(a) for a in argv])
            code = 0
        except SystemExit as exit_:
            code = exit_.code
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): the message on stderr, exit status 1
        err.write(f"{code}\n")
        code = 1
    return code, out.getvalue(), err.getvalue()


def strict_json(path):
    """json.load that rejects NaN / Infinity, as strict JSON parsers (JavaScript, jq, Go) do."""
    def reject(constant):
        raise ValueError(f"non-standard JSON constant {constant} in {path}")

    with open(path) as f:
        return json.load(f, parse_constant=reject)


def captured_mlp_listing():
    """The program docs/capture.md prints: a two-layer MLP's SGD step through ndl.jit.capture, as its listing."""
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = ndl.optim.SGD(model.parameters(), lr=0.1)

    @ndl.jit.capture
    def step(X, y):
        opt.reset_grad()
        loss = nn.SoftmaxLoss()(model(X), y)
        loss.backward()
        opt.step()
        return loss
    X = ndl.Tensor(np.random.randn(5, 4).astype("float32"))
    y = ndl.Tensor(np.array([0, 1, 2, 1, 0], dtype="float32"))
    for _ in range(3):
        step(X, y)
    return step.listing()
