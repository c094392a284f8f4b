"""NDArray: an n-dimensional view (shape, strides, offset) over a flat device buffer, and the devices that own
the buffers.

All the index arithmetic lives here; a backend module only sees flat buffers and the (shape, strides,
offset) of a view (the contract is in src/README.md). Every view is bounds-checked here, so no backend is
ever handed one that reaches outside its buffer. The NumPy-like functions that ops call (`array`, `sum`,
`matmul`, ...) are in array_api.py.
"""
import contextlib
import functools
import importlib
import math
import operator

import numpy as np

from . import ndarray_backend_numpy
from .. import memory_hook
from .threads import configure_openmp

__all__ = [
    "BackendDevice",
    "BackendNotBuiltError",
    "DTYPES",
    "FLOATS",
    "NDArray",
    "all_devices",
    "compact_strides",
    "cpu",
    "cpu_numpy",
    "cuda",
    "default_device",
    "dtype_name",
    "is_transposed_matrix",
    "memory_stats",
    "promote_types",
    "reset_peak_memory_stats",
    "set_cache_limit",
    "set_memory_limit",
]

BUILD_HINT = (
    "needle's compiled backend '{name}' is not built. Build it from the repository root with `make` "
    "(or `python3 -m pip install -e .`)."
)


class BackendNotBuiltError(RuntimeError):
    """A device's compiled backend module is missing: build it (the message says how).

    A RuntimeError, not an AttributeError, so `getattr(device, name, default)` and `hasattr` never mistake
    "not built" for "no such attribute" and hide the build hint."""


# What a backend module provides (src/README.md): the contract, whose executable specification is the NumPy
# reference module, plus the functions only one compiled backend has. On a device whose module is not built,
# asking for one of these raises the build hint; any other name is simply an unknown attribute.
_BACKEND_NAMES = frozenset(
    [name for name, value in vars(ndarray_backend_numpy).items() if not name.startswith("_") and callable(value)]
    + ["__device_name__", "__tile_size__"]
    + ["device_count", "empty_cache"]  # CUDA only
    + ["matmul_kernel", "set_matmul_kernel", "vector_isa", "set_vector_isa", "num_threads",
       "set_cache_limit"]  # C++ CPU only
)


prod = math.prod


def _load(name):
    """Import a compiled backend module if it was built; None otherwise (needle still imports)."""
    try:
        return importlib.import_module(f"needle.backend_ndarray.{name}")
    except ImportError:
        return None


class BackendDevice:
    """A device: a name plus the backend module that implements the contract for it.

    Backend functions are reached as attributes of the device (`device.matmul_tiled`, `device.__tile_size__`).
    A device is a plain value otherwise: it compares by name, copies as itself and pickles by name."""

    def __init__(self, name, mod, missing_module=None):
        self.name = name
        self.mod = mod
        self._missing_module = missing_module
        self._enabled = None  # computed on first use: every new array asks

    def __eq__(self, other):
        return isinstance(other, BackendDevice) and self.name == other.name

    def __hash__(self):
        return hash(self.name)

    def __repr__(self):
        return self.name + "()"

    def __getattr__(self, name):
        # Reached only when normal lookup fails. Python's protocols probe optional dunders with getattr(x, name,
        # default) -- copy (__deepcopy__), pickle (__setstate__, on an instance whose __dict__ is still empty),
        # pytest's parametrize ids (__name__) -- so those must get AttributeError, never a module's attribute or a
        # build error. Fields are read through __dict__: `self.mod` here would recurse when it is not set yet.
        if name.startswith("__") and name not in _BACKEND_NAMES:
            raise AttributeError(self._no_attribute(name))
        mod = self.__dict__.get("mod")
        if mod is not None:
            try:
                return getattr(mod, name)
            except AttributeError:
                raise AttributeError(self._no_attribute(name)) from None
        if name in _BACKEND_NAMES:
            raise BackendNotBuiltError(BUILD_HINT.format(name=self.__dict__.get("_missing_module")))
        raise AttributeError(self._no_attribute(name))

    def _no_attribute(self, name):
        return f"device {self.__dict__.get('name', '?')}() has no attribute {name!r}"

    # A device names a backend, which is global state (its buffers, its allocator): a copy is the same device,
    # and a pickle stores only the name, so it loads on machines where the module is built elsewhere or not at all.
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        if self.name not in _DEVICES:
            raise TypeError(f"cannot pickle device {self!r}: only {', '.join(map(repr, _DEVICES.values()))} "
                            "are pickled (by name)")
        return _device_named, (self.name,)

    @contextlib.contextmanager
    def calls_through(self, router):
        """Inside the block every backend call on this device goes to `router` (ndl.jit.capture records them)."""
        mod, self.mod = self.mod, router
        try:
            yield
        finally:
            self.mod = mod

    def enabled(self):
        if self.mod is None:
            return False
        if self._enabled is None:  # asked once: the GPU count does not change while needle runs
            count = getattr(self.mod, "device_count", None)
            self._enabled = count is None or count() > 0
        return self._enabled

    def _require(self):
        if not self.enabled():
            if self.mod is None:
                raise BackendNotBuiltError(BUILD_HINT.format(name=self._missing_module))
            raise RuntimeError(f"device {self!r} is not available on this machine (no GPU found)")

    def randn(self, *shape, dtype="float32"):
        # One draw of the full shape from NumPy's global RNG (in float32, then converted): seeded models
        # reproduce the course's numbers in every dtype.
        return NDArray(np.random.randn(*shape).astype(np.float32), device=self, dtype=dtype)

    def rand(self, *shape, dtype="float32"):
        return NDArray(np.random.rand(*shape).astype(np.float32), device=self, dtype=dtype)

    def one_hot(self, n, i, dtype="float32"):
        i = np.asarray(i.numpy() if isinstance(i, NDArray) else i).astype(np.int64)
        return NDArray(np.eye(n, dtype=np.float32)[i], device=self, dtype=dtype)

    def empty(self, shape, dtype="float32", fn="empty"):
        """An uninitialized compact array; `fn`, the function the caller was asked for, names a bad shape."""
        return NDArray.make(shape_tuple(shape, fn), device=self, dtype=dtype_name(dtype))

    def full(self, shape, fill_value, dtype="float32", fn="full"):
        arr = self.empty(shape, dtype, fn)
        arr.fill(fill_value)
        return arr

    def memory_stats(self):
        self._require()
        return dict(self.mod.memory_stats())

    def reset_peak_memory_stats(self):
        self._require()
        self.mod.reset_peak_memory_stats()


