"""The computational graph: Values made by Ops, realized eagerly or lazily, differentiated in reverse order.

A Value is a handful of fields: the `op` that made it, its `inputs`, its `cached_data` (None until realized, or
after it was released), `requires_grad`, and `drop` (gradient checkpointing: do not keep this value after the
forward pass; recompute it during backward). Its `version` counts the in-place writes to its data (replacing it
through `.data =`, an optimizer's update, `t[idx] = ...`); backward compares it with the version the forward pass
read, so a value changed in between raises instead of giving a wrong gradient (rule 4 of checkpoint.py).
Every walk over the graph is the one iterative `find_topo_sort`.

Backward is planned, then executed. `plan_backward(root)` is plain data: one `Step` per value to differentiate,
each naming the values to recompute before it (missing values its gradient reads: dropped by checkpointing or
released earlier) and the values to release after it (whose last use it is). `run_backward` walks that plan with a
machine: `Compute` does the work; checkpoint_budget's ledger walks the very same loop and only counts bytes, so
what the Budget predicts and what runs cannot drift apart. A dropped value is just a missing value here; what to
drop is decided in checkpoint.py, whose numbered rules this file enforces.
"""
import contextlib
import weakref
from dataclasses import dataclass, field

import numpy

from .backend_selection import NDArray, array_api, default_device, device_of

__all__ = [
    "LAZY_MODE",
    "TENSOR_COUNTER",
    "Op",
    "Tensor",
    "TensorOp",
    "TensorTuple",
    "TensorTupleOp",
    "Value",
    "compute_gradient_of_variables",
    "find_topo_sort",
    "last_backward_stats",
    "lazy_mode",
    "placeholder",
    "plan_backward",
    "run_backward",
    "release",
    "spec_of",
    "itemsize",
    "Step",
    "BackwardPlan",
    "Compute",
]

# When True, ops only record the graph; values are computed when something asks for them.
LAZY_MODE = False
# Mixed precision: the active `needle.amp.autocast` context, or None. Read only when an op is applied (never when
# a value is computed or recomputed), like LAZY_MODE: the casts it asks for become graph nodes, so a
# checkpoint's recomputation replays them exactly.
AUTOCAST = None
# The number of live graph values (course code checks it for leaks).
TENSOR_COUNTER = 0


@contextlib.contextmanager
def lazy_mode(enabled=True):
    """Set LAZY_MODE inside a `with` block and restore it afterwards."""
    global LAZY_MODE
    previous, LAZY_MODE = LAZY_MODE, enabled
    try:
        yield
    finally:
        LAZY_MODE = previous


class Op:
    """An operator: `compute` on raw arrays, `gradient` on Tensors (a differentiable graph itself)."""

    # Which forward values `gradient` reads — "inputs", "output", "both" or "none" (shapes are always
    # available). The backward plan keeps exactly these alive, and recomputes them if they were dropped.
    saves = "inputs"
    # Facts the checkpointing policies and the Budget's memory ledger read (each op declares its own):
    saveable = False  # expensive to recompute (matmul, conv): the "selective" policy keeps it
    view = False  # the output lives in its input's buffer (when `view_strides` says so), or a tuple's
    compacts_inputs = False  # compute copies a strided operand into a compact one first (True, or input positions)

    def view_strides(self, shape, strides, out_shape):
        """For a view op: the output's element strides given its input's, or None where compute must copy."""
        return None

    def workspace(self, *input_shapes):
        """Elements `compute` allocates besides its result (temporaries), for the Budget's ledger; usually 0."""
        return 0

    def reads_transposed(self, *input_shapes):
        """Whether compute reads an input that is the transpose of a whole compact matrix where it is, instead of
        compacting it (a 2-D matmul: the backend packs it transposed), for the Budget's ledger."""
        return False

    # Under `needle.amp.autocast(dtype)`: "low" ops get their floating inputs cast to the 16-bit dtype (the
    # matmuls, convolutions and element-wise arithmetic), "float32" ops get them cast to float32 (reductions,
    # softmax, log-sum-exp, the losses: where bf16/fp16 rounding would cost accuracy); None runs in whatever
    # dtype its inputs have.
    autocast = None

    def infer_dtype(self, *input_dtypes):
        """The output's dtype from the inputs' (for lazy graphs): the first input's unless the op says otherwise."""
        return input_dtypes[0]

    def __call__(self, *args):
        raise NotImplementedError()

    def compute(self, *args):
        raise NotImplementedError()

    def gradient(self, out_grad, node):
        raise NotImplementedError()

    def gradient_as_tuple(self, out_grad, node):
        """The gradient as a tuple with one entry per input."""
        output = self.gradient(out_grad, node)
        if isinstance(output, tuple):
            return output
        if isinstance(output, list):
            return tuple(output)
        return (output,)


