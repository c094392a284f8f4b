"""The computational graph: Values made by Ops, realized eagerly or lazily, differentiated by backward.py.

Read it top to bottom: the two global switches (lazy mode, autocast); the op base, whose subclasses declare the
memory facts that checkpointing reads; the graph node, a handful of fields (`op`, `inputs`, `cached_data`,
`requires_grad`, `drop`: gradient checkpointing's "do not keep this value after the forward pass") and its
subclasses TensorTuple and Tensor; the one traversal, `find_topo_sort`; then realization, which computes missing
values through a `Machine`: `Compute` (backward.py) does the work, checkpoint_budget's `Ledger` only counts
bytes, so what the Budget predicts and what runs cannot drift apart. A value's `version` counts the in-place
writes to its data; a node records its inputs' versions when it is built, and computing it (lazily, or again
after its value was released) or differentiating it compares them (rule 4c, backward.py): a value, once
computed, reads the same forever, or raises saying why it cannot.
"""
import contextlib
import weakref
from typing import Protocol

import numpy

from .backend_selection import NDArray, array_api, default_device, device_of
from .specs import element_dtype, element_shapes, elements_of, itemsize, nbytes_of, spec_nbytes, spec_of

__all__ = ["LAZY_MODE", "TENSOR_COUNTER", "BackwardPlan", "Compute", "Machine", "Op", "Step", "Tensor", "TensorOp",
           "TensorTuple", "TensorTupleOp", "Value", "active_autocast", "compute_gradient_of_variables",
           "defer_until_backward", "element_dtype", "element_shapes", "elements_of", "find_topo_sort", "infer_spec",
           "itemsize", "last_backward_stats", "lazy_mode", "nbytes_of", "placeholder", "plan_backward", "reads",
           "realize", "release", "run_backward", "run_deferred", "set_autocast", "spec_nbytes", "spec_of"]

LAZY_MODE = False  # when True, ops only record the graph; values are computed when something asks for them
# Mixed precision: the active `needle.amp.autocast` context or None, set only by `set_autocast`, read only when an
# op is applied (like LAZY_MODE): the casts it asks for become graph nodes, so a recomputation replays them exactly.
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


def set_autocast(context):
    """Make `context` (a `needle.amp.autocast`, or None for none) the active autocast; return the previous one."""
    global AUTOCAST
    previous, AUTOCAST = AUTOCAST, context
    return previous


def active_autocast():
    """The active `needle.amp.autocast` context, or None."""
    return AUTOCAST


class Op:
    """An operator: `compute` on raw arrays, `gradient` on Tensors (a differentiable graph itself)."""

    # ----- memory facts: what checkpointing's policies, the backward plan and the Budget's ledger read ---------
    # Which forward values `gradient` reads — "inputs", "output", "both" or "none" (shapes are always
    # available). The backward plan keeps exactly these alive, and recomputes them if they were dropped.
    saves = "inputs"
    saveable = False  # expensive to recompute (matmul, conv): the "selective" policy keeps it
    view = False  # the output lives in its input's buffer (when `view_strides` says so), or a tuple's
    compacts_inputs = False  # compute copies a strided operand into a compact one first (True, or input positions)
    recomputable = True  # False: computing it again would repeat a collective, so checkpointing never drops it

    def view_strides(self, shape, strides, out_shape):
        """For a view op: the output's element strides given its input's, or None where compute must copy."""
        return None

    def workspace(self, *input_shapes):
        """Elements `compute` allocates besides its result (temporaries), for the Budget's ledger; usually 0."""
        return 0

    def workspace_16bit(self, *input_shapes):
        """Elements compute allocates besides `workspace` in 16 bits, whose entry points copy a broadcast first."""
        return 0

    def reads_transposed(self, *input_shapes):
        """Whether compute reads an input that is a whole compact matrix's transpose where it is (a 2-D matmul packs
        it transposed) instead of compacting it, for the Budget's ledger."""
        return False
    # ----- end of the memory facts ----------------------------------------------------------------------------

    # Under `needle.amp.autocast(dtype)`: "low" ops get their floating inputs cast to the 16-bit dtype (the
    # matmuls, convolutions and element-wise arithmetic), "float32" ops get them cast to float32 (reductions,
    # softmax, log-sum-exp, the losses: where bf16/fp16 rounding would cost accuracy); None runs in whatever
    # dtype its inputs have. Applied by `__call__` (`_autocast_inputs`).
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

    def _autocast_inputs(self, args):
        return AUTOCAST.cast_inputs(self, args) if AUTOCAST is not None and self.autocast is not None else args


class TensorOp(Op):
    """An op whose output is a Tensor."""

    # Shape inference lets a lazy graph be built without computing it (layers read their inputs' shapes):
    # element-wise ops keep their first input's shape; others override `infer_shape`; None means "compute it".
    elementwise = False

    def infer_shape(self, *input_shapes):
        return input_shapes[0] if self.elementwise else None

    def __call__(self, *args):
        return Tensor.make_from_op(self, self._autocast_inputs(args))