configure_openmp()  # before OpenMP starts, which the compiled module loads
_CPU = BackendDevice("cpu", _load("ndarray_backend_cpu"), "ndarray_backend_cpu")
_CUDA = BackendDevice("cuda", _load("ndarray_backend_cuda"), "ndarray_backend_cuda")
_CPU_NUMPY = BackendDevice("cpu_numpy", ndarray_backend_numpy)
_DEVICES = {device.name: device for device in (_CPU, _CUDA, _CPU_NUMPY)}


def _device_named(name):
    """The device of that name (what a pickled device loads as)."""
    return _DEVICES[name]


def cpu():
    """The C++ CPU backend."""
    return _CPU


def cuda():
    """The CUDA backend (constructible everywhere; `enabled()` is False without a GPU build)."""
    return _CUDA


def cpu_numpy():
    """The pure-NumPy reference backend."""
    return _CPU_NUMPY


def default_device():
    return _CPU if _CPU.enabled() else _CPU_NUMPY


def all_devices():
    return [cpu(), cuda(), cpu_numpy()]


def memory_stats(device=None):
    """{"current_bytes", "peak_bytes", "allocations"} of the device's live buffers (counted by its allocator)."""
    return (device or default_device()).memory_stats()


def reset_peak_memory_stats(device=None):
    (device or default_device()).reset_peak_memory_stats()


def set_memory_limit(nbytes, device=None):
    """Make the device's allocator raise MemoryError past `nbytes` live bytes (None or 0 removes the limit)."""
    device = device or default_device()
    device._require()
    if nbytes is not None and (isinstance(nbytes, bool) or int(nbytes) != nbytes or nbytes < 0):
        raise ValueError(f"set_memory_limit: nbytes must be a whole number of bytes >= 0, or None, got {nbytes!r}")
    device.mod.set_memory_limit(0 if nbytes is None else int(nbytes))


def set_cache_limit(nbytes, device=None):
    """Bound the bytes of freed buffers the C++ CPU allocator keeps for reuse (`cached_bytes`): `nbytes`, 0 to
    unmap every freed buffer at once (resident memory then follows `current_bytes`), None for the default (as
    many bytes as were ever live at once, at least 64 MiB)."""
    device = device or default_device()
    device._require()
    if not hasattr(device.mod, "set_cache_limit"):
        raise ValueError(f"set_cache_limit: the {device.name} backend has no cache limit (the C++ CPU backend has; "
                         "CUDA keeps its freed blocks until empty_cache())")
    if nbytes is not None and int(nbytes) < 0:
        raise ValueError(f"set_cache_limit: nbytes must be >= 0 or None, got {nbytes}")
    device.mod.set_cache_limit(-1 if nbytes is None else int(nbytes))


# ----- dtypes ---------------------------------------------------------------------------------------------------
# Storage dtypes and their NumPy types (bfloat16 from ml_dtypes). Arithmetic is float32 whatever the storage
# (src/README.md, "Dtypes"): a 16-bit op computes in float32 and rounds its result once.
DTYPES = ndarray_backend_numpy.DTYPES  # name -> NumPy dtype, as the reference backend (the spec) defines
FLOATS = ndarray_backend_numpy.FLOATS
ACTIVATIONS = ndarray_backend_numpy.ACTIVATIONS  # NDArray.activation's kinds


