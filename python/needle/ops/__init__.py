"""needle's ops: each a class with `compute` and `gradient`, plus the lower-case helper that applies it.

Fused ops are exported by their helper only (`linear_cross_entropy`, `scaled_dot_product_attention`, `layer_norm`,
`linear`, `dropout`); their classes live in `ops.ops_fused`, `ops.ops_attention`, `ops.ops_norm`, `ops.ops_linear`
and `ops.ops_dropout`.
"""
from .ops_attention import scaled_dot_product_attention
from .ops_dropout import dropout
from .ops_fused import linear_cross_entropy
from .ops_linear import linear
from .ops_logarithmic import (
    LogSoftmax, LogSumExp, SoftmaxCrossEntropy, SoftmaxCrossEntropyGrad, logsoftmax, logsumexp,
    softmax_cross_entropy,
)
from .ops_norm import layer_norm
from .ops_mathematic import (
    AddScalar, BroadcastTo, Cast, Conv, Dilate, DivScalar, EWiseAdd, EWiseDiv, EWiseMul, EWisePow, EWiseSub, Exp, Flip,
    GatherRows, Log, MatMul, MulScalar, Negate, Pad, PickColumns, Positive, PowerScalar, ReLU, Reshape,
    ScatterAddRows, ScatterColumns, Sigmoid, Slice, Summation, Tanh, Transpose, UnDilate, add, add_scalar,
    broadcast_to, cast, conv, dilate, divide, divide_scalar, exp, flip, gather_rows, log, matmul, mul_scalar, multiply,
    negate, pad, pick_columns, positive, power, power_scalar, relu, reshape, scatter_add_rows, scatter_columns,
    sigmoid, slice_window, subtract, summation, tanh, transpose, undilate,
)
from .ops_tuple import (
    MakeTensorTuple, Split, Stack, TupleGetItem, make_tuple, split, stack, tuple_get_item,
)

__all__ = [
    "AddScalar", "BroadcastTo", "Cast", "Conv", "Dilate", "DivScalar", "EWiseAdd", "EWiseDiv", "EWiseMul", "EWisePow",
    "EWiseSub", "Exp", "Flip", "GatherRows", "Log", "LogSoftmax", "LogSumExp", "MakeTensorTuple", "MatMul",
    "MulScalar", "Negate", "Pad", "PickColumns", "Positive", "PowerScalar", "ReLU", "Reshape", "ScatterAddRows",
    "ScatterColumns", "Sigmoid", "Slice", "SoftmaxCrossEntropy", "SoftmaxCrossEntropyGrad", "Split", "Stack",
    "Summation", "Tanh", "Transpose", "TupleGetItem", "UnDilate", "add", "add_scalar", "broadcast_to", "cast", "conv",
    "dilate", "divide", "divide_scalar", "dropout", "exp", "flip", "gather_rows", "layer_norm", "linear",
    "linear_cross_entropy", "log", "logsoftmax", "logsumexp", "make_tuple", "matmul", "mul_scalar", "multiply",
    "negate", "pad", "pick_columns", "positive", "power", "power_scalar", "relu", "reshape",
    "scaled_dot_product_attention", "scatter_add_rows", "scatter_columns", "sigmoid", "slice_window",
    "softmax_cross_entropy", "split", "stack", "subtract", "summation", "tanh", "transpose", "tuple_get_item",
    "undilate",
]