class TensorOp(Op):
    """An op whose output is a Tensor."""

    # Shape inference lets a lazy graph be built without computing it (layers read their inputs' shapes):
    # element-wise ops keep their first input's shape; others override `infer_shape`; None means "compute it".
    elementwise = False

    def infer_shape(self, *input_shapes):
        return input_shapes[0] if self.elementwise else None

    def __call__(self, *args):
        if AUTOCAST is not None and self.autocast is not None:
            args = AUTOCAST.cast_inputs(self, args)
        return Tensor.make_from_op(self, args)


class TensorTupleOp(Op):
    """An op whose output is a TensorTuple (its shape: a tuple of its elements' shapes)."""

    def infer_shape(self, *input_shapes):
        return None

    def __call__(self, *args):
        return TensorTuple.make_from_op(self, args)


def find_topo_sort(node_list, expand=None):
    """Post-order depth-first order of the graph above `node_list`, inputs visited in order.

    Iterative (an explicit stack), so a graph of any depth works. `expand(node)` False stops the walk below
    `node` (the node itself is still listed). Every traversal in needle is this one.
    """
    order, visited = [], set()
    for root in node_list:
        if id(root) in visited:
            continue
        visited.add(id(root))
        stack = [(root, iter(root.inputs if expand is None or expand(root) else ()))]
        while stack:
            node, children = stack[-1]
            for child in children:
                if id(child) not in visited:
                    visited.add(id(child))
                    stack.append((child, iter(child.inputs if expand is None or expand(child) else ())))
                    break
            else:
                stack.pop()
                order.append(node)
    return order


# ----- values in memory -----------------------------------------------------------------------------------------
def spec_of(data):
    """(shape, dtype, device) of a raw array, or of a tuple of them (its shape: a tuple of shapes)."""
    if isinstance(data, tuple):
        specs = [spec_of(x) for x in data]
        return tuple(s[0] for s in specs), specs[0][1] if specs else "float32", specs[0][2] if specs else None
    return tuple(data.shape), data.dtype, device_of(data)


def itemsize(dtype):
    """Bytes per element of a dtype ("float32", or a NumPy dtype)."""
    return numpy.dtype(dtype).itemsize


def nbytes_of(data):
    if data is None:
        return 0
    if isinstance(data, tuple):
        return sum(nbytes_of(x) for x in data)
    return int(data.nbytes)


def release(node):
    """Forget a node's value (it can be recomputed from its inputs); remember its shape, dtype and device."""
    if node.cached_data is not None:
        node._spec = spec_of(node.cached_data)
        node.cached_data = None


