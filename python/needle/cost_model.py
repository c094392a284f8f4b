"""What a value costs in seconds: to recompute it, and to move its bytes to host memory and back, on this machine.

A checkpointing planner trades memory for time, so it needs the time. Each op's work is read from its class and
its inputs' and output's specs (shapes and dtypes; nothing is computed): `op_work` gives its kind, its FLOPs (for
the matmul-like kinds, whose time follows them) and the bytes it reads and writes (for the rest, whose time
follows those). A short benchmark (`Calibration.measure`) times the real ops of each kind at a few sizes on the
device, through the very machine that recomputes values (`backward.Compute`), and turns them into one rate per
kind (flop/s or bytes/s) plus a fixed per-op overhead (Python dispatch), the same for each kind's gradient, times
Adam's update per parameter byte and host copies each way. Ops inside a real step run slower than alone (the
step's bookkeeping, allocations, colder caches): two factors, one for the fixed costs and one for the work, are
fitted to two reference steps built from ops. Last, how much of a host copy hides under the compute beside it: a
reference forward pass timed alone and parking copies as offloading does. It is measured once per machine and
cached as JSON
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
by how much; benchmarks/bench_cost_model.py puts its predictions beside measured times, kind by kind.
"""
import dataclasses
import hashlib
import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy

from . import autograd, ops
from .autograd import find_topo_sort, Tensor, element_shapes, elements_of, infer_spec, spec_nbytes
from .backend_selection import BACKEND, array_api, default_device
from .backward import Compute
from .version import package_version

__all__ = ["DIRECTIONS", "FLOP_KINDS", "KINDS", "MEASURED_KINDS", "Calibration", "CostModel", "cache_dir", "cpu_model",
           "device_copies_overlap", "machine_key", "op_work"]

# Every kind of work an op can be. The first four take time by their FLOPs, the rest by the bytes they move;
# a view moves nothing (its output lives in its input's buffer), so it costs only the per-op overhead.
KINDS = ("matmul", "linear_cross_entropy", "attention", "conv", "layernorm", "softmax", "logsumexp", "cross_entropy",
         "elementwise", "reduction", "view", "copy", "cast")
FLOP_KINDS = ("matmul", "linear_cross_entropy", "attention", "conv")
MEASURED_KINDS = tuple(k for k in KINDS if k != "view")
DIRECTIONS = ("to_host", "to_device")

# Op class -> kind, for the ops whose kind their class decides (a view op is told by `op.view`; any op not here
# is "elementwise", priced by its bytes: right for the element-wise ops, a fair guess for new ones).
KIND_OF_OP = {
    ops.MatMul: "matmul", ops.Linear: "matmul", ops.LinearActivation: "matmul",
    # The fused LM head is matmuls too, but chunked, thin (a chunk of tokens against the whole vocabulary) and
    # with a softmax over each chunk's logits: its own kind, so it gets its own rate (a third of a square
    # matmul's here, and its gradient's less again).
    ops.LinearCrossEntropy: "linear_cross_entropy", ops.LinearCrossEntropyGrad: "linear_cross_entropy",
    ops.ScaledDotProductAttention: "attention", ops.ScaledDotProductAttentionGrad: "attention",
    ops.Conv: "conv",
    ops.LayerNorm: "layernorm", ops.LayerNormGrad: "layernorm",
    ops.LogSoftmax: "softmax", ops.LogSumExp: "logsumexp",
    ops.SoftmaxCrossEntropy: "cross_entropy", ops.SoftmaxCrossEntropyGrad: "cross_entropy",
    ops.Summation: "reduction",
    ops.Stack: "copy", ops.Split: "copy", ops.Flip: "copy", ops.Pad: "copy", ops.Dilate: "copy",
    ops.UnDilate: "copy", ops.GatherRows: "copy", ops.ScatterAddRows: "copy", ops.PickColumns: "copy",
    ops.ScatterColumns: "copy",
    ops.Cast: "cast",
}


# ----- work: what an op does, from specs alone ------------------------------------------------------------------
def _spec(node, who):
    spec = infer_spec(node)
    if spec is None:
        raise ValueError(f"op_work: cannot infer the shape of {who} without computing it; give the op an infer_shape")
    return spec


