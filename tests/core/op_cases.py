"""The table of op gradient cases, at least one per op class in `needle.ops` (the fused ops excepted: they have their
own test files). test_autograd.py runs each case in float32 on the NumPy reference device (tests/backend's
test_autograd_compiled.py on the compiled ones); np_backend_checks.py runs the same table in float64 under
NEEDLE_BACKEND=np. BINARY_OPS: the element-wise binary ops and their NumPy functions, which broadcast under
NEEDLE_BACKEND=np (np_backend_checks.py) and require equal shapes on NDArrays (test_np_broadcast.py).
"""
import math
from collections import namedtuple

import numpy as np

import needle as ndl
from needle import ops

__all__ = ["BINARY_OPS", "OP_CASES", "OpCase"]

# op: the op class name the case covers; fn: Tensors -> Tensor; make(rng) -> the input arrays (float64);
# ref: the forward in NumPy (None where the forward is checked elsewhere, e.g. test_ndarray.py).
OpCase = namedtuple("OpCase", "op fn make ref")


def _n(*shape):
    return lambda rng: rng.standard_normal(shape)


def _pos(*shape):
    return lambda rng: rng.uniform(0.5, 2.0, shape)


def _nonzero(*shape):
    # |x| >= 0.3: away from the kinks of relu and the pole of 1/x
    return lambda rng: rng.uniform(0.3, 1.5, shape) * rng.choice([-1.0, 1.0], shape)


def _normal_cdf(a):
    return 0.5 * (1 + np.vectorize(math.erf)(a / math.sqrt(2)))


def _inputs(*makers):
    return lambda rng: [m(rng) for m in makers]


