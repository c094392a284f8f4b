"""What a value costs in seconds on this machine, measured: the core's roofline (needle/costs.py) with real rates.

The core prices each op by its work (`costs.op_work`: FLOPs or bytes) at fixed, nominal rates. A short benchmark
(`Calibration.measure`) times the real ops of each kind at a few sizes on the device, through the very machine that
recomputes values (`backward.Compute`), and turns them into one rate per kind (flop/s or bytes/s) plus a fixed
per-op overhead (Python dispatch), the same for each kind's gradient, times Adam's update per parameter byte and
host copies each way. Ops inside a real step run slower than alone (the step's bookkeeping, allocations, colder
caches): two factors, one for the fixed costs and one for the work, are fitted to two reference steps built from
ops. Last, how much of a host copy hides under the compute beside it: a reference forward pass timed alone and
parking copies as offloading does. It is measured once per machine and cached as JSON
(`Calibration.load_or_measure`); planning reads the cache, never a stopwatch. `CostModel` answers the planner's
questions from it:

    model = CostModel(host_bandwidth=16e9)                       # plan as if copies ran over PCIe 4
    model.step_seconds(loss)                                     # a step: every op and its gradient, the update
    model.recompute_seconds(path)                                # the ops on a recompute path, summed
    model.copy_seconds(nbytes, "to_host"), model.copy_seconds(nbytes, "to_device")
    model.hidden_seconds(copy, compute_around)                   # how much of that copy hides under compute

The model is a roofline with one rate per kind, so what it knows is coarse: a kind's rate is its rate at the
benchmark's sizes (a small matmul runs below it, a strided input's copy is in its op's time only where the
benchmark had one too), and a view that must copy (a reshape of a transposed value) is priced as a view, its
copy small beside the matmuls around it. What it gets right is which values are cheap or dear to recompute, and
by how much; benchmarks/bench_cost_model.py puts its predictions beside measured times, kind by kind. Only an
explicit opt-in uses it (`Budget(b, calibrate=True)`, gc.py's budgets): measuring writes a file in `cache_dir()`.
"""
import dataclasses
import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy

from .. import autograd, costs, ops
from ..autograd import Tensor, element_shapes
from ..backend_selection import BACKEND, array_api, default_device
from ..backward import Compute
from ..costs import (DIRECTIONS, FLOP_KINDS, KIND_OF_OP, KINDS, MEASURED_KINDS, Rates, op_work,  # noqa: F401
                     work_of)
from ..version import package_version

__all__ = ["DIRECTIONS", "FLOP_KINDS", "KINDS", "MEASURED_KINDS", "Calibration", "CostModel", "cache_dir", "cpu_model",
           "device_copies_overlap", "machine_key", "op_work"]