def _attention_pairs(t_q, t_k, causal):
    """(query, key) pairs the fused kernel visits: all, or under the causal mask (query i sees keys j <= i +
    T_k - T_q) the visible ones, which is all the CPU and CUDA kernels compute."""
    if not causal:
        return t_q * t_k
    return t_q * (t_k - t_q) + t_q * (t_q + 1) // 2


def _flops(op, input_shapes, out_shape):
    """Multiply-adds x 2 of the matmul-like ops; 0 for the others (their time follows their bytes)."""
    if isinstance(op, (ops.MatMul, ops.Linear)):
        return 2 * elements_of(out_shape) * input_shapes[0][-1]  # (..., m, k) x (k, n): 2 m n k per batch
    if isinstance(op, ops.LinearActivation):  # outputs (f(z), z or its codes): f(z)'s shape is the product's
        return 2 * elements_of(out_shape[0]) * input_shapes[0][-1]
    if isinstance(op, (ops.LinearCrossEntropy, ops.LinearCrossEntropyGrad)):
        (n, h), v = input_shapes[0], input_shapes[1][1]
        # forward: the logits h W; the gradient: the logits again, dz W^T and h^T dz
        return 2 * n * h * v * (3 if isinstance(op, ops.LinearCrossEntropyGrad) else 1)
    if isinstance(op, (ops.ScaledDotProductAttention, ops.ScaledDotProductAttentionGrad)):
        (b, h, t_q, d), (_, _, t_k, _), d_v = input_shapes[0], input_shapes[1], input_shapes[2][-1]
        pairs = b * h * _attention_pairs(t_q, t_k, op.causal)
        if isinstance(op, ops.ScaledDotProductAttention):
            return 2 * pairs * (d + d_v)  # q k^T, then p v: ~4 B H T T D
        return 2 * pairs * (3 * d + 2 * d_v)  # q k^T again, dout v^T, p^T dout, ds k, ds^T q (FlashAttention-2)
    if isinstance(op, ops.Conv):
        kh, kw, c_in, _ = input_shapes[1]
        return 2 * elements_of(out_shape) * kh * kw * c_in  # im2col's matmul
    return 0


def op_work(node):
    """(kind, flops, bytes) of computing `node`, from its op's class and its inputs' and output's specs only.

    kind is one of KINDS; flops counts the matmul-like kinds' (FLOP_KINDS) floating-point operations and is 0 for
    the others; bytes are what the op reads and writes: its inputs' and its output's (0 for a view, which moves
    nothing). A leaf has no op: ValueError.
    """
    if node.op is None:
        raise ValueError("op_work: a leaf has no op (its value is data, never computed)")
    op = node.op
    if op.view:
        return "view", 0, 0
    who = type(op).__name__
    input_specs = [_spec(x, f"an input of {who}") for x in node.inputs]
    out_spec = _spec(node, who)
    kind = KIND_OF_OP.get(type(op), "elementwise")
    nbytes = sum(spec_nbytes(s) for s in input_specs) + spec_nbytes(out_spec)
    flops = _flops(op, [s[0] for s in input_specs], out_spec[0]) if kind in FLOP_KINDS else 0
    return kind, int(flops), int(nbytes)


def _work(kind, flops, nbytes):
    return flops if kind in FLOP_KINDS else nbytes


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