class Compute:
    """The machine that runs realization and backward for real: it computes, checks and releases values.

    `checkpoint_budget.Ledger` has the same methods and only counts bytes; `_realize` and `run_backward` are
    written once against this interface.
    """

    def __init__(self):
        self.stats = {"recomputed_nodes": 0, "recomputed_bytes": 0, "released_bytes": 0,
                      "max_recomputes_per_node": 0}
        self.recomputed = {}  # id -> count, this pass

    def has(self, node):
        return node.cached_data is not None

    def compute(self, node):
        value = node.op.compute(*[x.cached_data for x in node.inputs])
        if isinstance(value, numpy.generic):  # NEEDLE_BACKEND=np: NumPy turns 0-d results into scalars
            value = numpy.asarray(value)
        node.cached_data = value
        if node._input_versions is None:  # the first computation is the forward pass: what backward must see
            node._input_versions = tuple(x.version for x in node.inputs)

    def recompute(self, node):
        """Rule 4: a recomputation reads the versions the forward pass read and gives the same shape and dtype."""
        if any(x.cached_data is None for x in node.inputs):
            raise RuntimeError(f"backward plan violated: an input of {type(node.op).__name__} is missing at its "
                               "recomputation (rule 2)")
        check_unchanged(node, node.inputs, action="recompute")
        expected = node._spec
        self.compute(node)
        got = spec_of(node.cached_data)
        if expected is not None and got != expected:
            raise RuntimeError(
                f"checkpoint: recomputing {type(node.op).__name__} gave shape/dtype/device {got}, but the forward "
                f"pass had {expected} (rule 4a). Does the op's compute depend on state other than its inputs, "
                f"e.g. a global RNG? Make that state a leaf input.")
        count = self.recomputed[id(node)] = self.recomputed.get(id(node), 0) + 1
        self.stats["recomputed_nodes"] += 1
        self.stats["recomputed_bytes"] += nbytes_of(node.cached_data)
        self.stats["max_recomputes_per_node"] = max(self.stats["max_recomputes_per_node"], count)

    def check_reads(self, node):
        check_unchanged(node, reads(node))

    def free(self, node):
        if node._data is not None:
            self.stats["released_bytes"] += nbytes_of(node._data)
            release(node)

    def set_grad(self, node, grad):
        node.grad = grad
        for hook in node._grad_hooks or ():  # e.g. DataParallel: start reducing while backward goes on
            hook(node)

    def value(self, node):
        return node.cached_data


def check_unchanged(node, values, action="differentiate"):
    """Rule 4c: `values` (inputs of `node`, or `node` itself) hold the versions its forward computation read."""
    read = {id(x): v for x, v in zip(node.inputs, node._input_versions or ())}
    read[id(node)] = 0  # a computed value is never written by the graph itself
    for x in values:
        version = read.get(id(x), x.version)
        if x.version != version:
            what = "its output" if x is node else "one of its inputs"
            name = getattr(x, "name", None)
            kind = f"{type(x).__name__} {name!r}" if name else type(x).__name__
            raise RuntimeError(
                f"{type(node.op).__name__}: cannot {action} it: {what}, a {kind} of shape {tuple(x.shape)}, was "
                f"modified in place after the forward pass read it (version {x.version}, the forward pass read "
                f"version {version}), so the result would be wrong. Call backward() before optimizer.step(), or "
                f"don't modify it in place (rule 4c)"
            )


# ----- realization ------------------------------------------------------------------------------------------------
# Deferred decisions: a callback registered on a node runs once, before realization first computes that node.
# checkpoint_budget uses it to choose what to drop from the whole lazy graph before any of it is computed. Keyed
# weakly by node, so a graph that is never realized takes its callbacks with it.
_deferred = weakref.WeakKeyDictionary()


def defer_until_realized(node, callback):
    """Call `callback(roots)` before `node` is first computed (or before a backward through it begins)."""
    _deferred[node] = callback


def _run_deferred(order, roots, pending_only=True):
    for node in order:
        if (not pending_only or node.cached_data is None) and node in _deferred:
            _deferred.pop(node)(roots)


def last_consumers(order, computed):
    """For a topological `order` of values to compute: position -> the inputs whose last consumer sits there.

    Only values computed in this walk (not `computed` beforehand) are listed: they are the ones a walk may free.
    This is the one "count the consumers, free at zero" loop: realization and the Budget's ledger use it.
    """
    last = {}
    for i, node in enumerate(order):
        if not computed(node):
            for inp in node.inputs:
                if not computed(inp):
                    last[id(inp)] = (i, inp)
    frees = {}
    for i, inp in last.values():
        frees.setdefault(i, []).append(inp)
    return frees