@functools.lru_cache(maxsize=64)
def _dtype_name(dtype):
    if dtype is None:
        return "float32"
    if isinstance(dtype, str) and dtype in DTYPES:
        return dtype
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in DTYPES:
        raise TypeError(f"NDArray dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return name


def dtype_name(dtype):
    """The name of a dtype given as a name, a NumPy dtype or type (np.float16, ml_dtypes.bfloat16); None is
    float32. TypeError for any other."""
    try:
        return _dtype_name(dtype)
    except TypeError:  # unhashable
        raise TypeError(f"NDArray dtype must be one of {', '.join(DTYPES)}, got {dtype!r}") from None


def promote_types(a, b):
    """The dtype an operation on dtypes a and b computes in: the same dtype if they agree, else float32 (the one
    float dtype that holds both float16 and bfloat16). Python numbers never change the dtype (bfloat16 * 0.5 is
    bfloat16), as in PyTorch. Integer dtypes are storage and do not promote: arithmetic on them is a TypeError."""
    if a == b:
        return a
    return "float32"


def _require_float(name, *dtypes):
    for dtype in dtypes:
        if dtype not in FLOATS:
            raise TypeError(f"{name}: {dtype} arrays are storage (labels, indices, quantized state) and support no "
                            f"arithmetic; convert with .astype('float32') first")


def _integers(values, fn, what):
    """`values` as a tuple of ints, or TypeError naming `fn`: a float is refused, not truncated as int() would
    (a shape (2.5, 4) silently made a (2, 4) array)."""
    try:
        return tuple(operator.index(v) for v in values)
    except TypeError:
        raise TypeError(f"{fn}: {what} must be a sequence of integers, got {values!r}") from None


def shape_tuple(shape, fn):
    """`shape` as a tuple of non-negative ints, or TypeError / ValueError naming `fn`, the function it was given to."""
    shape = _integers(shape, fn, "a shape")
    if any(s < 0 for s in shape):
        raise ValueError(f"{fn}: a shape must not be negative, got {shape}")
    return shape


@functools.lru_cache(maxsize=4096)
def compact_strides(shape):
    """The strides (in elements) of a compact row-major array of this shape: what a fresh NDArray gets."""
    stride, res = 1, []
    for dim in reversed(shape):
        res.append(stride)
        stride *= dim
    return tuple(reversed(res))


class NDArray:
    """A strided view of a flat buffer of one dtype (float32 unless asked otherwise) on a device.

    Views (reshape of a compact array, permute, broadcast_to, slicing) share the buffer and cost no new bytes;
    every operation that computes produces a new compact array.
    """

    __slots__ = ("_shape", "_strides", "_offset", "_device", "_handle", "_dtype", "__weakref__")

    def __init__(self, other, device=None, dtype=None):
        """A new array holding `other`'s values (a copy). `dtype` None: an NDArray keeps its dtype, anything
        else becomes float32 (the course's behaviour for NumPy arrays of any dtype)."""
        if isinstance(other, NDArray):
            # A copy, as in the course framework (moved to `device` if another one is given).
            device = device or other.device
            dtype = other.dtype if dtype is None else dtype_name(dtype)
            if device == other.device:
                self._init(other.astype(dtype))
            else:
                self._init(NDArray(other.numpy(), device=device, dtype=dtype))
        else:
            dtype = dtype_name(dtype)
            if isinstance(other, np.ndarray) and other.dtype.kind not in "biuf" \
                    and other.dtype != DTYPES["bfloat16"]:
                raise TypeError(f"NDArray cannot hold numpy dtype {other.dtype}")
            data = np.asarray(other, order="C")  # (ascontiguousarray would make 0-d 1-d)
            if data.dtype != DTYPES[dtype]:
                data = ndarray_backend_numpy.convert(data, dtype)  # the contract's conversion rules
            device = device or default_device()
            device._require()
            arr = NDArray.make(data.shape, device=device, dtype=dtype)
            device.mod.from_numpy(data.view(np.uint16) if dtype == "bfloat16" else data, arr._handle)
            self._init(arr)

    def _init(self, other):
        self._shape = other._shape
        self._strides = other._strides
        self._offset = other._offset
        self._device = other._device
        self._handle = other._handle
        self._dtype = other._dtype

    @staticmethod
    def make(shape, strides=None, device=None, handle=None, offset=0, dtype="float32"):
        """A new NDArray of the given view; a fresh compact buffer of `dtype` when `handle` is None (a view has
        its buffer's dtype)."""
        shape = shape_tuple(shape, "NDArray.make")
        device = device or default_device()
        array = object.__new__(NDArray)
        array._shape = shape
        array._strides = compact_strides(shape) if strides is None else _integers(strides, "NDArray.make", "strides")
        array._offset = operator.index(offset)
        array._device = device
        fresh = handle is None
        if fresh:
            device._require()
            handle = device.mod.Array(prod(shape)) if dtype == "float32" else device.mod.Array(prod(shape), dtype)
        else:
            _check_view(shape, array._strides, array._offset, handle.size)
        array._handle = handle
        array._dtype = handle.dtype
        if fresh and memory_hook.RECORDER is not None:
            memory_hook.RECORDER.allocated(array)  # needle.memory: every buffer made, as it is made
        return array

    @staticmethod
    def _empty(shape, device, dtype="float32"):
        """A fresh compact array for an operation's result: `make` without re-checking a shape that came from an
        NDArray (a tuple of non-negative ints) on a device that already holds arrays."""
        array = object.__new__(NDArray)
        array._shape = shape
        array._strides = compact_strides(shape)
        array._offset = 0
        array._device = device
        array._handle = device.mod.Array(prod(shape)) if dtype == "float32" else device.mod.Array(prod(shape), dtype)
        array._dtype = dtype
        if memory_hook.RECORDER is not None:
            memory_hook.RECORDER.allocated(array)  # needle.memory: every buffer made, as it is made
        return array

    # ----- properties ---------------------------------------------------------------------------------------
    @property
    def shape(self):
        return self._shape

    @property
    def strides(self):
        return self._strides

    @property
    def offset(self):
        """Where this array starts in its buffer, in elements (a view's offset; 0 for a fresh array)."""
        return self._offset

    @property
    def device(self):
        return self._device

    @property
    def buffer(self):
        """The flat device buffer this array is a view of: the object backend module functions take. Views share
        their array's buffer, so `a.buffer is b.buffer` says whether two arrays share memory; `buffer.size`,
        `buffer.dtype` and `buffer.ptr()` describe it."""
        return self._handle

    @property
    def dtype(self):
        """The storage dtype's name: "float32", "float16", "bfloat16", "int8", "uint8" or "int32"."""
        return self._dtype

    @property
    def itemsize(self):
        return DTYPES[self._dtype].itemsize

    @property
    def ndim(self):
        return len(self._shape)

    @property
    def size(self):
        return prod(self._shape)

    @property
    def nbytes(self):
        return self.itemsize * self.size

    def __repr__(self):
        return "NDArray(" + self.numpy().__str__() + f", device={self.device})"

    def __str__(self):
        return self.numpy().__str__()

    def __len__(self):
        return self._shape[0]

    def __array__(self, dtype=None, copy=None):
        return self.numpy() if dtype is None else self.numpy().astype(dtype)

    # ----- copying and pickling ----------------------------------------------------------------------------
    # By value, as NumPy's arrays: the copy owns a new compact buffer on the same device (a view copies only the
    # elements it shows), and a pickle holds the values, the shape and the device's name.
    def __copy__(self):
        out = NDArray._empty(self._shape, self._device, self._dtype)
        # compact() always writes `out`, also for a compact source: a bit-exact copy (`self + 0.0` is not: -0.0).
        self._device.mod.compact(self._handle, out._handle, list(self._shape), list(self._strides), self._offset)
        return out

    def __deepcopy__(self, memo):
        return self.__copy__()

    def __reduce__(self):
        return NDArray, (self.numpy(), self._device, self._dtype)

    # ----- moving data --------------------------------------------------------------------------------------
    def fill(self, value):
        self.device.mod.fill(self._handle, float(value))

    def to(self, device):
        return self if device == self.device else NDArray(self.numpy(), device=device, dtype=self._dtype)

    def numpy(self):
        """A NumPy copy in the matching dtype (bfloat16: ml_dtypes.bfloat16)."""
        out = self.device.mod.to_numpy(self._handle, list(self._shape), list(self._strides), self._offset)
        return out if self._dtype == "float32" else out.view(DTYPES[self._dtype])

    def numpy_into(self, out):
        """Copy into `out`, a C-contiguous NumPy array of this shape and dtype, and return it: no new host array."""
        if tuple(out.shape) != tuple(self._shape) or out.dtype != DTYPES[self._dtype]:
            raise ValueError(f"numpy_into: out is {out.dtype}{tuple(out.shape)}, the array {self._dtype}"
                             f"{tuple(self._shape)}")
        into = getattr(self.device.mod, "to_numpy_into", None)
        if into is None:  # a backend without it: through a fresh copy
            out[...] = self.numpy()
        else:
            into(self._handle, list(self._shape), list(self._strides), self._offset, out)
        return out

    def astype(self, dtype):
        """A compact copy converted to `dtype` (a copy also when the dtype is the same, as in NumPy): floats round
        to nearest even; to an integer dtype the fraction is dropped and values saturate (src/README.md)."""
        dtype = dtype_name(dtype)
        out = NDArray._empty(self._shape, self._device, dtype)
        self._device.mod.compact(self._handle, out._handle, list(self._shape), list(self._strides), self._offset)
        return out

    def is_compact(self):
        return self._strides == compact_strides(self._shape) and prod(self._shape) == self._handle.size

    def compact(self):
        """This array if it is compact, else a compact copy."""
        return self if self.is_compact() else self.copy()

    def copy(self):
        """A compact copy in a new buffer (of a compact array too)."""
        out = NDArray._empty(self._shape, self._device, self._dtype)
        self.device.mod.compact(self._handle, out._handle, list(self._shape), list(self._strides), self._offset)
        return out

    def as_strided(self, shape, strides):
        """A view of the same buffer with another shape and strides (bounds-checked)."""
        if len(shape) != len(strides):
            raise ValueError(f"as_strided: shape {tuple(shape)} and strides {tuple(strides)} differ in rank")
        return NDArray.make(shape, strides=strides, device=self.device, handle=self._handle, offset=self._offset)

    @property
    def flat(self):
        """A writable 1-D view (the array must be compact)."""
        if not self.is_compact():
            raise ValueError(f"flat: array of shape {self.shape} is not compact; call .compact() first")
        return self.reshape((self.size,))

    # ----- views --------------------------------------------------------------------------------------------
    def reshape(self, new_shape):
        """A view with a new shape; the array must be compact (as in the course framework)."""
        new_shape = _resolve_reshape(self._shape, new_shape)
        if prod(new_shape) != self.size:
            raise ValueError(f"reshape: cannot reshape array of shape {self.shape} into shape {new_shape}")
        if not self.is_compact():
            raise ValueError(f"reshape: array of shape {self.shape} is not compact; call .compact() first")
        return NDArray.make(new_shape, device=self.device, handle=self._handle, offset=self._offset)

    def permute(self, new_axes):
        """A view with the axes reordered: new axis i is old axis new_axes[i]."""
        new_axes = tuple(_normalize_axis(a, self.ndim, "permute") for a in new_axes)
        if sorted(new_axes) != list(range(self.ndim)):
            raise ValueError(f"permute: axes {new_axes} are not a permutation for shape {self.shape}")
        return self.as_strided(
            tuple(self._shape[a] for a in new_axes), tuple(self._strides[a] for a in new_axes)
        )

    def broadcast_to(self, new_shape):
        """A view repeating size-1 axes with stride 0 (NumPy's rules; new leading axes allowed)."""
        new_shape = shape_tuple(new_shape, "broadcast_to")
        lead = len(new_shape) - self.ndim
        if lead < 0:
            raise ValueError(f"broadcast_to: cannot broadcast shape {self.shape} to {new_shape}")
        strides = [0] * lead
        for old, new, stride in zip(self._shape, new_shape[lead:], self._strides):
            if old == new:
                strides.append(stride)
            elif old == 1:
                strides.append(0)
            else:
                raise ValueError(f"broadcast_to: cannot broadcast shape {self.shape} to {new_shape}")
        return self.as_strided(new_shape, tuple(strides))

    def process_slice(self, sl, dim):
        """A slice with start, stop and step resolved against axis `dim` (NumPy's rules)."""
        start, stop, step = sl.indices(self._shape[dim])
        return slice(start, stop, step)

    def __getitem__(self, idxs):
        """A view of the selected elements. Ints drop their axis and slices keep it, as in NumPy."""
        if not isinstance(idxs, tuple):
            idxs = (idxs,)
        for idx in idxs:
            # bool is an int to Python, so a[True] would silently mean a[1]; NumPy gives it a different meaning
            # (a boolean mask), which NDArray does not implement.
            if isinstance(idx, (bool, np.bool_)):
                raise TypeError(f"NDArray indices must be ints or slices, not bool: got {idx!r} in index "
                                f"{idxs!r} (boolean indexing is not supported)")
        if len(idxs) > self.ndim:
            raise IndexError(f"too many indices ({len(idxs)}) for array of shape {self.shape}")
        idxs = idxs + (slice(None),) * (self.ndim - len(idxs))
        shape, strides, offset = [], [], self._offset
        for dim, idx in enumerate(idxs):
            if isinstance(idx, slice):
                start, stop, step = idx.indices(self._shape[dim])
                shape.append(len(range(start, stop, step)))
                strides.append(self._strides[dim] * step)
                offset += start * self._strides[dim] if shape[-1] else 0
            elif isinstance(idx, (int, np.integer)):
                i = int(idx) + (self._shape[dim] if idx < 0 else 0)
                if not 0 <= i < self._shape[dim]:
                    raise IndexError(f"index {idx} is out of bounds for axis {dim} with size {self._shape[dim]}")
                offset += i * self._strides[dim]
            else:
                raise TypeError(f"NDArray indices must be ints or slices, got {type(idx).__name__}")
        return NDArray.make(tuple(shape), strides=tuple(strides), device=self.device, handle=self._handle,
                            offset=offset)

    def __setitem__(self, idxs, other):
        view = self.__getitem__(idxs)
        repeated = [axis for axis, (n, st) in enumerate(zip(view.shape, view.strides)) if st == 0 and n > 1]
        if repeated and view.size:  # a broadcast view: several indices, one element; NumPy refuses it too
            raise ValueError(f"setitem: the view written to (shape {view.shape}, strides {view.strides}) repeats "
                             f"elements along axis {repeated[0]} (a broadcast view): write to the array it views")
        if isinstance(other, NDArray):
            if other.device != self.device:
                raise ValueError(f"setitem: value on {other.device} but array on {self.device}")
            if other.shape != view.shape:
                other = other.broadcast_to(view.shape)
            self.device.mod.ewise_setitem(other.compact()._handle, view._handle, list(view.shape),
                                          list(view.strides), view._offset)
        else:
            self.device.mod.scalar_setitem(view.size, float(other), view._handle, list(view.shape),
                                           list(view.strides), view._offset)

    # ----- element-wise and scalar arithmetic ---------------------------------------------------------------
    # Operands that are not compact (broadcast, transposed, sliced views) are read in place through the backend's
    # strided entry points (ewise_strided / scalar_strided / unary_strided), so an operation allocates only its
    # output: `Z - broadcast_to(lse)` never materializes the broadcast.  A backend without them gets compact
    # copies instead.  Arrays of other dtypes (float16, bfloat16) take the compact entry points, which load
    # into float32 and round the result once; operands of two dtypes are first converted to promote_types'.
    def ewise_or_scalar(self, other, ewise_func, scalar_func, name="op"):
        """Apply `ewise_func` to two arrays of equal shape, or `scalar_func` to this array and a number.

        `name` is the operation's name in the strided entry points (add, mul, div, power, maximum, eq, ge, gt)."""
        if isinstance(other, NDArray):
            self._check_operand(other, name)
            if self._dtype != "float32" or other._dtype != "float32":
                return self._ewise_other_dtype(other, ewise_func, scalar_func, name)
        elif self._dtype != "float32":
            _require_float(name, self._dtype)
            out = NDArray._empty(self._shape, self._device, self._dtype)
            scalar_func(self.compact()._handle, float(other), out._handle)
            return out
        out = NDArray._empty(self._shape, self._device)
        mod = self._device.mod
        if isinstance(other, NDArray):
            if self.is_compact() and other.is_compact():
                ewise_func(self._handle, other._handle, out._handle)
            elif hasattr(mod, "ewise_strided"):
                mod.ewise_strided(name, self._handle, list(self._strides), self._offset, other._handle,
                                  list(other._strides), other._offset, out._handle, list(self._shape))
            else:
                ewise_func(self.compact()._handle, other.compact()._handle, out._handle)
        elif self.is_compact():
            scalar_func(self._handle, float(other), out._handle)
        elif hasattr(mod, "scalar_strided"):
            mod.scalar_strided(name, self._handle, list(self._strides), self._offset, float(other), out._handle,
                               list(self._shape))
        else:
            scalar_func(self.compact()._handle, float(other), out._handle)
        return out

    def _ewise_other_dtype(self, other, ewise_func, scalar_func, name):
        _require_float(name, self._dtype, other._dtype)
        dtype = promote_types(self._dtype, other._dtype)
        a = self if self._dtype == dtype else self.astype(dtype)
        b = other if other._dtype == dtype else other.astype(dtype)
        if dtype == "float32":
            return a.ewise_or_scalar(b, ewise_func, scalar_func, name)
        out = NDArray._empty(self._shape, self._device, dtype)
        ewise_func(a.compact()._handle, b.compact()._handle, out._handle)
        return out

    def _check_operand(self, other, name):
        if other._shape != self._shape:
            raise ValueError(f"{name}: shapes {self.shape} and {other.shape} differ; broadcast explicitly")
        if other._device != self._device:
            raise ValueError(f"{name}: operands on {self.device} and {other.device}")

    def __add__(self, other):
        return self.ewise_or_scalar(other, self.device.mod.ewise_add, self.device.mod.scalar_add, "add")

    __radd__ = __add__

    def __sub__(self, other):
        mod = self._device.mod
        if isinstance(other, NDArray) and hasattr(mod, "ewise_strided") and self._dtype == other._dtype == "float32":
            # One pass, no negated temporary; the contract has no compact ewise_sub, and a - b == a + (-b) exactly.
            self._check_operand(other, "sub")
            out = NDArray._empty(self._shape, self._device)
            mod.ewise_strided("sub", self._handle, list(self._strides), self._offset, other._handle,
                              list(other._strides), other._offset, out._handle, list(self._shape))
            return out
        return self + (-other)

    def __rsub__(self, other):
        return other + (-self)

    def __mul__(self, other):
        return self.ewise_or_scalar(other, self.device.mod.ewise_mul, self.device.mod.scalar_mul, "mul")

    __rmul__ = __mul__

    def __truediv__(self, other):
        return self.ewise_or_scalar(other, self.device.mod.ewise_div, self.device.mod.scalar_div, "div")

    def __rtruediv__(self, other):
        if self._dtype != "float32":  # one float32 division, rounded once (never the scalar rounded first)
            return (other / self.astype("float32")).astype(self._dtype)
        return self.device.full(self.shape, other) / self

    def __neg__(self):
        return self * (-1.0)

    def __pow__(self, other):
        return self.ewise_or_scalar(other, self.device.mod.ewise_power, self.device.mod.scalar_power, "power")

    def maximum(self, other):
        return self.ewise_or_scalar(other, self.device.mod.ewise_maximum, self.device.mod.scalar_maximum,
                                    "maximum")

    def __eq__(self, other):
        return self.ewise_or_scalar(other, self.device.mod.ewise_eq, self.device.mod.scalar_eq, "eq")

    def __ge__(self, other):
        return self.ewise_or_scalar(other, self.device.mod.ewise_ge, self.device.mod.scalar_ge, "ge")

    def __ne__(self, other):
        return 1 - (self == other)

    def __gt__(self, other):
        return self.ewise_or_scalar(other, self.device.mod.ewise_gt, self.device.mod.scalar_gt, "gt")

    def __lt__(self, other):
        return 1 - (self >= other)

    def __le__(self, other):
        return 1 - (self > other)

    __hash__ = None

    def _unary(self, func, name):
        if self._dtype != "float32":
            _require_float(name, self._dtype)
            out = NDArray._empty(self._shape, self._device, self._dtype)
            func(self.compact()._handle, out._handle)
            return out
        out = NDArray._empty(self._shape, self._device)
        mod = self._device.mod
        if self.is_compact():
            func(self._handle, out._handle)
        elif hasattr(mod, "unary_strided"):
            mod.unary_strided(name, self._handle, list(self._strides), self._offset, out._handle, list(self._shape))
        else:
            func(self.compact()._handle, out._handle)
        return out

    def log(self):
        return self._unary(self.device.mod.ewise_log, "log")

    def exp(self):
        return self._unary(self.device.mod.ewise_exp, "exp")

    def tanh(self):
        return self._unary(self.device.mod.ewise_tanh, "tanh")

    def activation(self, kind):
        """f(self) element-wise for f in ACTIVATIONS: "gelu" (x Φ(x)), "gelu_tanh" (its tanh approximation),
        "silu" (x σ(x)); any floating dtype, float32 arithmetic."""
        mod = self._check_activation(kind, "activation")
        _require_float(f"activation {kind}", self._dtype)
        out = NDArray._empty(self._shape, self._device, self._dtype)
        getattr(mod, f"ewise_{kind}")(self.compact()._handle, out._handle)
        return out

    def activation_grad(self, grad, kind):
        """grad * f'(self) element-wise (f as in `activation`): the activation's gradient at input self."""
        mod = self._check_activation(kind, "activation_grad")
        if not isinstance(grad, NDArray) or grad.shape != self.shape or grad.dtype != self.dtype \
                or grad.device != self.device:
            raise ValueError(f"activation_grad {kind}: grad must be an NDArray like the input {self.shape} "
                             f"{self.dtype} on {self.device}, got {getattr(grad, 'shape', type(grad).__name__)}")
        _require_float(f"activation_grad {kind}", self._dtype)
        out = NDArray._empty(self._shape, self._device, self._dtype)
        getattr(mod, f"ewise_{kind}_grad")(self.compact()._handle, grad.compact()._handle, out._handle)
        return out

    def _check_activation(self, kind, fn):
        if kind not in ACTIVATIONS:
            raise ValueError(f"{fn}: unknown activation {kind!r} (expected {', '.join(ACTIVATIONS)})")
        return self._device.mod

    # ----- matrix multiplication ----------------------------------------------------------------------------
    def add_matmul(self, a, b):
        """self += a @ b for 2-D a (m, n) and b (n, p) of self's floating dtype, self compact (m, p), in place:
        the backend adds the product's float32 sums to self (rounded once), so a sum of products needs no
        temporary (the transpose of a whole compact matrix is read in place, as in @)."""
        if not all(isinstance(x, NDArray) for x in (a, b)):
            raise TypeError("add_matmul: operands must be NDArrays")
        if a.device != self.device or b.device != self.device:
            raise ValueError(f"add_matmul: operands on {a.device} and {b.device}, out on {self.device}")
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0] or self.shape != (a.shape[0], b.shape[1]):
            raise ValueError(f"add_matmul: out {self.shape} += {a.shape} @ {b.shape}: shapes are not aligned")
        if not self.is_compact():
            raise ValueError("add_matmul: out must be compact")
        if not a._dtype == b._dtype == self._dtype:
            raise TypeError(f"add_matmul: out and operands of one dtype, got {self._dtype}, {a._dtype} and {b._dtype}")
        _require_float("add_matmul", a._dtype)
        (ha, trans_a), (hb, trans_b) = _matmul_operand(a), _matmul_operand(b)
        self.device.mod.matmul(ha, hb, self._handle, a.shape[0], a.shape[1], b.shape[1], trans_a, trans_b, True)
        return self

    def __matmul__(self, other):
        """(m, n) @ (n, p) -> (m, p); batch dimensions broadcast as in NumPy."""
        if not isinstance(other, NDArray):
            raise TypeError(f"matmul: operand must be an NDArray, got {type(other).__name__}")
        if other.device != self.device:
            raise ValueError(f"matmul: operands on {self.device} and {other.device}")
        if self.ndim < 2 or other.ndim < 2 or self.shape[-1] != other.shape[-2]:
            raise ValueError(f"matmul: shapes {self.shape} and {other.shape} are not aligned")
        dtype = self._dtype
        if dtype != other._dtype or dtype != "float32":
            _require_float("matmul", self._dtype, other._dtype)
            dtype = promote_types(self._dtype, other._dtype)
            if self._dtype != dtype:
                return self.astype(dtype) @ other
            if other._dtype != dtype:
                return self @ other.astype(dtype)
        m, n, p = self.shape[-2], self.shape[-1], other.shape[-1]
        if self.ndim == 2 and other.ndim == 2:
            out = NDArray._empty((m, p), self._device, dtype)
            (a, trans_a), (b, trans_b) = _matmul_operand(self), _matmul_operand(other)
            if trans_a or trans_b:  # read where it is, no transposed copy (src/README.md, matmul)
                self.device.mod.matmul(a, b, out._handle, m, n, p, trans_a, trans_b)
            else:
                self.device.mod.matmul(a, b, out._handle, m, n, p)
            return out
        batch = tuple(np.broadcast_shapes(self.shape[:-2], other.shape[:-2]))
        k = prod(batch)
        a, b = self.broadcast_to(batch + (m, n)), other.broadcast_to(batch + (n, p))
        if k == 0:
            return NDArray._empty(batch + (m, p), self._device, dtype)
        if _one_matrix(b):
            # (..., m, n) @ one (n, p) matrix (repeated by broadcasting) is a single (k*m, n) @ (n, p) product.
            flat = a.compact().reshape((k * m, n)) @ b[(0,) * len(batch)]
            return flat.reshape(batch + (m, p))
        if _one_matrix(a):
            # one (m, n) @ (..., n, p) is a single (m, n) @ (n, k*p) product, its columns laid out batch-major.
            cols = b.compact().reshape((k, n, p)).permute((1, 0, 2)).compact().reshape((n, k * p))
            out = (a[(0,) * len(batch)] @ cols).reshape((m, k, p)).permute((1, 0, 2)).compact()
            return out.reshape(batch + (m, p))
        # One backend call for the whole batch.  compact() copies only a side that really is broadcast (or not
        # compact); a compact operand of the full batch shape is used as it is.
        a, b = a.compact(), b.compact()
        out = NDArray._empty(batch + (m, p), self._device, dtype)
        mod = self._device.mod
        if hasattr(mod, "matmul_batched"):
            mod.matmul_batched(a._handle, b._handle, out._handle, k, m, n, p)
            return out
        a, b, flat = a.reshape((k, m, n)), b.reshape((k, n, p)), out.reshape((k, m, p))
        for i in range(k):
            flat[i] = a[i] @ b[i]
        return out

    # ----- reductions ---------------------------------------------------------------------------------------
    def _reduce(self, func, axis, keepdims, name):
        _require_float(name, self._dtype)
        if axis is None:
            axes = tuple(range(self.ndim))
        else:
            axes = tuple(sorted({_normalize_axis(a, self.ndim, name) for a in
                                 (axis if isinstance(axis, (tuple, list)) else (axis,))}))
        kept = tuple(i for i in range(self.ndim) if i not in axes)
        reduce_size = prod(self._shape[i] for i in axes)
        if reduce_size == 0:
            raise ValueError(f"{name}: cannot reduce over a zero-size axis of shape {self.shape}")
        out_shape = tuple(self._shape[i] for i in kept)
        if func is self.device.mod.reduce_sum and kept and axes == tuple(range(len(axes))) and self.is_compact():
            # A sum over leading axes (a bias gradient) is ones(1, R) @ A(R, K): one pass through the fast
            # matmul instead of a transposed copy of the whole array.
            ones = NDArray._empty((1, reduce_size), self._device, self._dtype)
            ones.fill(1.0)
            out = (ones @ self.reshape((reduce_size, prod(out_shape)))).reshape(out_shape)
        else:
            # Move the reduced axes last, so each output element reduces one contiguous row.
            order = kept + axes
            view = (self if order == tuple(range(self.ndim)) else self.permute(order)).compact()
            out = NDArray._empty(out_shape, self._device, self._dtype)
            func(view._handle, out._handle, reduce_size)
        if keepdims:
            out = out.reshape(tuple(1 if i in axes else s for i, s in enumerate(self._shape)))
        return out

    def sum(self, axis=None, keepdims=False):
        return self._reduce(self.device.mod.reduce_sum, axis, keepdims, "sum")

    def max(self, axis=None, keepdims=False):
        return self._reduce(self.device.mod.reduce_max, axis, keepdims, "max")

    def logsumexp(self, axis=None, keepdims=False):
        """log Σ exp over the axes, max-shifted per output element (one fused pass, no temporary array)."""
        return self._reduce(self.device.mod.reduce_logsumexp, axis, keepdims, "logsumexp")

    # ----- flip and pad -------------------------------------------------------------------------------------
    def flip(self, axes):
        """A compact copy with the given axes reversed (a negative-stride view, then compact)."""
        if axes is None:
            axes = tuple(range(self.ndim))
        axes = {_normalize_axis(a, self.ndim, "flip") for a in (axes if isinstance(axes, (tuple, list))
                                                                 else (axes,))}
        offset, strides = self._offset, list(self._strides)
        for a in axes:
            offset += (self._shape[a] - 1) * self._strides[a] if self._shape[a] else 0
            strides[a] = -strides[a]
        view = NDArray.make(self.shape, strides=tuple(strides), device=self.device, handle=self._handle,
                            offset=offset)
        out = NDArray.make(self.shape, device=self.device, dtype=self._dtype)
        self.device.mod.compact(view._handle, out._handle, list(view.shape), list(view.strides), view._offset)
        return out

    def pad(self, axes):
        """Zero padding: axes[i] = (before, after) for axis i."""
        if len(axes) != self.ndim or any(lo < 0 or hi < 0 for lo, hi in axes):
            raise ValueError(f"pad: need one non-negative (before, after) pair per axis of {self.shape}, "
                             f"got {axes}")
        out = self.device.full(tuple(s + lo + hi for s, (lo, hi) in zip(self.shape, axes)), 0.0, self._dtype)
        out[tuple(slice(lo, lo + s) for s, (lo, _) in zip(self.shape, axes))] = self
        return out


