"""What a value costs in seconds, from its op's own facts: the FLOPs and bytes it moves, at fixed rates.

A checkpointing planner trades memory for time, so it needs the time. Each op's work is read from its class and
its inputs' and output's specs (shapes and dtypes; nothing is computed): `op_work` gives its kind, its FLOPs (for
the matmul-like kinds, whose time follows them) and the bytes it reads and writes (for the rest, whose time
follows those). `CostModel` prices them at one rate per kind plus a fixed cost per op — a roofline:

    model = CostModel()                      # Rates.nominal(): round figures of a small CPU, the same everywhere
    model.compute_seconds(node)              # overhead + work / rate[kind]
    model.step_seconds(loss)                 # a step: every op and its gradient, the update
    model.copy_seconds(nbytes, "to_host")    # a host copy, for a store that moves bytes (the toolbox's offloading)

The rates here are not measured, so the same graph gets the same prices, and the Budget the same plan, on every
machine: what they get right is which values are cheap or dear to recompute, and by how much. The toolbox
(needle.toolbox.cost_model) measures this machine's rates once and caches them (`Budget(b, calibrate=True)`).
"""
import math

from dataclasses import dataclass, field

from . import ops
from .autograd import elements_of, find_topo_sort, infer_spec, spec_nbytes
from .backend_selection import default_device

__all__ = ["DIRECTIONS", "FLOP_KINDS", "KINDS", "MEASURED_KINDS", "CostModel", "Rates", "check_rate", "op_work",
           "work_of"]

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


def work_of(kind, flops, nbytes):
    """The work an op of this kind is priced by: its FLOPs (FLOP_KINDS) or its bytes."""
    return flops if kind in FLOP_KINDS else nbytes


def check_rate(what, value):
    """`value` as a float, or ValueError naming `what` unless it is a positive finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Rates:
    """A machine's rates: `rates[kind]` in flop/s (FLOP_KINDS) or bytes/s (the other kinds but "view"), the fixed
    seconds every op costs besides its work (`overhead_seconds`: Python dispatch, a backend call), the host copies'
    bandwidth each way (`host_bandwidth[direction]`, bytes/s) and the machine they were measured on (`nominal()`:
    round figures, measured nowhere; the toolbox's cost_model.Calibration measures them).

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
            raise ValueError(f"Rates: needs a rate for every kind of {MEASURED_KINDS} and a host bandwidth for "
                             f"{DIRECTIONS}; missing {missing}")
        for kind, rate in self.rates.items():
            check_rate(f"Rates: the rate of {kind!r}", rate)
        for kind, rate in self.backward_rates.items():
            check_rate(f"Rates: the backward rate of {kind!r}", rate)
        check_rate("Rates: update_rate", self.update_rate)
        for direction, rate in self.host_bandwidth.items():
            check_rate(f"Rates: host_bandwidth[{direction!r}]", rate)
        for name in ("overhead_seconds", "backward_overhead_seconds", "update_overhead_seconds", "overhead_factor",
                     "work_factor"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"Rates: {name} must be >= 0, got {value!r}")
        if not 0.0 <= self.copy_overlap <= 1.0:  # also refuses NaN
            raise ValueError(f"Rates: copy_overlap must be in [0, 1], got {self.copy_overlap!r}")

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

    device: the device priced (default: the default device); calibration: the `Rates` (default: `Rates.nominal()`;
    the toolbox's cost_model measures this machine's); host_bandwidth: bytes/s to plan copies with instead of the
    rates' figure, both ways (16e9: as if over PCIe 4).

    compute_seconds(node) = overhead + work / rate[kind], work being op_work's FLOPs for the matmul-like kinds and
    bytes for the others. `hidden_seconds` says how much of a copy a copy stream (CUDA) or copy thread (cpu())
    hides under the compute issued beside it: the calibration's measured `copy_overlap` of the smaller of the two,
    or all of it on a link given by `host_bandwidth` (planned as a GPU's, whose copy engine takes no compute). On
    cpu_numpy() copies are synchronous and hide nothing; `device_copies_overlap` tells which case a device is.
    """

    def __init__(self, device=None, host_bandwidth=None, calibration=None):
        self.device = device or default_device()
        self.calibration = calibration if calibration is not None else self.default_rates(self.device)
        if host_bandwidth is not None:
            host_bandwidth = check_rate("CostModel: host_bandwidth (bytes/s)", host_bandwidth)
        self.host_bandwidth = host_bandwidth

    @staticmethod
    def default_rates(device):
        """The rates priced with when none are given: the nominal ones (a subclass measures them)."""
        return Rates.nominal()

    def compute_seconds(self, node):
        """Seconds to compute `node` from its inputs (a leaf: 0, it is never computed)."""
        if node.op is None:
            return 0.0
        return self._seconds(node, self.calibration.rates, self.calibration.overhead_seconds)

    def _seconds(self, node, rates, overhead):
        """The op's fixed cost plus its work at its kind's rate, each as it runs inside a step (the factors)."""
        kind, flops, nbytes = op_work(node)
        rate, c = rates.get(kind), self.calibration
        return overhead * c.overhead_factor + (work_of(kind, flops, nbytes) / rate * c.work_factor if rate else 0.0)

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
