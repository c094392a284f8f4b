"""Shared test helpers: the devices to parametrize over, and one gradient checker used by every test file.

Tests seed their own RNGs (the `rng` fixture, or np.random.seed inside the test), never at import.
"""
import contextlib
import gc as python_gc
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "apps"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import needle as ndl  # noqa: E402
from needle import autograd  # noqa: E402
from needle import backend_ndarray as nd  # noqa: E402

from experiment.cli import main as run_gc  # noqa: E402,F401  (gc.py's main, in this process: run_gc(argv))

_CUDA_SKIP = pytest.mark.skipif(not nd.cuda().enabled(), reason="no GPU: needle's cuda() backend is not enabled")
_CPU_SKIP = pytest.mark.skipif(not nd.cpu().enabled(), reason="C++ backend not built (run `make`)")

# Backend devices: the C++ CPU backend, the NumPy reference, and CUDA (skipped cleanly without a GPU).
DEVICES = [
    pytest.param(nd.cpu(), id="cpu", marks=_CPU_SKIP),
    pytest.param(nd.cpu_numpy(), id="cpu_numpy"),
    pytest.param(nd.cuda(), id="cuda", marks=_CUDA_SKIP),
]
# Devices that run compiled code (the ones a model is trained on): cpu and cuda.
COMPILED_DEVICES = [DEVICES[0], DEVICES[2]]


# ----- slow, independent work a test waits on, started as soon as collection has selected the test --------------
class EarlyJob:
    """A test's slow work that only waits on processes of its own (a compile, gc.py's children): `start(folder)`,
    with a fresh temporary folder, run by the one background thread of early jobs, in the order the tests will run,
    from the end of collection on, so that it runs beside the tests before it, on the other core. result() is
    start's return value, or the exception it raised, raised in the test; a job the thread has not reached yet is
    run by the test itself."""

    def __init__(self, start):
        self.start = start
        self.claimed = threading.Lock()  # taken by whoever runs it: the background thread or the test
        self.done = threading.Event()
        self.folder = self.value = self.error = None

    def run(self):
        if not self.claimed.acquire(blocking=False):
            return
        self.folder = tempfile.mkdtemp(prefix="needle-early-")
        try:
            self.value = self.start(self.folder)
        except BaseException as error:  # (raised again in the test, by result())
            self.error = error
        finally:
            self.done.set()

    def result(self):
        self.run()
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value


EARLY_JOBS = {}  # test node id -> EarlyJob
_EARLY_STOP = threading.Event()
_EARLY_THREAD = []


def _run_early_jobs(jobs):
    for job in jobs:
        if _EARLY_STOP.is_set():
            return
        job.run()


def pytest_configure(config):
    config.addinivalue_line("markers", "early(start=f): f(folder) runs in the background from the end of collection "
                                       "(conftest.EarlyJob); the test reads its result with the early_result fixture")


def pytest_collection_finish(session):
    """Queue the early job of every selected test marked early (after -k, -m and the like have selected them), in
    the order the tests will run, and start the thread that runs them one at a time."""
    if session.config.option.collectonly:
        return
    for item in session.items:
        marker = item.get_closest_marker("early")
        if marker is not None and item.nodeid not in EARLY_JOBS:
            EARLY_JOBS[item.nodeid] = EarlyJob(marker.kwargs["start"])
    if EARLY_JOBS:
        thread = threading.Thread(target=_run_early_jobs, args=(list(EARLY_JOBS.values()),), daemon=True)
        thread.start()
        _EARLY_THREAD.append(thread)


def pytest_sessionfinish(session):
    """No early job starts after the session (an interrupted one); the one running ends, then the folders go."""
    _EARLY_STOP.set()
    for thread in _EARLY_THREAD:
        thread.join()
    for job in EARLY_JOBS.values():
        if job.folder:
            shutil.rmtree(job.folder, ignore_errors=True)


@pytest.fixture
def early_result(request):
    """The result of the test's early job (its `early` marker's start function): run in the background since the
    end of collection, or now, here, if the background thread has not reached it."""
    job = EARLY_JOBS.get(request.node.nodeid)
    if job is None:  # (not queued at collection's end)
        job = EARLY_JOBS[request.node.nodeid] = EarlyJob(request.node.get_closest_marker("early").kwargs["start"])
    return job.result()


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


def float64_checks(module):
    """The start function of an early job (the `early` marker): run `module.float64_checks()` (a helper module of
    tests/, never a test file) under NEEDLE_BACKEND=np in a fresh interpreter (the backend is read once, at import);
    the finished process, for assert_float64_checks_passed. Float64 arrays in, float64 out, so tolerances can be
    1e-6."""
    code = ("import sys; sys.path[:0] = ['tests', 'python', 'apps']; "
            f"import {module} as t; t.float64_checks(); print('float64 checks passed')")

    def start(folder):
        return subprocess.run([sys.executable, "-c", code], cwd=os.path.join(os.path.dirname(__file__), ".."),
                              env=dict(os.environ, NEEDLE_BACKEND="np"), capture_output=True, text=True, timeout=300,
                              check=False)
    return start


def assert_float64_checks_passed(result):
    assert result.returncode == 0 and "float64 checks passed" in result.stdout, result.stdout + result.stderr[-5000:]


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