def _matmul_operand(x):
    """(buffer, transposed) of a 2-D matmul operand: a compact one's buffer; for the transpose of a whole compact
    matrix (strides (1, rows): x.permute((1, 0)) of one) that matrix's buffer and True, so the backend reads it in
    place; for anything else a compact copy's buffer."""
    if x.is_compact():
        return x._handle, False
    if is_transposed_matrix(x.shape, x._strides) and x._offset == 0 and x._handle.size == x.size:
        return x._handle, True
    return x.compact()._handle, False


def is_transposed_matrix(shape, strides):
    """Whether a 2-D view with these element strides is the transpose of a compact matrix (matmul reads those in
    place; the Budget's ledger asks the same question)."""
    return len(shape) == 2 and tuple(strides) == (1, shape[0])


def _one_matrix(view):
    """Whether every batch index of a (..., rows, cols) view selects the same matrix (stride 0 or extent 1)."""
    return all(st == 0 or sh == 1 for sh, st in zip(view.shape[:-2], view.strides[:-2]))


def _normalize_axis(axis, ndim, name):
    if not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{name}: axis must be an int, got {axis!r}")
    if not -ndim <= axis < max(ndim, 1):
        raise ValueError(f"{name}: axis {axis} is out of range for {ndim} dimensions")
    return int(axis) % max(ndim, 1)