def _realize(targets, keep, machine=None, walked=None):
    """Compute `targets` and every missing value they need, in topological order; return their values.

    A computed value is kept if `keep(node)`; otherwise it is released as soon as its last consumer in this
    realization has been computed (rule 3 of checkpoint.py). Targets are returned even if not kept. The walk's
    order (the values computed, and unexpanded, the existing values they read) is appended to `walked` if given.
    """
    machine = machine or _COMPUTE
    order = find_topo_sort(targets, expand=lambda n: not machine.has(n))
    if walked is not None:
        walked.extend(order)
    if _deferred and machine is _COMPUTE:
        _run_deferred(order, targets)
    frees = last_consumers(order, machine.has)
    target_ids = {id(t) for t in targets}
    for i, node in enumerate(order):
        if machine.has(node):
            continue
        if node.op is None:
            raise RuntimeError("a leaf Tensor has no data (was it released?); leaves cannot be recomputed")
        machine.compute(node)
        for inp in frees.get(i, ()):
            if id(inp) not in target_ids and not keep(inp):
                machine.free(inp)
    values = [machine.value(t) for t in targets]
    for t in targets:
        if not keep(t):
            machine.free(t)
    return values


def _infer_specs(target):
    """Fill `_spec` (shape, dtype, device) of `target` and its unrealized ancestors without computing them.

    Stops (leaving `_spec` None) at the first op that cannot infer its shape; the caller then computes.
    """
    order = find_topo_sort([target], expand=lambda n: n.cached_data is None and n._spec is None)
    for node in order:
        if node.cached_data is not None or node._spec is not None:
            continue
        if node.op is None:
            return
        specs = [x._spec if x.cached_data is None else spec_of(x.cached_data) for x in node.inputs]
        if not specs or any(s is None for s in specs):
            return
        shape = node.op.infer_shape(*[s[0] for s in specs])  # a tuple op's shape: a tuple of shapes
        if shape is None:
            return
        node._spec = (tuple(shape), node.op.infer_dtype(*[s[1] for s in specs]), specs[0][2])


def infer_spec(node):
    """(shape, dtype, device) of `node` without computing anything, or None where an op cannot infer it."""
    if node.cached_data is not None:
        return spec_of(node.cached_data)
    if node._spec is None:
        _infer_specs(node)
    return node._spec


def _keep_forward(node):
    return not node.drop


class Value:
    """A node of the computational graph."""

    __slots__ = ("op", "inputs", "_data", "requires_grad", "drop", "grad", "_spec", "version", "_input_versions",
                 "_grad_hooks", "__weakref__")

    @property
    def cached_data(self):
        return self._data

    @cached_data.setter
    def cached_data(self, data):
        # Computing a missing value or releasing one is not a write; replacing a value by another one is.
        if self._data is not None and data is not None and data is not self._data:
            self.version += 1
        self._data = data

    def realize_cached_data(self):
        """The value of this node, computed (iteratively, with what it needs) if it is not cached.

        A dropped node's value is computed and returned but not kept.
        """
        if self.cached_data is None:
            return _realize([self], _keep_forward)[0]
        return self.cached_data

    def is_leaf(self):
        return self.op is None

    def register_grad_hook(self, hook):
        """Call `hook(self)` whenever backward has set this leaf's `.grad` (its gradient complete), while the
        rest of backward is still to run; returns a function that removes the hook."""
        self._grad_hooks = (self._grad_hooks or []) + [hook]
        return lambda: setattr(self, "_grad_hooks", [h for h in self._grad_hooks if h is not hook] or None)

    def _spec_or_data(self):
        # A released value still knows its shape, dtype and device (recorded when it was released); an
        # unrealized one gets them from shape inference, and is computed only where an op cannot infer.
        if self.cached_data is None:
            if self._spec is None:
                _infer_specs(self)
            if self._spec is not None:
                return self._spec
        return spec_of(self.realize_cached_data())

    @property
    def shape(self):
        return self._spec_or_data()[0]

    @property
    def dtype(self):
        return self._spec_or_data()[1]

    @property
    def device(self):
        return self._spec_or_data()[2]

    def __del__(self):
        global TENSOR_COUNTER
        if hasattr(self, "inputs"):  # counted by _init (a constructor that raised before it was not)
            TENSOR_COUNTER -= 1

    def _init(self, op, inputs, *, cached_data=None, requires_grad=None):
        global TENSOR_COUNTER
        TENSOR_COUNTER += 1
        if requires_grad is None:
            requires_grad = any(x.requires_grad for x in inputs)
        self.op = op
        self.inputs = tuple(inputs)
        self._data = cached_data
        self.requires_grad = requires_grad
        self.drop = False
        self.grad = None
        self._spec = None
        self.version = 0
        self._input_versions = None  # the versions of `inputs` its (forward) computation read
        self._grad_hooks = None  # callables run when backward sets this leaf's .grad (register_grad_hook)

    @classmethod
    def make_const(cls, data, requires_grad=False):
        if isinstance(data, Value):
            data = data.realize_cached_data()
        value = cls.__new__(cls)
        value._init(None, [], cached_data=data, requires_grad=requires_grad)
        return value

    @classmethod
    def make_from_op(cls, op, inputs):
        for x in inputs:
            if not isinstance(x, Value):
                raise TypeError(f"{type(op).__name__}: inputs must be Tensors, got {type(x).__name__}")
        value = cls.__new__(cls)
        value._init(op, inputs)
        if not LAZY_MODE:
            if not value.requires_grad:
                return value.detach()
            value.realize_cached_data()
        return value


