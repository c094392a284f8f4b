"""Tensors filled with constants or random numbers. Random ones draw once, full shape, from NumPy's global RNG."""
from .. import memory_hook
from ..autograd import Tensor, placeholder
from ..backend_selection import default_device

__all__ = ["constant", "one_hot", "ones", "ones_like", "rand", "randb", "randn", "zeros", "zeros_like"]


def _spec_only(shape, device, dtype, requires_grad):
    """In ndl.memory.predict's dry run: a Tensor of this shape, dtype and device with no data (nothing drawn from
    the RNG, nothing allocated), which the dry run counts."""
    device, dtype = device or default_device(), "float32" if dtype in ("bool", bool) else dtype
    node = placeholder((tuple(shape), dtype, device), requires_grad=requires_grad)
    memory_hook.PREDICTOR.constant(node, shape, dtype, device)
    return node


def rand(*shape, low=0.0, high=1.0, device=None, dtype="float32", requires_grad=False):
    """Uniform on [low, high): low + (high - low) * np.random.rand(*shape)."""
    if memory_hook.PREDICTOR is not None:
        return _spec_only(shape, device, dtype, requires_grad)
    device = device or default_device()
    array = device.rand(*shape) * (high - low) + low
    return Tensor(array, device=device, dtype=dtype, requires_grad=requires_grad)


def randn(*shape, mean=0.0, std=1.0, device=None, dtype="float32", requires_grad=False):
    """Normal: mean + std * np.random.randn(*shape)."""
    if memory_hook.PREDICTOR is not None:
        return _spec_only(shape, device, dtype, requires_grad)
    device = device or default_device()
    array = device.randn(*shape) * std + mean
    return Tensor(array, device=device, dtype=dtype, requires_grad=requires_grad)


def constant(*shape, c=1.0, device=None, dtype="float32", requires_grad=False):
    if memory_hook.PREDICTOR is not None:
        return _spec_only(shape, device, dtype, requires_grad)
    device = device or default_device()
    array = device.full(shape, c, dtype=dtype)
    return Tensor(array, device=device, dtype=dtype, requires_grad=requires_grad)


def ones(*shape, device=None, dtype="float32", requires_grad=False):
    return constant(*shape, c=1.0, device=device, dtype=dtype, requires_grad=requires_grad)


def zeros(*shape, device=None, dtype="float32", requires_grad=False):
    return constant(*shape, c=0.0, device=device, dtype=dtype, requires_grad=requires_grad)


def randb(*shape, p=0.5, device=None, dtype="bool", requires_grad=False):
    """Bernoulli(p) as 0/1: np.random.rand(*shape) <= p (float32 0/1 on the NDArray backends)."""
    if memory_hook.PREDICTOR is not None:
        return _spec_only(shape, device, dtype, requires_grad)
    device = device or default_device()
    array = device.rand(*shape) <= p
    return Tensor(array, device=device, dtype=dtype, requires_grad=requires_grad)


def one_hot(n, i, device=None, dtype="float32", requires_grad=False):
    """Rows of the n x n identity selected by the integer values i."""
    device = device or default_device()
    return Tensor(device.one_hot(n, i.numpy() if isinstance(i, Tensor) else i, dtype=dtype), device=device,
                  requires_grad=requires_grad)


def zeros_like(array, *, device=None, requires_grad=False):
    device = device or array.device
    return zeros(*array.shape, dtype=array.dtype, device=device, requires_grad=requires_grad)


def ones_like(array, *, device=None, requires_grad=False):
    device = device or array.device
    return ones(*array.shape, dtype=array.dtype, device=device, requires_grad=requires_grad)
