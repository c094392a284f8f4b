"""needle: a small deep-learning framework with lazy-evaluation gradient checkpointing.

    import needle as ndl
    x = ndl.Tensor([[1.0, 2.0]], requires_grad=True)
    (x * x).sum().backward()
    x.grad  # [[2., 4.]]
"""
from . import autograd, backend_ndarray, checkpoint, data, init, lazy, nn, ops, optim, serialization, viz
from .autograd import Tensor, TensorTuple
from .backend_selection import BACKEND, all_devices, cpu, cpu_numpy, cuda, default_device
from .ops import (
    add, add_scalar, broadcast_to, conv, dilate, divide, divide_scalar, exp, flip, log, logsoftmax, logsumexp,
    make_tuple, matmul, mul_scalar, multiply, negate, power, power_scalar, relu, reshape, sigmoid, split, stack,
    summation, tanh, transpose, tuple_get_item, undilate,
)
from .serialization import load, random_state, save, set_random_state
from .version import package_version

__version__ = package_version()

# The memory toolbox (needle/toolbox/), loaded on first use: `import needle` imports the core only.
__getattr__ = lazy.attributes(__name__, {"amp": "amp", "autocast": "amp:autocast", "distributed": "distributed",
                                         "jit": "jit", "memory": "memory", "toolbox": ""})

__all__ = [
    "BACKEND", "Tensor", "TensorTuple", "add", "add_scalar", "all_devices", "autograd",
    "backend_ndarray", "broadcast_to", "checkpoint", "conv", "cpu", "cpu_numpy", "cuda", "data", "default_device",
    "dilate", "divide", "divide_scalar", "exp", "flip", "init", "load", "log", "logsoftmax",
    "logsumexp", "make_tuple", "matmul", "mul_scalar", "multiply", "negate", "nn", "ops", "optim", "power",
    "power_scalar", "relu", "reshape", "save", "serialization", "sigmoid", "split", "stack", "summation", "tanh",
    "transpose", "tuple_get_item", "undilate", "version", "viz", "random_state", "set_random_state",
]
