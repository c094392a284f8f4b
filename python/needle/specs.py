"""A value's spec: its (shape, dtype, device), known without its data, and the bytes it holds.

Lazy graphs plan before they compute: the Budget's ledger, the cost model and checkpointing read what a value will
be from its spec alone. A tuple value's shape is a tuple of its elements' shapes, and its dtype their one dtype or,
where they differ, a tuple of their dtypes (`element_dtype`). autograd.py re-exports these names.
"""
import math

import numpy

from .backend_selection import device_of

__all__ = ["DTYPE_ALIASES", "DTYPE_NAMES", "dtype_named", "element_dtype", "element_shapes", "elements_of", "itemsize",
           "nbytes_of", "spec_nbytes", "spec_of"]

DTYPE_NAMES = ("float32", "float16", "bfloat16", "int8", "uint8", "int32")  # what a Tensor stores
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}


def dtype_named(dtype, api):
    """The name of a dtype given by name ("bfloat16", or an alias: "bf16", "fp16", "fp32"), NumPy dtype or type;
    TypeError naming `api` (the function asked) and the accepted spellings where NumPy knows no such dtype (one it
    knows but a Tensor does not store, float64 say, is the backend's to refuse: NEEDLE_BACKEND=np stores it)."""
    dtype = DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    try:
        name = numpy.dtype(dtype).name
    except TypeError:
        name = None
    if name is None:
        raise TypeError(f"{api}: dtype must be one of {', '.join(DTYPE_NAMES)} (or {', '.join(DTYPE_ALIASES)}), "
                        f"got {dtype!r}")
    return name


def spec_of(data):
    """(shape, dtype, device) of a raw array, or of a tuple of them (its shape: a tuple of shapes; its dtype: the
    elements' one dtype, or a tuple of their dtypes where they differ, see `element_dtype`)."""
    if isinstance(data, tuple):
        specs = [spec_of(x) for x in data]
        dtypes = [s[1] for s in specs]
        dtype = (dtypes[0] if len(set(map(str, dtypes))) == 1 else tuple(dtypes)) if specs else "float32"
        return tuple(s[0] for s in specs), dtype, specs[0][2] if specs else None
    return tuple(data.shape), data.dtype, device_of(data)


def element_dtype(dtype, index):
    """The dtype of element `index` of a tuple value whose spec dtype is `dtype`: a tuple of dtypes where the
    elements' differ (a few-bit op's (activation, uint8 codes)), else the one dtype they share."""
    return dtype[index] if isinstance(dtype, tuple) else dtype


def element_shapes(shape):
    """The shapes of a tuple value's elements (its shape is a tuple of shapes), or None for an array's shape."""
    return shape if shape and isinstance(shape[0], tuple) else None


def elements_of(shape):
    """Elements a value of this shape holds: a tuple value's elements summed."""
    return sum(math.prod(s) for s in element_shapes(shape) or [shape])


def itemsize(dtype):
    """Bytes per element of a dtype ("float32", or a NumPy dtype)."""
    return numpy.dtype(dtype).itemsize


def spec_nbytes(spec):
    """Bytes a value of this (shape, dtype, device) spec holds (a tuple value: its elements', each at its dtype)."""
    return sum(math.prod(s) * itemsize(element_dtype(spec[1], k))
               for k, s in enumerate(element_shapes(spec[0]) or [spec[0]]))


def nbytes_of(data):
    if data is None:
        return 0
    if isinstance(data, tuple):
        return sum(nbytes_of(x) for x in data)
    return int(data.nbytes)