def _conv_ref(z, w, stride, padding):
    z = np.pad(z, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    N, H, W, _ = z.shape
    K, _, _, C_out = w.shape
    Ho, Wo = (H - K) // stride + 1, (W - K) // stride + 1
    out = np.zeros((N, Ho, Wo, C_out))
    for i in range(K):
        for j in range(K):
            out += z[:, i:i + stride * Ho:stride, j:j + stride * Wo:stride, :] @ w[i, j]
    return out


def _lse_ref(axes):
    def ref(z):
        m = z.max(axis=axes, keepdims=True)
        return (np.log(np.exp(z - m).sum(axis=axes, keepdims=True)) + m).squeeze(axis=axes)
    return ref


def _gather(ids):
    def fn(table):
        return ops.gather_rows(table, ndl.Tensor(np.array(ids, dtype=np.float64), device=table.device,
                                                  requires_grad=False))
    return fn


def _scatter(ids, num_rows):
    def fn(rows):
        return ops.scatter_add_rows(rows, ndl.Tensor(np.array(ids, dtype=np.float64), device=rows.device,
                                                     requires_grad=False), num_rows)
    return fn


def _pick(ids):
    def fn(a):
        return ops.pick_columns(a, ndl.Tensor(np.array(ids, dtype=np.float64), device=a.device, requires_grad=False))
    return fn


def _labels(ids, like):
    return ndl.Tensor(np.array(ids, dtype=np.float64), device=like.device, requires_grad=False)


def _xent(ids):
    return lambda z: ops.softmax_cross_entropy(z, _labels(ids, z))


def _xent_ref(z, ids):
    m = z.max(axis=1)
    return m + np.log(np.exp(z - m[:, None]).sum(axis=1)) - z[np.arange(len(ids)), ids]


def _xent_grad(ids):
    """The fused gradient as an op of its own (its gradient is what a second derivative of the loss uses)."""
    return lambda z, g: ops.SoftmaxCrossEntropyGrad()(z, _labels(ids, z), g)


def _scatter_columns(ids, num_cols):
    def fn(values):
        return ops.scatter_columns(values, ndl.Tensor(np.array(ids, dtype=np.float64), device=values.device,
                                                      requires_grad=False), num_cols)
    return fn


def _split_combine(a):
    parts = ndl.split(a, 1)
    return parts[0] * 2.0 + parts[1] * parts[2] - parts[3]


def _tuple_items(a, b):
    t = ndl.make_tuple(a, b)
    first = ops.TupleGetItem(0)(t, fold_const=False)  # no folding: the TupleGetItem node itself is differentiated
    second = ops.TupleGetItem(1)(t, fold_const=False)
    return first * second + first


def _conv_case(N, H, C, C_out, K, stride, padding):
    return OpCase("Conv", lambda z, w: ndl.conv(z, w, stride=stride, padding=padding),
                  _inputs(_n(N, H, H, C), _n(K, K, C, C_out)),
                  lambda z, w: _conv_ref(z, w, stride, padding))


OP_CASES = {
    "add": OpCase("EWiseAdd", lambda a, b: a + b, _inputs(_n(3, 4), _n(3, 4)), lambda a, b: a + b),
    "add_fn": OpCase("EWiseAdd", ndl.add, _inputs(_n(2, 3, 2), _n(2, 3, 2)), lambda a, b: a + b),
    "add_scalar": OpCase("AddScalar", lambda a: a + 1.5, _inputs(_n(3, 4)), lambda a: a + 1.5),
    "add_scalar_fn": OpCase("AddScalar", lambda a: ndl.add_scalar(a, -2), _inputs(_n(5,)), lambda a: a - 2),
    "sub": OpCase("Negate", lambda a, b: a - b, _inputs(_n(3, 4), _n(3, 4)), lambda a, b: a - b),
    "rsub": OpCase("AddScalar", lambda a: 2.0 - a, _inputs(_n(3, 4)), lambda a: 2 - a),
    "mul": OpCase("EWiseMul", lambda a, b: a * b, _inputs(_n(3, 4), _n(3, 4)), lambda a, b: a * b),
    "mul_self": OpCase("EWiseMul", lambda a: a * a, _inputs(_n(3, 4)), lambda a: a * a),
    "mul_scalar": OpCase("MulScalar", lambda a: 3 * a, _inputs(_n(3, 4)), lambda a: 3 * a),
    "mul_scalar_fn": OpCase("MulScalar", lambda a: ndl.mul_scalar(a, -0.5), _inputs(_n(4,)), lambda a: -0.5 * a),
    "power": OpCase("EWisePow", ndl.power, _inputs(_pos(3, 4), _n(3, 4)), np.power),
    "power_scalar": OpCase("PowerScalar", lambda a: a**3, _inputs(_n(3, 4)), lambda a: a**3),
    "power_scalar_neg": OpCase("PowerScalar", lambda a: ndl.power_scalar(a, -1.5), _inputs(_pos(3, 4)),
                               lambda a: a**-1.5),
    "power_scalar_half": OpCase("PowerScalar", lambda a: a**0.5, _inputs(_pos(2, 5)), np.sqrt),
    "divide": OpCase("EWiseDiv", lambda a, b: a / b, _inputs(_n(3, 4), _nonzero(3, 4)), lambda a, b: a / b),
    "divide_fn": OpCase("EWiseDiv", ndl.divide, _inputs(_nonzero(2, 3), _nonzero(2, 3)), lambda a, b: a / b),
    "divide_scalar": OpCase("DivScalar", lambda a: a / 4.0, _inputs(_n(3, 4)), lambda a: a / 4),
    "divide_scalar_fn": OpCase("DivScalar", lambda a: ndl.divide_scalar(a, -3), _inputs(_n(3,)), lambda a: a / -3),
    "negate": OpCase("Negate", lambda a: -a, _inputs(_n(3, 4)), lambda a: -a),
    "negate_fn": OpCase("Negate", ndl.negate, _inputs(_n(2, 2)), lambda a: -a),
    "matmul": OpCase("MatMul", lambda a, b: a @ b, _inputs(_n(3, 4), _n(4, 5)), np.matmul),
    "matmul_vector_like": OpCase("MatMul", ndl.matmul, _inputs(_n(1, 7), _n(7, 1)), np.matmul),
    "matmul_batched": OpCase("MatMul", ndl.matmul, _inputs(_n(2, 3, 4), _n(2, 4, 5)), np.matmul),
    "matmul_broadcast_lhs": OpCase("MatMul", ndl.matmul, _inputs(_n(6, 6, 5, 4), _n(4, 3)), np.matmul),
    "matmul_broadcast_rhs": OpCase("MatMul", ndl.matmul, _inputs(_n(5, 4), _n(6, 6, 4, 3)), np.matmul),
    "matmul_broadcast_ones": OpCase("MatMul", ndl.matmul, _inputs(_n(2, 1, 3, 4), _n(3, 4, 2)), np.matmul),
    "summation_all": OpCase("Summation", ndl.summation, _inputs(_n(3, 4, 5)), np.sum),
    "summation_int": OpCase("Summation", lambda a: ndl.summation(a, axes=1), _inputs(_n(3, 4, 5)),
                            lambda a: a.sum(axis=1)),
    "summation_neg": OpCase("Summation", lambda a: a.sum(-1), _inputs(_n(3, 4, 5)), lambda a: a.sum(axis=-1)),
    "summation_tuple": OpCase("Summation", lambda a: ndl.summation(a, axes=(0, 2)), _inputs(_n(3, 4, 5)),
                              lambda a: a.sum(axis=(0, 2))),
    "summation_tuple_unsorted": OpCase("Summation", lambda a: ndl.summation(a, axes=(2, 0)),
                                       _inputs(_n(3, 4, 5)), lambda a: a.sum(axis=(0, 2))),
    "broadcast_cols": OpCase("BroadcastTo", lambda a: ndl.broadcast_to(a, (3, 4)), _inputs(_n(3, 1)),
                             lambda a: np.broadcast_to(a, (3, 4))),
    "broadcast_rows": OpCase("BroadcastTo", lambda a: a.broadcast_to((3, 4)), _inputs(_n(1, 4)),
                             lambda a: np.broadcast_to(a, (3, 4))),
    "broadcast_lead": OpCase("BroadcastTo", lambda a: ndl.broadcast_to(a, (2, 3, 4)), _inputs(_n(4,)),
                             lambda a: np.broadcast_to(a, (2, 3, 4))),
    "broadcast_mixed": OpCase("BroadcastTo", lambda a: ndl.broadcast_to(a, (4, 2, 5, 3)), _inputs(_n(2, 1, 3)),
                              lambda a: np.broadcast_to(a, (4, 2, 5, 3))),
    "broadcast_same": OpCase("BroadcastTo", lambda a: ndl.broadcast_to(a, (1, 3)), _inputs(_n(1, 3)),
                             lambda a: a),
    "reshape": OpCase("Reshape", lambda a: ndl.reshape(a, (2, 6)), _inputs(_n(3, 4)), lambda a: a.reshape(2, 6)),
    "reshape_method": OpCase("Reshape", lambda a: a.reshape((4, 6)), _inputs(_n(2, 3, 4)),
                             lambda a: a.reshape(4, 6)),
    "reshape_of_transpose": OpCase("Reshape", lambda a: ndl.reshape(ndl.transpose(a), (12,)),
                                   _inputs(_n(3, 4)), lambda a: a.T.reshape(12)),
    "transpose_default": OpCase("Transpose", ndl.transpose, _inputs(_n(2, 3, 4)), lambda a: a.swapaxes(1, 2)),
    "transpose_pair": OpCase("Transpose", lambda a: ndl.transpose(a, (0, 2)), _inputs(_n(2, 3, 4)),
                             lambda a: a.swapaxes(0, 2)),
    "transpose_method": OpCase("Transpose", lambda a: a.transpose((1, 0)), _inputs(_n(3, 5)), lambda a: a.T),
    "log": OpCase("Log", ndl.log, _inputs(_pos(3, 4)), np.log),
    "exp": OpCase("Exp", ndl.exp, _inputs(_n(3, 4)), np.exp),
    "relu": OpCase("ReLU", ndl.relu, _inputs(_nonzero(3, 4)), lambda a: np.maximum(a, 0)),
    "relu_mask": OpCase("ReLUMask", lambda a: ops.relu_mask(a) * a, _inputs(_nonzero(3, 4)), lambda a: (a > 0) * a),
    "tanh": OpCase("Tanh", ndl.tanh, _inputs(_n(3, 4)), np.tanh),
    # A cast to the input's own dtype (an exact copy): the op and its gradient in the float64 oracle too; the
    # rounding casts are tested in test_precision.py.
    "cast": OpCase("Cast", lambda a: ops.Cast(a.dtype)(a) * a, _inputs(_n(3, 4)), lambda a: a * a),
    "sigmoid": OpCase("Sigmoid", ndl.sigmoid, _inputs(_n(3, 4)), lambda a: 1 / (1 + np.exp(-a))),
    "gelu": OpCase("GELU", ops.gelu, _inputs(_n(3, 4)), lambda a: a * _normal_cdf(a)),
    "gelu_tanh": OpCase("GELU", lambda a: ops.gelu(a, approximate="tanh"), _inputs(_n(3, 4)),
                        lambda a: 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))),
    "silu": OpCase("SiLU", ops.silu, _inputs(_n(3, 4)), lambda a: a / (1 + np.exp(-a))),
    # g · f'(x), the activations' gradients as ops of their own (differentiable: f'' from ops)
    "gelu_grad": OpCase("ActivationGrad", lambda x, g: ops.ActivationGrad("gelu")(x, g), _inputs(_n(3, 4), _n(3, 4)),
                        lambda x, g: g * (_normal_cdf(x) + x * np.exp(-x * x / 2) / math.sqrt(2 * math.pi))),
    "gelu_tanh_grad": OpCase("ActivationGrad", lambda x, g: ops.ActivationGrad("gelu_tanh")(x, g),
                             _inputs(_n(3, 4), _n(3, 4)), None),
    "silu_grad": OpCase("ActivationGrad", lambda x, g: ops.ActivationGrad("silu")(x, g), _inputs(_n(3, 4), _n(3, 4)),
                        lambda x, g: g * (1 + x * np.exp(-x) / (1 + np.exp(-x))) / (1 + np.exp(-x))),
    "logsumexp_all": OpCase("LogSumExp", ndl.logsumexp, _inputs(_n(3, 4, 5)), _lse_ref(None)),
    "logsumexp_int": OpCase("LogSumExp", lambda a: ndl.logsumexp(a, axes=1), _inputs(_n(3, 4, 5)), _lse_ref(1)),
    "logsumexp_tuple": OpCase("LogSumExp", lambda a: ndl.logsumexp(a, axes=(0, 2)), _inputs(_n(3, 4, 5)),
                              _lse_ref((0, 2))),
    "logsumexp_large": OpCase("LogSumExp", lambda a: ndl.logsumexp(a * 100.0, axes=(1,)), _inputs(_n(2, 4)),
                              lambda a: _lse_ref(1)(a * 100)),
    "logsoftmax": OpCase("LogSoftmax", ndl.logsoftmax, _inputs(_n(4, 5)),
                         lambda a: a - _lse_ref(1)(a)[:, None]),
    "stack_0": OpCase("Stack", lambda a, b, c: ndl.stack([a, b, c], 0), _inputs(_n(3, 4), _n(3, 4), _n(3, 4)),
                      lambda a, b, c: np.stack([a, b, c], 0)),
    "stack_2": OpCase("Stack", lambda a, b: ndl.stack([a, b * b], 2), _inputs(_n(3, 4), _n(3, 4)),
                      lambda a, b: np.stack([a, b * b], 2)),
    "stack_make_tuple": OpCase("MakeTensorTuple", lambda a, b: ndl.stack([a, b], 1), _inputs(_n(2, 3), _n(2, 3)),
                               lambda a, b: np.stack([a, b], 1)),
    "split": OpCase("Split", _split_combine, _inputs(_n(3, 4, 2)),
                    lambda a: a[:, 0] * 2 + a[:, 1] * a[:, 2] - a[:, 3]),
    "split_get_item": OpCase("TupleGetItem", lambda a: ndl.tuple_get_item(ndl.split(a, 0), 1),
                             _inputs(_n(3, 2)), lambda a: a[1]),
    "tuple_items": OpCase("TupleGetItem", _tuple_items, _inputs(_n(2, 3), _n(2, 3)), lambda a, b: a * b + a),
    "flip_0": OpCase("Flip", lambda a: ndl.flip(a, (0,)), _inputs(_n(3, 4)), lambda a: np.flip(a, 0)),
    "flip_12": OpCase("Flip", lambda a: ndl.flip(a, (1, 2)), _inputs(_n(2, 3, 4)), lambda a: np.flip(a, (1, 2))),
    "dilate_01": OpCase("Dilate", lambda a: ndl.dilate(a, (0, 1), 1), _inputs(_n(3, 2)), None),
    "dilate_1": OpCase("Dilate", lambda a: ndl.dilate(a, (1,), 2), _inputs(_n(2, 3, 2)), None),
    "undilate_0": OpCase("UnDilate", lambda a: ndl.undilate(a, (0,), 1), _inputs(_n(6, 4)), lambda a: a[::2]),
    "undilate_01": OpCase("UnDilate", lambda a: ndl.undilate(a, (0, 1), 2), _inputs(_n(6, 6)),
                          lambda a: a[::3, ::3]),
    "pad": OpCase("Pad", lambda a: ops.pad(a, ((1, 0), (0, 2))), _inputs(_n(3, 4)),
                  lambda a: np.pad(a, ((1, 0), (0, 2)))),
    "slice": OpCase("Slice", lambda a: ops.slice_window(a, (1, 0, 2), (2, 3, 2)), _inputs(_n(4, 3, 5)),
                    lambda a: a[1:3, 0:3, 2:4]),
    "conv_k3": _conv_case(2, 5, 3, 4, 3, 1, 0),
    "conv_k3_p1": _conv_case(2, 5, 3, 4, 3, 1, 1),
    "conv_k1": _conv_case(1, 4, 2, 3, 1, 1, 0),
    "conv_k5_p2": _conv_case(1, 5, 1, 2, 5, 1, 2),
    "conv_k2_even": _conv_case(1, 5, 2, 2, 2, 1, 1),
    "conv_s2_odd_p1": _conv_case(1, 7, 2, 3, 3, 2, 1),
    "conv_s2_odd_p0": _conv_case(2, 7, 2, 2, 3, 2, 0),
    "conv_s2_even": _conv_case(1, 6, 2, 2, 3, 2, 1),
    "conv_s3": _conv_case(1, 8, 2, 2, 3, 3, 1),
    "gather_rows": OpCase("GatherRows", _gather([4, 0, 4, 2]), _inputs(_n(5, 3)),
                          lambda t: t[[4, 0, 4, 2]]),
    "scatter_add_rows": OpCase("ScatterAddRows", _scatter([1, 0, 1, 3], 5), _inputs(_n(4, 3)), None),
    "pick_columns": OpCase("PickColumns", _pick([2, 0, 4, 2]), _inputs(_n(4, 5)),
                           lambda a: a[np.arange(4), [2, 0, 4, 2]]),
    "scatter_columns": OpCase("ScatterColumns", _scatter_columns([2, 0, 4, 2], 5), _inputs(_n(4,)), None),
    "subtract": OpCase("EWiseSub", ndl.ops.subtract, _inputs(_n(3, 4), _n(3, 4)), lambda a, b: a - b),
    "softmax_cross_entropy": OpCase("SoftmaxCrossEntropy", _xent([2, 0, 4, 2]), _inputs(_n(4, 5)),
                                    lambda z: _xent_ref(z, [2, 0, 4, 2])),
    "softmax_cross_entropy_grad": OpCase("SoftmaxCrossEntropyGrad", _xent_grad([2, 0, 4, 2]),
                                         _inputs(_n(4, 5), _n(4,)), None),
    "composite": OpCase("EWiseMul", lambda a, b: ndl.logsoftmax(ndl.relu(a @ b) * (a @ b)) + ndl.tanh(a @ b),
                        _inputs(_n(3, 4), _n(4, 5)), None),
}

BINARY_OPS = {
    "add": (ndl.add, np.add),
    "add_operator": (lambda a, b: a + b, np.add),
    "subtract": (ndl.ops.subtract, np.subtract),
    "sub_operator": (lambda a, b: a - b, np.subtract),
    "multiply": (ndl.multiply, np.multiply),
    "divide": (ndl.divide, np.divide),
    "power": (ndl.power, np.power),
}