def _resolve_reshape(old_shape, new_shape):
    if isinstance(new_shape, (int, np.integer)):
        new_shape = (new_shape,)
    new_shape = list(_integers(new_shape, "reshape", "a shape"))
    if new_shape.count(-1) > 1:
        raise ValueError(f"reshape: only one -1 allowed in {tuple(new_shape)}")
    if -1 in new_shape:
        known = prod(s for s in new_shape if s != -1)
        if known == 0 or prod(old_shape) % known:
            raise ValueError(f"reshape: cannot reshape array of shape {tuple(old_shape)} into "
                             f"{tuple(new_shape)}")
        new_shape[new_shape.index(-1)] = prod(old_shape) // known
    return tuple(new_shape)


def _check_view(shape, strides, offset, buffer_size):
    """Raise IndexError unless every element of the view lies inside the buffer."""
    if len(shape) != len(strides):
        raise ValueError(f"view shape {shape} and strides {strides} differ in rank")
    if prod(shape) == 0:
        return
    lo = offset + sum(min(0, (n - 1) * s) for n, s in zip(shape, strides))
    hi = offset + sum(max(0, (n - 1) * s) for n, s in zip(shape, strides))
    if lo < 0 or hi >= buffer_size:
        raise IndexError(f"view (shape {shape}, strides {strides}, offset {offset}) reaches elements "
                         f"[{lo}, {hi}] outside a buffer of {buffer_size}")