class TensorTupleOp(Op):
    """An op whose output is a TensorTuple (its shape: a tuple of its elements' shapes)."""

    def infer_shape(self, *input_shapes):
        return None

    def __call__(self, *args):
        return TensorTuple.make_from_op(self, self._autocast_inputs(args))


class Value:
    """A node of the computational graph."""

    __slots__ = ("op", "inputs", "_data", "requires_grad", "drop", "boundary", "store", "stored", "grad", "_spec",
                 "version", "_input_versions", "_released", "_grad_hooks", "optimizer", "__weakref__")

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

        A dropped node's value is computed and returned but not kept; a value a store holds (store.py: a gradient
        kept in host memory, say) is brought back from it.
        """
        if self.cached_data is None:
            if memory_hook.PREDICTOR is not None:
                memory_hook.PREDICTOR.refuse_value(self)  # a dry run computes nothing
            if self.stored is not None:
                self.cached_data = self.store.get(self, self.stored)
                self.store.ready()
                return self.cached_data
            return realize([self], _keep_forward)[0]
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
        self.drop = False  # checkpointing: not kept in memory after its last forward use
        self.boundary = False  # a layer's output inside a stack: recomputed, held until its last use (backward.py)
        self.store = self.stored = None  # where its value goes when it leaves memory, and what holds it (store.py)
        self.grad = None
        self._spec = None
        self.version = 0
        self._input_versions = tuple(x.version for x in inputs)  # what its value is a function of (rule 4c)
        self._released = False  # its value was computed, then released: a missing value is one to recompute
        self._grad_hooks = None  # callables run when backward sets this leaf's .grad (register_grad_hook)
        self.optimizer = None  # the optimizer that updates this leaf inside backward (in_backward=True)
        if memory_hook.RECORDER is not None:
            memory_hook.RECORDER.node_made(self)  # needle.memory: its module, or what its data is

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
            if memory_hook.PREDICTOR is not None:  # a dry run traces an eager step lazily, and walks it as eager
                return memory_hook.PREDICTOR.eager_op(value)
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
        return ops.tuple_get_item(self, index)

    def tuple(self):
        return tuple(self[i] for i in range(len(self)))

    def __repr__(self):
        return "needle.TensorTuple" + str(self.tuple())

    __str__ = __repr__

    def __add__(self, other):
        if not isinstance(other, TensorTuple) or len(self) != len(other):
            raise ValueError("TensorTuple add: both operands must be TensorTuples of one length")
        return ops.make_tuple(*[self[i] + other[i] for i in range(len(self))])

    def detach(self):
        return TensorTuple.make_const(self.realize_cached_data())


class Tensor(Value):
    """An n-dimensional array in the graph: a leaf (data) or the output of a TensorOp."""

    __slots__ = ()

    def __init__(self, array, *, device=None, dtype=None, requires_grad=True, **unknown):
        if unknown:  # (the course's signature takes **kwargs; a misspelt keyword must not pass silently)
            raise TypeError(f"Tensor: unknown keyword argument(s) {', '.join(map(repr, unknown))}; it takes "
                            f"device, dtype and requires_grad")
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
            dry = memory_hook.PREDICTOR is not None and not isinstance(array, NDArray)  # a dry run: a spec, no data
            cached_data = None if dry else Tensor._array_from_numpy(array, device=device, dtype=dtype)
        self._init(None, [], cached_data=cached_data, requires_grad=requires_grad)
        if cached_data is None:
            self._spec = memory_hook.PREDICTOR.constant(self, numpy.shape(array), dtype, device)

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
        if memory_hook.PREDICTOR is not None:  # ndl.memory.predict: walked, not computed
            return memory_hook.PREDICTOR.backward(self, out_grad)
        if out_grad is None:
            out_grad = Tensor(array_api.full(self.shape, 1, dtype=self.dtype, device=self.device), requires_grad=False)
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

    matmul = __matmul__

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


def placeholder(spec, requires_grad=True):
    """A leaf Tensor with a shape, dtype and device (`spec`) but no data: a stand-in for a value to come."""
    value = Tensor.__new__(Tensor)
    value._init(None, [], requires_grad=requires_grad)
    value._spec = tuple(spec)
    return value


def _rebuild_tensor(cls, array, device, requires_grad):
    # The array's own dtype (a Tensor built from a NumPy array is float32 unless told otherwise).
    return cls(array, device=device, dtype=str(array.dtype), requires_grad=requires_grad)


# ----- the traversal ----------------------------------------------------------------------------------------------
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


# ----- values in memory: releasing one (its spec and bytes: specs.py) ---------------------------------------------
def release(node, last_use=False):
    """Forget a node's value (it can be recomputed from its inputs); remember its shape, dtype and device.

    A node with a store (store.py) is put there first, once, unless this is its `last_use` (backward's release);
    the stored copy is let go at its last use.
    """
    if node.stored is not None and last_use:
        node.store.discard(node, node.stored)
        node.stored = None
    elif node.store is not None and node.stored is None and node.cached_data is not None and not last_use:
        node.stored = node.store.put(node)
        store.note_used(node.store)
    if node.cached_data is not None:
        node._spec = spec_of(node.cached_data)
        node.cached_data = None
        node._released = True


def _infer_specs(target):
    """Fill `_spec` (shape, dtype, device) of `target` and its unrealized ancestors without computing them.

    Stops (leaving `_spec` None) at the first op that cannot infer its shape; the caller then computes.
    """
    if all(x.cached_data is not None or x._spec is not None for x in target.inputs):
        order = [target]  # the usual case (a value built from known ones, as each gradient is): no traversal
    else:
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


# ----- realization: computing missing values through a machine ---------------------------------------------------
class Machine(Protocol):
    """Who runs realization and backward: `realize` and `backward.run_backward` are written once against this.

    `backward.Compute` computes, checks and releases values for real; `checkpoint_budget.Ledger` computes nothing
    and counts the bytes the same walk would hold, so the Budget's prediction follows the executor step by step.
    """

    def has(self, node) -> bool:
        """Whether `node`'s value exists (on this machine)."""

    def compute(self, node) -> None:
        """Make `node`'s value from its inputs' (which exist)."""

    def recompute(self, node, passing=False) -> None:
        """Make again, in backward, a value the forward pass made and released (checked: rule 4, backward.py);
        `passing`: only on the way to a stack's boundary, released again within the step."""

    def bring_back(self, node) -> None:
        """Bring back, in backward, a value its store holds (store.py). It may be read only after the next
        `ready()` (the store may still be filling it)."""

    def ready(self) -> None:
        """Wait until the values brought back so far may be read."""

    def check_reads(self, node) -> None:
        """Check that the forward values `node`'s gradient reads are still those the forward pass read."""

    def release(self, node) -> None:
        """Give `node`'s value back (a released value can be recomputed); its last release if `in_backward`."""

    def set_grad(self, node, grad) -> None:
        """Set a leaf's gradient: `grad`, complete."""

    def update(self, node) -> None:
        """Update parameter `node` by its optimizer (in backward, its gradient final), its gradient released."""

    def value(self, node):
        """`node`'s value (a raw array), or None where the machine holds no data."""


# Deferred decisions, keyed weakly by node (a graph that is never differentiated takes its callbacks with it).
_deferred = weakref.WeakKeyDictionary()


def defer_until_backward(node, callback):
    """Call `callback(roots)` once, when a backward pass through `node` begins: before anything more of a lazy
    graph is computed, with the whole graph in view. `roots` are the values backward starts from.

    The one moment a policy that decides from the whole graph decides: checkpoint_budget.Budget plans there.
    """
    _deferred.setdefault(node, []).append(callback)  # (several policies may wait on one value)


def run_deferred(roots):
    """Run the callbacks deferred on values above `roots`, each once: backward's first act. Call it yourself before
    reading a value of a lazy graph you will differentiate (`loss.numpy()` before `loss.backward()`), or its forward
    is computed before those decisions are made."""
    if not _deferred:
        return
    for node in find_topo_sort(roots):
        for callback in _deferred.pop(node, ()):
            callback(roots)


def last_consumers(order, computed):
    """For a topological `order` of values to compute: position -> the inputs whose last consumer sits there.

    Only values computed in this walk (not `computed` beforehand) are listed: they are the ones a walk may
    release. This is the one "count the consumers, release at zero" loop: realization and the ledger use it.
    """
    last = {}
    for i, node in enumerate(order):
        if not computed(node):
            for inp in node.inputs:
                if not computed(inp):
                    last[id(inp)] = (i, inp)
    releases = {}
    for i, inp in last.values():
        releases.setdefault(i, []).append(inp)
    return releases


def realize(targets, keep, machine=None, walked=None):
    """Compute `targets` and every missing value they need, in topological order; return their values.

    A computed value is kept if `keep(node)`; otherwise it is released as soon as its last consumer in this
    realization has been computed (rule 3, backward.py). Targets are returned even if not kept. The walk's
    order (the values computed, and unexpanded, the existing values they read) is appended to `walked` if given.
    """
    machine = machine or _COMPUTE
    order = find_topo_sort(targets, expand=lambda n: not machine.has(n))
    if walked is not None:
        walked.extend(order)
    releases = last_consumers(order, machine.has)
    target_ids = {id(t) for t in targets}
    for i, node in enumerate(order):
        if machine.has(node):
            continue
        if node.op is None:
            raise RuntimeError("a leaf Tensor has no data (was it released?); leaves cannot be recomputed")
        machine.compute(node)
        for inp in releases.get(i, ()):
            if id(inp) not in target_ids and not keep(inp):
                machine.release(inp)
    values = [machine.value(t) for t in targets]
    for t in targets:
        if not keep(t):
            machine.release(t)
    return values


def _keep_forward(node):
    return not node.drop


# ops and backward need the classes above; backward's public names are re-exported here (the course's API).
from . import memory_hook, ops, store  # noqa: E402
from .backward import (  # noqa: E402
    BackwardPlan, Compute, Step, compute_gradient_of_variables, last_backward_stats, plan_backward, reads,
    run_backward,
)

_COMPUTE = Compute()  # the machine of realization outside backward (its statistics unused)