class TensorTuple(Value):
    """A tuple of Tensors produced by one op (e.g. split)."""

    __slots__ = ()

    def __len__(self):
        return len(self.shape)  # one shape per element, inferred without computing where possible

    def __getitem__(self, index):
        from .ops import tuple_get_item

        return tuple_get_item(self, index)

    def tuple(self):
        return tuple(self[i] for i in range(len(self)))

    def __repr__(self):
        return "needle.TensorTuple" + str(self.tuple())

    def __str__(self):
        return self.__repr__()

    def __add__(self, other):
        from .ops import make_tuple

        if not isinstance(other, TensorTuple) or len(self) != len(other):
            raise ValueError("TensorTuple add: both operands must be TensorTuples of one length")
        return make_tuple(*[self[i] + other[i] for i in range(len(self))])

    def detach(self):
        return TensorTuple.make_const(self.realize_cached_data())


class Tensor(Value):
    """An n-dimensional array in the graph: a leaf (data) or the output of a TensorOp."""

    __slots__ = ()

    def __init__(self, array, *, device=None, dtype=None, requires_grad=True, **kwargs):
        if isinstance(array, Tensor):
            device = device or array.device
            dtype = dtype or array.dtype
            if device == array.device and dtype == array.dtype:
                cached_data = array.realize_cached_data()
            else:
                cached_data = Tensor._array_from_numpy(array.numpy(), device=device, dtype=dtype)
        else:
            if device is None:
                device = device_of(array) if isinstance(array, NDArray) else default_device()
            cached_data = Tensor._array_from_numpy(array, device=device, dtype=dtype)
        self._init(None, [], cached_data=cached_data, requires_grad=requires_grad)

    @staticmethod
    def _array_from_numpy(numpy_array, device, dtype):
        try:
            return array_api.tensor_data(numpy_array, dtype=dtype, device=device)
        except TypeError as err:
            raise TypeError(f"Tensor: {err}") from err

    @property
    def data(self):
        return self.detach()

    @data.setter
    def data(self, value):
        if not isinstance(value, Tensor):
            raise TypeError(f"Tensor.data must be set to a Tensor, got {type(value).__name__}")
        if value.dtype != self.dtype:
            raise TypeError(f"Tensor.data: dtype {value.dtype} differs from {self.dtype}")
        data = value.realize_cached_data()
        if data is self.cached_data:  # `t.data = t.data` still counts as a write, as an optimizer's would
            self.version += 1
        self.cached_data = data

    def __setitem__(self, index, value):
        """Write `value` (a Tensor or a scalar) into this Tensor's array in place, outside the graph."""
        data = self.realize_cached_data()
        data[index] = value.realize_cached_data() if isinstance(value, Tensor) else value
        self.version += 1

    def __reduce__(self):
        # By value: a pickled or deep-copied Tensor is a leaf holding the same numbers (its graph is not kept).
        state = getattr(self, "__dict__", None)  # a Parameter's name
        return _rebuild_tensor, (type(self), self.numpy(), self.device, self.requires_grad), state

    def detach(self):
        """A new leaf holding this Tensor's value, outside the graph."""
        return Tensor.make_const(self.realize_cached_data())

    @property
    def ndim(self):
        return len(self.shape)

    def backward(self, out_grad=None):
        """Fill `.grad` of every leaf that requires grad; a non-scalar output gets an implicit ones gradient."""
        if not self.requires_grad:
            raise RuntimeError(f"backward(): this Tensor (shape {tuple(self.shape)}) does not require grad: no leaf "
                               "of its graph has requires_grad=True, so there is nothing to differentiate")
        if out_grad is None:
            out_grad = Tensor(array_api.full(self.shape, 1.0, dtype=self.dtype, device=self.device),
                              device=self.device, requires_grad=False)
        compute_gradient_of_variables(self, out_grad)

    def __repr__(self):
        return "needle.Tensor(" + str(self.realize_cached_data()) + ")"

    def __str__(self):
        return self.realize_cached_data().__str__()

    def numpy(self):
        data = self.realize_cached_data()
        return array_api.to_numpy(data)

    def __array__(self, dtype=None, copy=None):
        return numpy.asarray(self.numpy(), dtype=dtype)

    # ----- operators ------------------------------------------------------------------------------------------
    def __add__(self, other):
        return ops.EWiseAdd()(self, other) if isinstance(other, Tensor) else ops.AddScalar(other)(self)

    __radd__ = __add__

    def __sub__(self, other):
        if isinstance(other, Tensor):
            return ops.EWiseAdd()(self, ops.Negate()(other))
        return ops.AddScalar(-other)(self)

    def __rsub__(self, other):
        return ops.AddScalar(other)(ops.Negate()(self))

    def __mul__(self, other):
        return ops.EWiseMul()(self, other) if isinstance(other, Tensor) else ops.MulScalar(other)(self)

    __rmul__ = __mul__

    def __truediv__(self, other):
        return ops.EWiseDiv()(self, other) if isinstance(other, Tensor) else ops.DivScalar(other)(self)

    def __pow__(self, other):
        return ops.EWisePow()(self, other) if isinstance(other, Tensor) else ops.PowerScalar(other)(self)

    def __neg__(self):
        return ops.Negate()(self)

    def __matmul__(self, other):
        return ops.MatMul()(self, other)

    def matmul(self, other):
        return ops.MatMul()(self, other)

    def sum(self, axes=None):
        return ops.Summation(axes)(self)

    def astype(self, dtype):
        """This Tensor in `dtype` ("float32", "float16", "bfloat16", "int8", "uint8", "int32"): differentiable,
        the gradient is cast back. Itself when it already has that dtype."""
        return ops.cast(self, dtype)

    def broadcast_to(self, shape):
        return ops.BroadcastTo(shape)(self)

    def reshape(self, shape):
        return ops.Reshape(shape)(self)

    def transpose(self, axes=None):
        return ops.Transpose(axes)(self)

    def exp(self):
        return ops.Exp()(self)

    def log(self):
        return ops.Log()(self)

    __hash__ = object.__hash__


