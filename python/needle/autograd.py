"""The computational graph: Values made by Ops, realized eagerly or lazily, differentiated in reverse order.

A Value is a handful of fields: the `op` that made it, its `inputs`, its `cached_data` (None until realized, or
after it was released), `requires_grad`, and `drop` (gradient checkpointing: do not keep this value after the
forward pass; recompute it during backward). Its `version` counts the in-place writes to its data (replacing it
through `.data =`, an optimizer's update, `t[idx] = ...`); backward compares it with the version the forward pass
read, so a value changed in between raises instead of giving a wrong gradient (rule 4 of checkpoint.py).
Every walk over the graph is the one iterative `find_topo_sort`.
The checkpointing rules (what is released when, what is recomputed) live in `checkpoint.py`.
"""
import contextlib

import numpy

from . import checkpoint
from .backend_selection import BACKEND, NDArray, array_api, default_device

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
]

# When True, ops only record the graph; values are computed when something asks for them.
LAZY_MODE = False
# The number of live graph values (course code checks it for leaks).
TENSOR_COUNTER = 0

last_backward_stats = checkpoint.last_backward_stats


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

    def workspace(self, *input_shapes):
        """Bytes `compute` allocates besides its result (temporaries), for checkpoint planning; usually 0."""
        return 0

    def __call__(self, *args):
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


def _realize(targets, keep):
    """Compute `targets` and every missing value they need, in topological order; return their values.

    A computed value is kept if `keep(node)`; otherwise it is released as soon as its last consumer in this
    realization has been computed (rule 3 of checkpoint.py). Targets are returned even if not kept.
    """
    order = find_topo_sort(targets, expand=lambda n: n.cached_data is None)
    consumers = {}
    for node in order:
        if node.cached_data is None:
            for inp in node.inputs:
                if inp.cached_data is None:
                    consumers[id(inp)] = consumers.get(id(inp), 0) + 1
    target_ids = {id(t) for t in targets}
    for node in order:
        if node.cached_data is not None:
            continue
        if node.op is None:
            raise RuntimeError("a leaf Tensor has no data (was it released?); leaves cannot be recomputed")
        value = node.op.compute(*[x.cached_data for x in node.inputs])
        if isinstance(value, numpy.generic):  # NEEDLE_BACKEND=np: NumPy turns 0-d results into scalars
            value = numpy.asarray(value)
        node.cached_data = value
        if node._input_versions is None:  # the first computation is the forward pass: what backward must see
            node._input_versions = tuple(x.version for x in node.inputs)
        for inp in node.inputs:
            left = consumers.get(id(inp))
            if left is not None:
                consumers[id(inp)] = left - 1
                if left == 1 and id(inp) not in target_ids and not keep(inp):
                    checkpoint.release(inp)
    values = [t.cached_data for t in targets]
    for t in targets:
        if not keep(t):
            checkpoint.release(t)
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
        specs = [x._spec if x.cached_data is None else checkpoint.spec_of(x.cached_data) for x in node.inputs]
        if not specs or any(s is None for s in specs):
            return
        shape = node.op.infer_shape(*[s[0] for s in specs])  # a tuple op's shape: a tuple of shapes
        if shape is None:
            return
        node._spec = (tuple(shape), specs[0][1], specs[0][2])


def _keep_forward(node):
    return not node.drop


