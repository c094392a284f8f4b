"""Ops on TensorTuples: building one, taking an element, and stack/split between a Tensor and a tuple."""
from ..autograd import Tensor, TensorOp, TensorTuple, TensorTupleOp, element_dtype
from ..backend_selection import array_api
from .ops_mathematic import broadcast_to, reshape, summation

__all__ = ["MakeTensorTuple", "Split", "Stack", "TupleGetItem", "make_tuple", "split", "stack", "tuple_get_item"]


class MakeTensorTuple(TensorTupleOp):
    """(a_1, ..., a_n) -> a TensorTuple;  d/da_i = out_grad[i]"""

    saves = "none"
    view = True

    def infer_shape(self, *shapes):
        return shapes

    def compute(self, *args):
        return tuple(args)

    def gradient(self, out_grad, node):
        return tuple(out_grad[i] for i in range(len(node.inputs)))


def make_tuple(*args):
    return MakeTensorTuple()(*args)


class TupleGetItem(TensorOp):
    """t -> t[index];  the gradient is out_grad at `index` and zeros elsewhere"""

    saves = "none"
    view = True

    def __init__(self, index):
        self.index = index

    def __call__(self, a, fold_const=True):
        if not isinstance(a, TensorTuple):
            raise TypeError(f"TupleGetItem: input must be a TensorTuple, got {type(a).__name__}")
        # Taking an element of a make_tuple(...) is the element itself: no node needed.
        if fold_const and isinstance(a.op, MakeTensorTuple):
            return a.inputs[self.index]
        return Tensor.make_from_op(self, [a])

    def infer_shape(self, shapes):
        return shapes[self.index]

    def infer_dtype(self, dtype):
        return element_dtype(dtype, self.index)

    def compute(self, a):
        return a[self.index]

    def gradient(self, out_grad, node):
        # The other elements get zeros: a broadcast view of one zero derived from out_grad, so the gradient
        # graph holds no constant buffers (and stays differentiable).
        zero = summation(out_grad) * 0.0
        grads = [
            out_grad if i == self.index else broadcast_to(reshape(zero, (1,) * len(shape)), shape)
            for i, shape in enumerate(node.inputs[0].shape)
        ]
        return (make_tuple(*grads),)


def tuple_get_item(value, index):
    return TupleGetItem(index)(value)


class Stack(TensorOp):
    """(a_1, ..., a_n) -> one array with a new axis `axis`;  the gradient splits out_grad along it"""

    saves = "none"

    def __init__(self, axis):
        self.axis = axis

    def infer_shape(self, shapes):
        if not shapes or len(set(shapes)) != 1 or not -len(shapes[0]) - 1 <= self.axis <= len(shapes[0]):
            return None  # compute raises the error
        axis = self.axis % (len(shapes[0]) + 1)
        return shapes[0][:axis] + (len(shapes),) + shapes[0][axis:]

    def compute(self, args):
        if not args:
            raise ValueError("stack: needs at least one array")
        shapes = {tuple(a.shape) for a in args}
        if len(shapes) != 1:
            raise ValueError(f"Stack: all inputs need one shape, got {[tuple(a.shape) for a in args]}")
        return array_api.stack(args, axis=self.axis)

    def gradient(self, out_grad, node):
        return (split(out_grad, self.axis),)


def stack(args, axis):
    return Stack(axis)(make_tuple(*args))


class Split(TensorTupleOp):
    """a -> the tuple of its slices along `axis` (that axis removed);  the gradient stacks them back"""

    saves = "none"

    def __init__(self, axis):
        self.axis = axis

    def infer_shape(self, shape):
        if not -len(shape) <= self.axis < len(shape):
            return None  # compute raises the error
        axis = self.axis % len(shape)
        return (shape[:axis] + shape[axis + 1:],) * shape[axis]

    def compute(self, A):
        return tuple(array_api.split(A, axis=self.axis))

    def gradient(self, out_grad, node):
        return (stack([out_grad[i] for i in range(len(out_grad))], self.axis),)


def split(a, axis):
    return Split(axis)(a)