# ----- backward: a plan, then one loop that runs it ---------------------------------------------------------------
@dataclass
class Step:
    """One step of backward: differentiate `node` (a leaf: sum its gradient parts into `.grad`)."""

    node: "Value"
    recompute: list = field(default_factory=list)  # missing values its gradient reads, and their missing ancestors
    release: list = field(default_factory=list)  # forward values whose last use is this step: released after it


@dataclass
class BackwardPlan:
    """The whole backward pass as data: what to release first, then the steps in reverse topological order."""

    root: "Value"
    unused: list  # values no gradient reads: released before the first step (rule 3)
    steps: list

    def recomputed(self):
        return [n for step in self.steps for n in step.recompute]


def reads(node):
    """The forward values whose data `node.op.gradient` reads, as the op declares (`saves`)."""
    saves = node.op.saves
    return {"none": (), "output": (node,), "both": node.inputs + (node,)}.get(saves, node.inputs)


def plan_backward(root, has=None):
    """The backward plan of the graph above `root`, given which values exist when it starts (`has`).

    Simulates the pass in reverse topological order. Before a node's gradient, the values it reads must exist;
    missing ones, and the missing ancestors they need, are recomputed at that step and from then on count as
    available, so nothing is recomputed twice (rule 2). A value's last use is the last step that reads it or
    recomputes a consumer from it; it is released right after (rule 3). Leaves and the root are never released
    (rule 1).
    """
    has = has or _COMPUTE.has
    reverse = list(reversed(find_topo_sort([root])))
    available = {id(n) for n in reverse if has(n)}
    steps, last_use = [], {}
    for node in reverse:
        if not node.requires_grad:
            continue
        step = Step(node)
        steps.append(step)
        if node.is_leaf():
            continue
        needed = reads(node)
        for v in needed:
            last_use[id(v)] = step
        missing = [v for v in needed if id(v) not in available]
        for n in find_topo_sort(missing, expand=lambda n: id(n) not in available):
            if id(n) in available:
                continue
            available.add(id(n))  # rule 2: from now on it exists until its last use
            step.recompute.append(n)
            for inp in n.inputs:
                last_use[id(inp)] = step
    unused = []
    for node in reverse:
        if node.is_leaf() or node is root:
            continue
        if id(node) in last_use:
            last_use[id(node)].release.append(node)
        else:
            unused.append(node)
    return BackwardPlan(root, unused, steps)