# ----- the machine: where the calibration is cached -------------------------------------------------------------
def cpu_model():
    """The CPU's model name (/proc/cpuinfo), or what the platform says where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# What the calibration measures and how: raise it when that changes, so caches written before are measured again.
# 2: host copies timed on offloading's own path (a reused host buffer), at activations' sizes.
# 3: the wide reference step 8 layers deep (its activations outgrow the L3 cache, as a real model's do); how much of
#    a copy hides under compute measured (copy_overlap).
METHOD = 3


def machine_key(device=None, quick=False):
    """What a calibration is valid for: the CPU model, its cores, OpenMP's threads, the device, the array library,
    needle's version and the measurement's METHOD. A calibration is reused only where all of them match."""
    device = device or default_device()
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "omp_threads": os.environ.get("OMP_NUM_THREADS", ""),
            "device": device.name, "backend": BACKEND, "needle": package_version(), "quick": bool(quick),
            "method": METHOD}


def cache_dir():
    """Where calibrations are cached: $NEEDLE_CACHE_DIR, else $XDG_CACHE_HOME/needle, else ~/.cache/needle."""
    if os.environ.get("NEEDLE_CACHE_DIR"):
        return Path(os.environ["NEEDLE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "needle"


def _cache_path(key):
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"calibration-{digest}.json"


def device_copies_overlap(device=None):
    """Whether offloading's copies on `device` run beside its compute: a copy stream (CUDA), or a copy thread
    (cpu(): backend_ndarray/copy_thread.py). Not on cpu_numpy or the NumPy backend, whose copies are synchronous."""
    device = device or default_device()
    return array_api.copies_async(device) or array_api.copy_thread(device) is not None




# ----- the calibration: one short benchmark per machine ---------------------------------------------------------
def _leaf(device, *shape, high=None):
    rng = numpy.random.default_rng(0)  # its own stream: calibrating leaves the global RNG alone
    data = rng.integers(0, high, shape) if high else rng.random(shape, dtype=numpy.float32) - 0.5
    return Tensor(data.astype(numpy.float32), device=device, requires_grad=False)


def _heads(x):
    with autograd.lazy_mode(False):
        return ops.transpose(x, (1, 2))  # computed now (a view: no copy), so the timed op reads it strided


def _sample_node(kind, n, device):
    """One lazy graph node of `kind` at size `n` (its inputs are leaves with values): what the benchmark times."""
    with autograd.lazy_mode(True):
        if kind == "matmul":
            return ops.matmul(_leaf(device, n, n), _leaf(device, n, n))
        if kind == "linear_cross_entropy":  # n tokens against a vocabulary of 8192, width 256: chunks of 128 tokens
            return ops.linear_cross_entropy(_leaf(device, n, 256), _leaf(device, 256, 8192), _leaf(device, 8192),
                                            _leaf(device, n, high=8192))
        if kind == "attention":  # n = (B, T), 4 heads of 64, read as a Transformer reads them: each head a
            # strided view of a projection's output (B, T, H, D); timed: the op itself, not its output [0]
            q, k, v = (_heads(_leaf(device, n[0], n[1], 4, 64)) for _ in range(3))
            return ops.scaled_dot_product_attention(q, k, v, causal=True).inputs[0]
        if kind == "view":
            return ops.transpose(_leaf(device, n, 4))
        if kind == "conv":
            return ops.conv(_leaf(device, 2, n, n, 16), _leaf(device, 3, 3, 16, 16), padding=1)
        if kind == "layernorm":
            return ops.layer_norm(_leaf(device, n, 256), _leaf(device, 256), _leaf(device, 256))
        if kind == "softmax":
            return ops.logsoftmax(_leaf(device, n, 512))
        if kind == "logsumexp":
            return ops.logsumexp(_leaf(device, n, 512), axes=(1,))
        if kind == "cross_entropy":
            return ops.softmax_cross_entropy(_leaf(device, n, 512), _leaf(device, n, high=512))
        if kind == "elementwise":
            return ops.multiply(_leaf(device, n, 1024), _leaf(device, n, 1024))  # its gradient does work, as most do
        if kind == "reduction":
            return ops.summation(_leaf(device, n, 1024), axes=(1,))
        if kind == "copy":
            return ops.flip(_leaf(device, n, 1024), (0,))
        if kind == "cast":
            return ops.cast(_leaf(device, n, 1024), "bfloat16")
    raise ValueError(f"Calibration: no benchmark for kind {kind!r}")


# Sizes per kind (n of _sample_node): a few milliseconds each at the larger one (the fused head's: tens), so the
# whole calibration, gradients and reference steps included, takes a few seconds; quick: tiny ones, for tests
# (their rates are positive, not meaningful).
SIZES = {"matmul": (256, 512), "linear_cross_entropy": (256, 1024), "attention": ((16, 32), (4, 128)),
         "conv": (16, 32), "layernorm": (256, 1024), "softmax": (256, 1024), "logsumexp": (256, 1024),
         "cross_entropy": (256, 1024), "elementwise": (256, 1024), "reduction": (256, 1024), "copy": (256, 1024),
         "cast": (256, 1024)}
QUICK_SIZES = {"matmul": (8,), "linear_cross_entropy": (4,), "attention": ((1, 4),), "conv": (4,)}
# The per-op overhead: the median time of these kinds' ops at size 1 (their work is next to nothing).
OVERHEAD_KINDS = ("elementwise", "view", "reduction", "layernorm", "matmul")
COPY_BYTES, QUICK_COPY_BYTES = (1 << 20, 4 << 20, 16 << 20), (1 << 20,)  # activations' sizes


def _median_seconds(run, repeats):
    run()  # warm-up: first-touch page faults, the allocator's cache
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _compute_seconds(node, machine, repeats):
    """Seconds `machine.compute(node)` takes (the recompute path's own call), the value released after each."""
    def run():
        machine.compute(node)
        autograd.release(node)
    return _median_seconds(run, repeats)


def _gradient_seconds(node, machine, repeats):
    """Seconds to differentiate `node` as backward does: its op's gradient graph built lazily and realized, every
    input's gradient at once (its forward value computed beforehand, not timed)."""
    machine.compute(node)
    shapes = element_shapes(node.shape)
    out_grad = (ops.make_tuple(*[_leaf(node.device, *s) for s in shapes]) if shapes
                else _leaf(node.device, *node.shape))
    existing = {id(node), id(out_grad), *map(id, node.inputs), *map(id, out_grad.inputs)}

    def run():  # what the gradient made is released; what existed before (a gradient may be one of them) is not
        with autograd.lazy_mode(True):
            grads = [g for g in node.op.gradient_as_tuple(out_grad, node) if isinstance(g, Tensor)]
        autograd.realize(grads, lambda n: n.is_leaf() or id(n) in existing, machine)
    seconds = _median_seconds(run, repeats)
    autograd.release(node)
    return seconds


def _measure_rates(device, quick, repeats, timer=_compute_seconds):
    """({kind: flop/s or bytes/s}, per-op overhead in seconds) from timing each kind's op at its sizes with
    `timer` (its forward computation, or its gradient's: the work is the forward op's either way)."""
    machine = Compute()
    overhead = statistics.median(timer(_sample_node(kind, 1, device), machine, repeats) for kind in OVERHEAD_KINDS)
    rates = {}
    for kind in MEASURED_KINDS:
        work = seconds = 0.0
        for n in (QUICK_SIZES.get(kind, (4,)) if quick else SIZES[kind]):
            node = _sample_node(kind, n, device)
            work += work_of(*op_work(node))
            seconds += max(timer(node, machine, repeats) - overhead, 1e-9)
        rates[kind] = work / seconds  # total work over total time: the larger size weighs most
    return rates, overhead


def _adam_updates(params, state):
    """Adam's update of each parameter (leaves with a .grad), as optim.Adam runs it: one `adam_step` each, its
    moments kept in `state`."""
    for p in params:
        m, v = state.get(id(p), (None, None))
        theta, m, v = array_api.adam_step(p.realize_cached_data(), p.grad.realize_cached_data(), m, v, 1e-3, 0.9,
                                          0.999, 1e-8, 0.1, 0.001)
        p.cached_data, state[id(p)] = theta, (m, v)


def _param(device, *shape):
    """A parameter of small values (as a trained model's): large ones make the logits' softmax underflow into
    denormal numbers, which this CPU computes many times slower, and would time that instead of the step."""
    rng = numpy.random.default_rng(0)
    return Tensor((rng.random(shape, dtype=numpy.float32) - 0.5) * 0.05, device=device, requires_grad=True)


def _measure_update(device, quick, repeats):
    """(parameter bytes/s, seconds per parameter) of an optimizer's update, Adam's (the optimizer gc.py and the
    course default to): over many tiny parameters for its fixed cost per parameter, over two large ones for its
    rate."""
    def step_seconds(count, n):
        params, state = [_param(device, n) for _ in range(count)], {}
        for p in params:
            p.grad = _leaf(device, n)
        return _median_seconds(lambda: _adam_updates(params, state), repeats)
    count = 16
    overhead = step_seconds(count, 1) / count
    n = 1 << (10 if quick else 20)
    seconds = max(step_seconds(2, n) - 2 * overhead, 1e-9)
    return 2 * n * 4 / seconds, overhead


# (width, vocabulary, seq, batch, layers). The wide one is 8 layers deep so that its activations (~120 MB) outgrow
# the L3 cache, as a real model's do: 2 layers deep (~30 MB, in cache) it fitted a work factor ~13% low, and priced
# gc.py's 16-layer model's step that much too fast (benchmarks/bench_cost_model.py times that model).
REFERENCES = ((16, 64, 8, 4, 1), (256, 8192, 32, 32, 8))
QUICK_REFERENCES = ((8, 16, 2, 2, 1), (16, 32, 4, 2, 1))
STEP_ROUNDS = 7  # the reference steps' timed rounds: the factors scale every prediction, so they get the most


def _reference_layer(x, w, b, t, width):
    """A pre-norm Transformer layer from ops (4 heads, causal attention, a ReLU MLP) on x (b t, width)."""
    (g1, c1, wq, wk, wv, wo, bo, g2, c2, w1, b1, w2, b2), heads = w, 4

    def heads_of(z):  # (b t, width) -> (b, heads, t, width / heads)
        return ops.transpose(ops.reshape(z, (b, t, heads, width // heads)), (1, 2))
    h = ops.layer_norm(x, g1, c1)
    a = ops.scaled_dot_product_attention(*(heads_of(ops.linear(h, w_)) for w_ in (wq, wk, wv)), causal=True)
    x = x + ops.linear(ops.reshape(ops.transpose(a, (1, 2)), (b * t, width)), wo, bo)
    return x + ops.linear(ops.relu(ops.linear(ops.layer_norm(x, g2, c2), w1, b1)), w2, b2)


def _reference_step(device, width, vocab, t, b, layers):
    """A Transformer LM's training step built from ops, for `_measure_step_factors`: (trace, run). trace() builds
    its loss lazily (embedding, `layers` layers, the LM head fused with the loss, as gc.py runs it); run(loss)
    computes forward and backward and Adam's update."""
    shapes = [(width,), (width,)] + [(width, width)] * 4 + [(width,)] * 3 + [(width, width), (width,)] * 2
    table, head, bias = _param(device, vocab, width), _param(device, width, vocab), _param(device, vocab)
    weights = [[_param(device, *shape) for shape in shapes] for _ in range(layers)]
    params, state = [table, head, bias] + [p for w in weights for p in w], {}
    x, y = _leaf(device, b * t, high=vocab), _leaf(device, b * t, high=vocab)

    def trace():
        with autograd.lazy_mode(True):
            h = ops.gather_rows(table, x)
            for w in weights:
                h = _reference_layer(h, w, b, t, width)
            return ops.linear_cross_entropy(h, head, bias, y)

    def run(loss):
        loss.backward()
        _adam_updates(params, state)
    return trace, run


def _reference_parts(calibration, trace):
    """[overhead part, work part] of a reference step as `calibration` predicts them."""
    loss = trace()
    return [CostModel(loss.device, calibration=dataclasses.replace(calibration, overhead_factor=o, work_factor=w))
            .step_seconds(loss) for o, w in ((1.0, 0.0), (0.0, 1.0))]


def _reference_seconds(steps, rounds):
    """The median seconds of each reference step (trace, run), timed in interleaved rounds after a warm-up, so that
    a slow second of a shared machine slows both alike (the fit divides one by the other)."""
    times = [[] for _ in steps]
    for round_ in range(rounds + 1):  # the first: a warm-up
        for (trace, run), seconds in zip(steps, times):
            loss = trace()
            start = time.perf_counter()
            run(loss)
            if round_:
                seconds.append(time.perf_counter() - start)
    return [statistics.median(seconds) for seconds in times]


def _measure_step_factors(calibration, device, quick, repeats):
    """(overhead_factor, work_factor): how much slower an op's fixed cost and its work run inside a real step than
    alone (the step's bookkeeping and allocations; colder caches). Fitted to two reference steps, one made of
    small ops (its time mostly fixed costs) and one of large ones (mostly work): measured = overhead part x the
    first + work part x the second, each part as the isolated rates predict it. Not the trace: see Budget."""
    state = numpy.random.get_state()  # the models' initialization and dropout draw from NumPy's RNG: put it back
    try:
        steps = [_reference_step(device, *reference) for reference in (QUICK_REFERENCES if quick else REFERENCES)]
        parts = [_reference_parts(calibration, trace) for trace, _ in steps]
        measured = _reference_seconds(steps, max(repeats, STEP_ROUNDS))
    finally:
        numpy.random.set_state(state)
    (a, b), (c, d) = parts
    det = a * d - b * c
    if abs(det) < 1e-12:
        return 1.0, 1.0
    overhead, work = (measured[0] * d - b * measured[1]) / det, (a * measured[1] - c * measured[0]) / det
    clamp = lambda f: min(max(f, 0.5), 10.0)  # noqa: E731  (a noisy fit is kept within reason)
    return clamp(overhead), clamp(work)


def _measure_bandwidth(device, quick, repeats):
    """{direction: bytes/s} of host copies, timed on the path offloading takes (offload.park and fetch): to_host
    copies into a host buffer made once and reused (`array_api.host_empty`: page-locked on cuda), to_device copies
    back from it; each timed to its end (`wait_for_copies`)."""
    sizes = QUICK_COPY_BYTES if quick else COPY_BYTES
    seconds = {direction: 0.0 for direction in DIRECTIONS}
    for nbytes in sizes:
        host = array_api.host_empty(nbytes, device).view(numpy.float32)
        host[...] = 1.0
        on_device, ready = array_api.from_host_async(host, device)
        ready()

        def to_device():
            _, copy_ready = array_api.from_host_async(host, device)
            copy_ready()
            array_api.wait_for_copies(device)

        def to_host():
            array_api.copy_to_host(on_device, host)
            array_api.wait_for_copies(device)
        seconds["to_device"] += _median_seconds(to_device, repeats)
        seconds["to_host"] += _median_seconds(to_host, repeats)
    return {direction: sum(sizes) / max(s, 1e-9) for direction, s in seconds.items()}


class _ParkingCompute(Compute):
    """Compute that parks a host copy every `every` ops, as offloading does in a forward pass: each park issued on
    the device's copy path (the copy thread on cpu(), the copy stream on cuda) after the previous one is waited
    for (offload.py's rule 1: one park in flight)."""

    def __init__(self, device, sources, hosts, every):
        super().__init__()
        self.device, self.sources, self.hosts, self.every = device, sources, hosts, every
        self.thread, self.ops, self.copies, self.in_flight = array_api.copy_thread(device), 0, 0, None

    def compute(self, node):
        super().compute(node)
        self.compute_nothing()

    def compute_nothing(self):
        """Count an op (computed, or not: to time the copies alone) and park a copy if it is the `every`-th."""
        self.ops += 1
        if self.ops % self.every:
            return
        self.settle()
        i = self.copies % len(self.sources)
        if self.thread is None:
            array_api.copy_to_host(self.sources[i], self.hosts[i])  # on cuda queued on the copy stream
        else:
            self.in_flight = self.thread.to_host(self.sources[i], self.hosts[i])
        self.copies += 1

    def settle(self):
        if self.in_flight is not None:
            self.in_flight.result()
            self.in_flight = None


OVERLAP_CHUNK, OVERLAP_BUFFERS = 4 << 20, 8  # 32 MB of sources, as many host buffers: more than fits in cache
OVERLAP_SHARE = 0.4  # the copies' seconds, alone, as a share of the forward pass they run beside
OVERLAP_ROUNDS = 7


def _measure_copy_overlap(device, quick, repeats):
    """How much of a copy hides under the compute beside it: a forward pass of the wide reference step realized
    alone, then parking a 4 MB copy every few ops (about 40% of its time in copies), and those copies alone, one
    after another, in interleaved rounds; (alone + copies - both) / the smaller of the two, within [0, 1]. A copy
    engine (a GPU's) would hide them all; on 2 cores the copy thread shares the memory bus and a core with the
    compute, so less. 0 where copies are synchronous (cpu_numpy())."""
    if not device_copies_overlap(device):
        return 0.0
    state = numpy.random.get_state()
    try:
        trace, _ = _reference_step(device, *(QUICK_REFERENCES if quick else REFERENCES)[-1])
    finally:
        numpy.random.set_state(state)
    chunk = QUICK_COPY_BYTES[0] if quick else OVERLAP_CHUNK
    sources = [array_api.array(numpy.ones(chunk // 4, numpy.float32), device=device) for _ in range(OVERLAP_BUFFERS)]
    hosts = [array_api.host_empty(chunk, device).view(numpy.float32) for _ in range(OVERLAP_BUFFERS)]

    def forward(every):
        machine = _ParkingCompute(device, sources, hosts, every)
        loss = trace()
        start = time.perf_counter()
        autograd.realize([loss], lambda node: True, machine)
        machine.settle()
        array_api.wait_for_copies(device)
        return time.perf_counter() - start, machine

    def copies(count):  # as the machine issues them, with no compute between
        machine, start = _ParkingCompute(device, sources, hosts, 1), time.perf_counter()
        for _ in range(count):
            machine.compute_nothing()
        machine.settle()
        array_api.wait_for_copies(device)
        return time.perf_counter() - start
    never = 1 << 30
    alone, machine = forward(never)  # a warm-up, and the pass's ops: size the copies to the pass
    copies(OVERLAP_BUFFERS)  # a warm-up: the host buffers' first touch faults their pages in
    per_copy = copies(OVERLAP_BUFFERS) / OVERLAP_BUFFERS
    every = max(1, round(machine.ops * per_copy / (OVERLAP_SHARE * alone)))
    times = {"alone": [], "both": [], "copies": []}
    for _ in range(max(repeats, OVERLAP_ROUNDS)):
        times["alone"].append(forward(never)[0])
        seconds, machine = forward(every)
        times["both"].append(seconds)
        times["copies"].append(copies(machine.copies))
    alone, both, copied = (statistics.median(times[k]) for k in ("alone", "both", "copies"))
    return min(max((alone + copied - both) / max(min(alone, copied), 1e-9), 0.0), 1.0)


@dataclass(frozen=True)
class Calibration(Rates):
    """This machine's rates (the fields are `costs.Rates`'s), measured by a short benchmark and cached."""

    @classmethod
    def measure(cls, device=None, quick=False, repeats=3):
        """Time each kind's op and its gradient at a few sizes on `device` (the median of `repeats`) and host copies
        of 1, 4 and 16 MB each way, then the step factors and the copies' overlap: about ten seconds. quick: tiny
        sizes, for tests (rates positive and finite, not meaningful)."""
        device = device or default_device()
        rates, overhead = _measure_rates(device, quick, repeats)
        backward_rates, backward_overhead = _measure_rates(device, quick, repeats, _gradient_seconds)
        update_rate, update_overhead = _measure_update(device, quick, repeats)
        bandwidth = _measure_bandwidth(device, quick, repeats)
        isolated = cls(rates, overhead, bandwidth, machine_key(device, quick), backward_rates, backward_overhead,
                       update_rate, update_overhead)
        overhead_factor, work_factor = _measure_step_factors(isolated, device, quick, repeats)
        overlap = _measure_copy_overlap(device, quick, repeats)
        return dataclasses.replace(isolated, overhead_factor=overhead_factor, work_factor=work_factor,
                                   copy_overlap=overlap)

    @classmethod
    def load_or_measure(cls, device=None, quick=False):
        """This machine's calibration from the cache (`cache_dir()`), measured and cached first if there is none
        (or it is unreadable): measure once per machine, before training, never inside a step."""
        key = machine_key(device, quick)
        path = _cache_path(key)
        try:
            calibration = cls.from_dict(json.loads(path.read_text()))
            if calibration.machine == key:
                return calibration
        except (OSError, ValueError, TypeError, KeyError):
            pass  # none yet, or written by another version: measure again
        calibration = cls.measure(device, quick)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # whole files only: processes may share it
        partial.write_text(json.dumps(calibration.to_dict(), indent=1, sort_keys=True))
        os.replace(partial, path)
        return calibration



class CostModel(costs.CostModel):
    """The core's CostModel (needle/costs.py) priced with this machine's calibration by default: measured once per
    machine and cached (`Calibration.load_or_measure`)."""

    @staticmethod
    def default_rates(device):
        return Calibration.load_or_measure(device)