def _check_rate(what, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive finite number, got {value!r}")
    return float(value)


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
            work += _work(*op_work(node))
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
class Calibration:
    """This machine's rates: `rates[kind]` in flop/s (FLOP_KINDS) or bytes/s (the other kinds but "view"), the
    fixed seconds every op costs besides its work (`overhead_seconds`: Python dispatch, a backend call), the host
    copies' bandwidth each way (`host_bandwidth[direction]`, bytes/s) and the machine it was measured on.

    `backward_rates[kind]` and `backward_overhead_seconds` price differentiating an op the same way: the forward
    op's work over the seconds its gradient takes. They are measured apart because a gradient is not "twice the
    forward": a matmul's reads a transposed operand, a layer norm's is its own kernel. None: twice the work at the
    forward rates (round figures, as `nominal`'s). `update_rate` (parameter bytes/s) and
    `update_overhead_seconds` (per parameter) price the optimizer's update (Adam's); None: seven passes over the
    parameters' bytes at the element-wise rate (it reads value, gradient and two moments, writes three).
    `copy_overlap` (0 to 1) is the share of a copy that hides under the compute beside it, measured: 1 where a copy
    engine runs it (a GPU's), less where the copy thread shares the cores and memory bus (cpu()), 0 where copies
    are synchronous (cpu_numpy()).
    """

    rates: dict
    overhead_seconds: float
    host_bandwidth: dict
    machine: dict = field(default_factory=dict)
    backward_rates: dict = None
    backward_overhead_seconds: float = None
    update_rate: float = None
    update_overhead_seconds: float = None
    overhead_factor: float = 1.0
    work_factor: float = 1.0
    copy_overlap: float = 1.0

    def __post_init__(self):
        if self.backward_rates is None:
            object.__setattr__(self, "backward_rates", {k: r / 2 for k, r in self.rates.items()})
        if self.backward_overhead_seconds is None:
            object.__setattr__(self, "backward_overhead_seconds", 2 * self.overhead_seconds)
        if self.update_rate is None and "elementwise" in self.rates:
            object.__setattr__(self, "update_rate", self.rates["elementwise"] / 7)
        if self.update_overhead_seconds is None:
            object.__setattr__(self, "update_overhead_seconds", self.overhead_seconds)
        missing = [k for k in MEASURED_KINDS if k not in self.rates]
        missing += [d for d in DIRECTIONS if d not in self.host_bandwidth]
        if missing:
            raise ValueError(f"Calibration: needs a rate for every kind of {MEASURED_KINDS} and a host bandwidth for "
                             f"{DIRECTIONS}; missing {missing}")
        for kind, rate in self.rates.items():
            _check_rate(f"Calibration: the rate of {kind!r}", rate)
        for kind, rate in self.backward_rates.items():
            _check_rate(f"Calibration: the backward rate of {kind!r}", rate)
        _check_rate("Calibration: update_rate", self.update_rate)
        for direction, rate in self.host_bandwidth.items():
            _check_rate(f"Calibration: host_bandwidth[{direction!r}]", rate)
        for name in ("overhead_seconds", "backward_overhead_seconds", "update_overhead_seconds", "overhead_factor",
                     "work_factor"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"Calibration: {name} must be >= 0, got {value!r}")
        if not 0.0 <= self.copy_overlap <= 1.0:  # also refuses NaN
            raise ValueError(f"Calibration: copy_overlap must be in [0, 1], got {self.copy_overlap!r}")

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

    @classmethod
    def nominal(cls):
        """Round figures of a small CPU, not measured: for plans and tests that must not depend on the machine."""
        rates = {"matmul": 2e10, "linear_cross_entropy": 1e10, "attention": 1e10, "conv": 1e10, "cast": 2e9}
        rates.update({k: 4e9 for k in MEASURED_KINDS if k not in rates})
        return cls(rates, 2e-5, {"to_host": 8e9, "to_device": 8e9}, {"nominal": True})

    def to_dict(self):
        return {"rates": dict(self.rates), "overhead_seconds": self.overhead_seconds,
                "host_bandwidth": dict(self.host_bandwidth), "machine": dict(self.machine),
                "backward_rates": dict(self.backward_rates),
                "backward_overhead_seconds": self.backward_overhead_seconds,
                "update_rate": self.update_rate, "update_overhead_seconds": self.update_overhead_seconds,
                "overhead_factor": self.overhead_factor, "work_factor": self.work_factor,
                "copy_overlap": self.copy_overlap}

    @classmethod
    def from_dict(cls, d):
        return cls(dict(d["rates"]), float(d["overhead_seconds"]), dict(d["host_bandwidth"]), dict(d["machine"]),
                   dict(d["backward_rates"]), float(d["backward_overhead_seconds"]), float(d["update_rate"]),
                   float(d["update_overhead_seconds"]), float(d["overhead_factor"]), float(d["work_factor"]),
                   float(d["copy_overlap"]))


class CostModel:
    """Seconds to compute a value, to recompute a path of them, and to copy bytes to the host and back.

    device: whose calibration (default: the default device); calibration: a `Calibration` (default:
    `Calibration.load_or_measure(device)`, measured once per machine and cached); host_bandwidth: bytes/s to
    plan copies with instead of the measured figure, both ways (16e9: as if over PCIe 4).

    compute_seconds(node) = overhead + work / rate[kind], work being op_work's FLOPs for the matmul-like kinds and
    bytes for the others. `hidden_seconds` says how much of a copy a copy stream (CUDA) or copy thread (cpu())
    hides under the compute issued beside it: the calibration's measured `copy_overlap` of the smaller of the two,
    or all of it on a link given by `host_bandwidth` (planned as a GPU's, whose copy engine takes no compute). On
    cpu_numpy() copies are synchronous and hide nothing; `device_copies_overlap` tells which case a device is.
    """

    def __init__(self, device=None, host_bandwidth=None, calibration=None):
        self.device = device or default_device()
        self.calibration = calibration if calibration is not None else Calibration.load_or_measure(self.device)
        if host_bandwidth is not None:
            host_bandwidth = _check_rate("CostModel: host_bandwidth (bytes/s)", host_bandwidth)
        self.host_bandwidth = host_bandwidth

    def compute_seconds(self, node):
        """Seconds to compute `node` from its inputs (a leaf: 0, it is never computed)."""
        if node.op is None:
            return 0.0
        return self._seconds(node, self.calibration.rates, self.calibration.overhead_seconds)

    def _seconds(self, node, rates, overhead):
        """The op's fixed cost plus its work at its kind's rate, each as it runs inside a step (the factors)."""
        kind, flops, nbytes = op_work(node)
        rate, c = rates.get(kind), self.calibration
        return overhead * c.overhead_factor + (_work(kind, flops, nbytes) / rate * c.work_factor if rate else 0.0)

    def gradient_seconds(self, node):
        """Seconds to differentiate `node` (its inputs' gradients from its own), at the calibrated backward rates;
        0 for a leaf or a value backward does not differentiate (nothing above it requires grad)."""
        if node.op is None or not node.requires_grad:
            return 0.0
        return self._seconds(node, self.calibration.backward_rates, self.calibration.backward_overhead_seconds)

    def update_seconds(self, params):
        """Seconds of the optimizer's update of `params` (leaves), priced as Adam's."""
        c = self.calibration
        return sum(c.update_overhead_seconds * c.overhead_factor + spec_nbytes(infer_spec(p)) / c.update_rate *
                   c.work_factor for p in params)

    def step_seconds(self, root):
        """A training step on the graph above `root`, nothing dropped or offloaded: every op's forward seconds and
        its gradient's, and the update of the parameters (the leaves that require grad). The base that the Budget
        and `checkpoint_budget.optimal` add their plans' seconds to."""
        nodes = find_topo_sort([root])
        computed = [n for n in nodes if n.op is not None]
        params = [n for n in nodes if n.op is None and n.requires_grad]
        return (sum(map(self.compute_seconds, computed)) + sum(map(self.gradient_seconds, computed)) +
                self.update_seconds(params))

    def recompute_seconds(self, nodes):
        """Seconds to recompute a path: the ops of `nodes`, each once."""
        return sum(self.compute_seconds(node) for node in nodes)

    def copy_seconds(self, nbytes, direction="to_host"):
        """Seconds to copy `nbytes` to the host ("to_host") or back ("to_device"), at `host_bandwidth` if given."""
        if direction not in DIRECTIONS:
            raise ValueError(f"CostModel.copy_seconds: direction must be one of {DIRECTIONS}, got {direction!r}")
        if nbytes < 0:
            raise ValueError(f"CostModel.copy_seconds: nbytes must be >= 0, got {nbytes}")
        return nbytes / (self.host_bandwidth or self.calibration.host_bandwidth[direction])

    @property
    def copy_overlap(self):
        """The share of a copy that hides under compute: the calibration's, measured on this machine; 1 on a link
        given by `host_bandwidth`, planned as a GPU's (a copy engine takes none of the compute's time)."""
        return 1.0 if self.host_bandwidth is not None else self.calibration.copy_overlap

    def hidden_seconds(self, copy_seconds, compute_seconds_around):
        """How much of a copy hides under the compute issued beside it: `copy_overlap` x min(copy, compute). That is
        what a copy stream (CUDA) or copy thread (cpu()) can hide; where copies are synchronous (cpu_numpy()) the
        real overlap is 0, so callers that model this machine check `device_copies_overlap(device)` first."""
        if copy_seconds < 0 or compute_seconds_around < 0:
            raise ValueError(f"CostModel.hidden_seconds: seconds must be >= 0, got copy {copy_seconds}, compute "
                             f"{compute_seconds_around}")
        return self.copy_overlap * min(copy_seconds, compute_seconds_around)