def run_backward(plan, out_grad, machine=None):
    """Walk `plan`: recompute, differentiate, release. Gradients are graph nodes built lazily, realized per step.

    Each step's gradient graph is built lazily and realized together, so its temporaries die as soon as they are
    consumed; afterwards everything the step made is released unless a later step awaits it (rule 3).
    """
    machine = machine or Compute()
    forward = {id(s.node) for s in plan.steps} | {id(n) for s in plan.steps for n in s.node.inputs}
    grads = {id(plan.root): [out_grad]}
    awaited = {}  # gradient node id -> how many later steps will consume it
    for node in plan.unused:
        machine.free(node)
    for step in plan.steps:
        node = step.node
        for n in step.recompute:
            machine.recompute(n)
        parts = grads.pop(id(node), None)
        if parts is not None and len(parts) == 1 and node.is_leaf() and machine.has(parts[0]):
            machine.set_grad(node, parts[0])  # a parameter used once: its gradient is computed, nothing to free
        elif parts is not None:
            for g in parts:
                awaited[id(g)] = awaited.get(id(g), 0) - 1
            with lazy_mode(True):
                grad = sum_node_list(parts)
            walked = []
            if node.is_leaf():
                new = [grad]
                _realize(new, lambda n: n is grad, machine, walked)
                machine.set_grad(node, grad)
            else:
                machine.check_reads(node)
                with lazy_mode(True):
                    in_grads = node.op.gradient_as_tuple(grad, node)
                if len(in_grads) != len(node.inputs):
                    raise RuntimeError(f"{type(node.op).__name__}.gradient returned {len(in_grads)} values for "
                                       f"{len(node.inputs)} inputs")
                pairs = [(x, _in_dtype_of(x, g, node)) for x, g in zip(node.inputs, in_grads)
                         if x.requires_grad and g is not None]
                new = [g for _, g in pairs]
                keep_ids = {id(g) for g in new}
                _realize(new, lambda n: id(n) in keep_ids, machine, walked)
                for x, g in pairs:
                    grads.setdefault(id(x), []).append(g)
            for g in new:
                awaited[id(g)] = awaited.get(id(g), 0) + 1
            _free_step_temporaries(walked, new, parts, grad, forward, awaited, machine)
        for n in step.release:
            machine.free(n)


def _in_dtype_of(x, grad, node):
    """An input's gradient in the input's dtype: an op on mixed dtypes computes (and differentiates) in the
    promoted one, so the gradient of a bfloat16 input of a float32 op is cast back to bfloat16."""
    if not isinstance(grad, Tensor) or _dtype(x) == _dtype(node) or grad.dtype == x.dtype:
        return grad
    from .ops import cast

    with lazy_mode(True):
        return cast(grad, x.dtype)


def _dtype(value):
    data = value._data  # a forward value's array, when it has one (cheaper than the full spec)
    return data.dtype if data is not None and not isinstance(data, tuple) else value.dtype


