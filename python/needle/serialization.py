"""Saving and loading arrays: `ndl.save(obj, path)` and `ndl.load(path)`, as NumPy `.npz` archives.

    ndl.save(model.state_dict(), "model.npz")
    model.load_state_dict(ndl.load("model.npz"))

Why .npz and not pickle (PyTorch's torch.save): loading a pickle runs whatever code the file names, so a
downloaded checkpoint could do anything. An .npz archive holds only arrays, and `load` reads it with
`allow_pickle=False`, so a file is data and nothing else.

What is stored: a single Tensor / NDArray / NumPy array (or number) under the key `__array__`, and `load` gives
back that NumPy array; or a dict of them (a state_dict), nested dicts flattened to dotted keys ({"model":
{"w": x}} is stored as "model.w"), and `load` gives back a flat dict {key: NumPy array} in the saved order.
Values come back as NumPy arrays on the host: a Tensor's device is not stored (`load_state_dict` puts each
value on its parameter's device and dtype). A path without the `.npz` suffix gets it, in `save` as `np.savez`
does and in `load` alike, so `save(x, "w")` and `load("w")` both mean `w.npz`.
"""
import os
import zipfile

import ml_dtypes
import numpy as np

__all__ = ["load", "save"]

_ARRAY_KEY = "__array__"  # the key of a lone array: `load` returns it unwrapped


def _npz_path(path):
    """`path` as a string ending in .npz (what np.savez writes to)."""
    path = os.fspath(path)
    return path if path.endswith(".npz") else path + ".npz"


def _as_numpy(value, key):
    # Tensors and NDArrays know how to become NumPy arrays; numbers and arrays pass through np.asarray.
    try:
        array = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
    except ValueError:  # a ragged list
        array = np.empty((), dtype=object)
    if array.dtype == object:  # would need pickle to store, and pickle is what we refuse to load
        hint = " (for a Module, save its state_dict())" if hasattr(value, "state_dict") else ""
        raise TypeError(f"ndl.save: cannot store {type(value).__name__} at key {key!r}: only Tensors, NDArrays, "
                        f"NumPy arrays and numbers can be saved{hint}")
    return array


def _flatten(obj, prefix, out):
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            _flatten(value, name + ".", out)
        elif name in out or name == _ARRAY_KEY:
            raise ValueError(f"ndl.save: key {name!r} appears twice after flattening nested dicts, or is reserved")
        else:
            out[name] = _as_numpy(value, name)
    return out


# NumPy's .npz format has no bfloat16 (ml_dtypes' type is stored as raw 2-byte "void"): such arrays are stored as
# their uint16 bit patterns under the key plus this suffix, and viewed back as bfloat16 by `load`.
_BFLOAT16_SUFFIX = ":bfloat16"


def _to_storable(arrays):
    out = {}
    for key, array in arrays.items():
        if array.dtype == np.dtype(ml_dtypes.bfloat16):
            out[key + _BFLOAT16_SUFFIX] = array.view(np.uint16)
        else:
            out[key] = array
    return out


def _from_stored(arrays):
    out = {}
    for key, array in arrays.items():
        if key.endswith(_BFLOAT16_SUFFIX):
            out[key[:-len(_BFLOAT16_SUFFIX)]] = array.view(ml_dtypes.bfloat16)
        else:
            out[key] = array
    return out


def save(obj, path):
    """Write `obj` (a Tensor, an array, or a possibly nested dict of them) to `path` as .npz; return the path."""
    arrays = _flatten(obj, "", {}) if isinstance(obj, dict) else {_ARRAY_KEY: _as_numpy(obj, _ARRAY_KEY)}
    path = _npz_path(path)
    np.savez(path, **_to_storable(arrays))
    return path


def load(path):
    """Read a file written by `save`: a NumPy array, or a flat dict {dotted key: NumPy array} (see above)."""
    path = _npz_path(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"ndl.load: no such file {path!r} (save() and load() add .npz to a path without it)")
    try:
        with open(path, "rb") as f:  # ours to close, also when np.load fails half-way through a bad zip
            archive = np.load(f, allow_pickle=False)  # never unpickles: a pickle or an object array raises
            if not isinstance(archive, np.lib.npyio.NpzFile):
                raise ValueError("it holds a single .npy array")
            arrays = _from_stored({key: archive[key] for key in archive.files})
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:
        raise ValueError(f"ndl.load: {path!r} is not an .npz archive of plain arrays as ndl.save writes "
                         f"(pickled objects are never loaded): {err}") from err
    if list(arrays) == [_ARRAY_KEY]:
        return arrays[_ARRAY_KEY]
    return arrays