class Value:
    """A node of the computational graph."""

    __slots__ = ("op", "inputs", "_data", "requires_grad", "drop", "grad", "_spec", "version", "_input_versions",
                 "__weakref__")

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

    def _spec_or_data(self):
        # A released value still knows its shape, dtype and device (recorded when it was released); an
        # unrealized one gets them from shape inference, and is computed only where an op cannot infer.
        if self.cached_data is None:
            if self._spec is None:
                _infer_specs(self)
            if self._spec is not None:
                return self._spec
        return checkpoint.spec_of(self.realize_cached_data())

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
                device = array.device if isinstance(array, NDArray) and BACKEND == "nd" else default_device()
            cached_data = Tensor._array_from_numpy(array, device=device, dtype=dtype)
        self._init(None, [], cached_data=cached_data, requires_grad=requires_grad)

    @staticmethod
    def _array_from_numpy(numpy_array, device, dtype):
        if BACKEND == "np":
            return numpy.array(numpy_array, dtype=dtype)
        if dtype not in (None, "float32", "bool", numpy.float32, bool):
            raise TypeError(f"Tensor: the '{BACKEND}' backend stores float32 only, got dtype {dtype!r}")
        if isinstance(numpy_array, NDArray):
            return numpy_array if numpy_array.device == device else numpy_array.to(device)
        return array_api.array(numpy_array, device=device)

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
        return data if BACKEND == "np" else data.numpy()

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


def compute_gradient_of_variables(output_tensor, out_grad):
    """Reverse-mode differentiation: fill `.grad` of every leaf above `output_tensor` that requires grad.

    Runs the plan of `checkpoint.BackwardPlan`: before each node's gradient it recomputes the dropped values
    that gradient reads, and after it releases every value whose last backward use has passed. Gradients are
    Tensors themselves (differentiable); each call replaces `.grad`, it does not accumulate.
    """
    if not isinstance(out_grad, Value):
        raise TypeError(f"backward(): out_grad must be a Tensor, got {type(out_grad).__name__}")
    if tuple(out_grad.shape) != tuple(output_tensor.shape):
        raise ValueError(f"backward(): out_grad has shape {tuple(out_grad.shape)}, but the output has shape "
                         f"{tuple(output_tensor.shape)}; they must be equal")
    output_tensor.realize_cached_data()  # the forward pass (in lazy mode it runs here)
    # Gradients are built from an out_grad that requires grad, so every gradient value is a graph node that
    # can be released after use and recomputed on demand (x.grad stays differentiable), never a stray constant.
    out_grad = Tensor.make_const(out_grad, requires_grad=True)
    reverse_topo = list(reversed(find_topo_sort([output_tensor])))
    plan = checkpoint.BackwardPlan(reverse_topo, output_tensor)
    grads = {id(output_tensor): [out_grad]}
    plan.release_unused()
    for step, node in enumerate(reverse_topo):
        parts = grads.pop(id(node), None)
        if parts is not None:
            plan.consume(parts)
            if node.is_leaf():
                with lazy_mode(True):
                    grad = sum_node_list(parts)
                _realize([grad], lambda n: n is grad)
                node.grad = grad
                plan.release_gradient_temporaries([grad], parts, grad)
            else:
                plan.recompute(step)
                saves = node.op.saves
                checkpoint.check_unchanged(node, inputs=saves in ("inputs", "both"), output=saves in ("output", "both"))
                # Built lazily and realized together, so each temporary dies as soon as it has been consumed.
                with lazy_mode(True):
                    grad = sum_node_list(parts)
                    in_grads = node.op.gradient_as_tuple(grad, node)
                if len(in_grads) != len(node.inputs):
                    raise RuntimeError(f"{type(node.op).__name__}.gradient returned {len(in_grads)} values for "
                                       f"{len(node.inputs)} inputs")
                new = [g for inp, g in zip(node.inputs, in_grads) if inp.requires_grad and g is not None]
                keep_ids = {id(g) for g in new}
                _realize(new, lambda n: id(n) in keep_ids)
                for inp, g in zip(node.inputs, in_grads):
                    if inp.requires_grad and g is not None:
                        grads.setdefault(id(inp), []).append(g)
                plan.release_gradient_temporaries(new, parts, grad)
        plan.release(step)
    plan.finish()


def _rebuild_tensor(cls, array, device, requires_grad):
    return cls(array, device=device, requires_grad=requires_grad)


def sum_node_list(node_list):
    """The sum of a list of Tensors, in list order (so float sums are the same run to run)."""
    total = node_list[0]
    for node in node_list[1:]:
        total = total + node
    return total


from . import ops  # noqa: E402  (ops needs the classes above)