def _free_step_temporaries(walked, new, parts, grad, forward, awaited, machine):
    """Free what a step made and consumed: its gradient graph's values, except the results later steps await.

    `walked` is the step's realization walk: every value it computed (released there unless kept) and, not
    expanded, the values that existed before it — forward values, the parts, leaves, and rarely a value the
    step made that a shape query computed early (an op that cannot infer its shape); only that last case needs
    a walk of its own, from those values and from `grad`, to reach what they hold.
    """
    part_ids = {id(g) for g in parts}
    new_ids = {id(g) for g in new}
    # A kept make_tuple of gradients holds its elements' data, and tuple arithmetic folds through it to the
    # element nodes later: releasing them would free nothing now and force a recomputation then.
    new_ids |= {id(x) for g in new if isinstance(g, TensorTuple) and g.op is not None and g.op.view for x in g.inputs}

    def made(n):  # made by this step (never a forward value or a part: expanding a part would re-walk every
        return id(n) not in forward and id(n) not in part_ids and not n.is_leaf()  # earlier step: O(n^2))

    early = [n for n in walked + [grad] if machine.has(n) and made(n) and id(n) not in new_ids]
    if early:
        early = find_topo_sort(early, expand=made)
    # The parts are listed too: summing tuple gradients folds them away (make_tuple's elements are used directly),
    # so the walk from the sum may not reach them, yet this step consumed them.
    for n in list(parts) + early:
        if id(n) not in forward and id(n) not in new_ids and not n.is_leaf() and awaited.get(id(n), 0) <= 0:
            machine.free(n)


_COMPUTE = Compute()  # realization outside backward (statistics unused)
_last_stats = {}


def last_backward_stats():
    """Statistics of the last backward pass: recomputed nodes and bytes, released bytes, the allocator's peak.

    `peak_bytes` is the device allocator's peak since its last reset (reset it when a step starts to read that
    step's peak: `backend_ndarray.reset_peak_memory_stats(device)`);
    `max_recomputes_per_node` is counted per node (rule 2 says it is at most 1).
    """
    return dict(_last_stats)


def compute_gradient_of_variables(output_tensor, out_grad):
    """Reverse-mode differentiation: fill `.grad` of every leaf above `output_tensor` that requires grad.

    Realizes the forward pass (lazy mode computes it here), plans the backward pass (`plan_backward`) and runs
    it (`run_backward`). Gradients are Tensors themselves (differentiable); each call replaces `.grad`, it does
    not accumulate.
    """
    if not isinstance(out_grad, Value):
        raise TypeError(f"backward(): out_grad must be a Tensor, got {type(out_grad).__name__}")
    if tuple(out_grad.shape) != tuple(output_tensor.shape):
        raise ValueError(f"backward(): out_grad has shape {tuple(out_grad.shape)}, but the output has shape "
                         f"{tuple(output_tensor.shape)}; they must be equal")
    if _deferred:  # decisions waiting for the whole graph (a Budget's), before anything more is computed
        _run_deferred(find_topo_sort([output_tensor]), [output_tensor], pending_only=False)
    output_tensor.realize_cached_data()  # the forward pass (in lazy mode it runs here)
    # Gradients are built from an out_grad that requires grad, so every gradient value is a graph node that
    # can be released after use and recomputed on demand (x.grad stays differentiable), never a stray constant.
    out_grad = Tensor.make_const(out_grad, requires_grad=True)
    device = device_of(output_tensor.cached_data)
    machine = Compute()
    run_backward(plan_backward(output_tensor), out_grad, machine)
    stats = dict(machine.stats)
    stats["peak_bytes"] = device.memory_stats()["peak_bytes"] if hasattr(device, "memory_stats") else None
    _last_stats.clear()
    _last_stats.update(stats)


def placeholder(spec, requires_grad=True):
    """A leaf Tensor with a shape, dtype and device (`spec`) but no data: a stand-in for a value to come."""
    value = Tensor.__new__(Tensor)
    value._init(None, [], requires_grad=requires_grad)
    value._spec = tuple(spec)
    return value


def _rebuild_tensor(cls, array, device, requires_grad):
    # The array's own dtype (a Tensor built from a NumPy array is float32 unless told otherwise).
    return cls(array, device=device, dtype=str(array.dtype), requires_grad=requires_grad)


def sum_node_list(node_list):
    """The sum of a list of Tensors, in list order (so float sums are the same run to run)."""
    total = node_list[0]
    for node in node_list[1:]:
        total = total + node
    return total


from . import ops  # noqa: E402  (ops needs the classes above)
