"""Saving and loading: `ndl.save(obj, path)` / `ndl.load(path)` as NumPy `.npz` archives (never pickle), and the
random state a resumed run needs (`ndl.random_state()` / `ndl.set_random_state(state)`).

    ndl.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict(),
              "rng": ndl.random_state(), "step": 1000}, "ckpt.npz")
    ckpt = ndl.load("ckpt.npz")                        # the same nesting: ckpt["optimizer"]["state"][0]["m"]
    model.load_state_dict(ckpt["model"]); opt.load_state_dict(ckpt["optimizer"])

Under mpiexec every rank saves a file of its own (`f"ckpt.rank{dist.rank()}.npz"`): its RNG state differs from the
others', and a ZeroRedundancyOptimizer's state_dict() is that rank's shard. What can be saved, the file's layout
and why a save never destroys the last good file: `save`'s docstring.

Why .npz and not pickle (PyTorch's torch.save): loading a pickle runs whatever code the file names, so a
downloaded checkpoint could do anything. Here arrays are read with `allow_pickle=False` and the manifest with
`json`, so a file is data and nothing else.
"""
import json
import math
import os
import secrets
import stat
import zipfile

import ml_dtypes
import numpy as np
from numpy.lib import format as npy_format

__all__ = ["load", "random_state", "save", "set_random_state"]

MANIFEST = "__needle_manifest__"  # the archive member holding the manifest (JSON as uint8 bytes)
FORMAT_VERSION = 2  # 1 was the manifest-less format of dotted keys and ":bfloat16" suffixes
_PLAIN = (bool, int, float, str, type(None))  # stored in the manifest itself, exactly (JSON)


# ----- save: the object -> (manifest nodes, arrays) -> a zip written to a temporary file, renamed ---------------------
def _as_numpy(value, where):
    """A Tensor, NDArray or array-like as a NumPy array that .npy stores without pickle, or TypeError."""
    try:
        array = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
    except ValueError:  # a ragged sequence
        array = np.empty((), dtype=object)
    if array.dtype.hasobject:  # would need pickle to store, and pickle is what we refuse to load
        hint = " (for a Module, save its state_dict())" if hasattr(value, "state_dict") else ""
        raise TypeError(f"ndl.save: cannot store {type(value).__name__} {where}: only dicts, lists, tuples, "
                        f"Tensors, NDArrays, NumPy arrays, numbers, strings and None can be saved{hint}")
    return array


def _describe(path):
    return f"at key {path!r}" if path else "at the top level"


def _encode(obj):
    """(manifest nodes, {member name: array}) for `obj`: a pre-order walk with an explicit stack."""
    nodes, arrays, containers = [], {}, set()
    stack = [(obj, "", None, None)]  # (value, its key path, the parent's child list, index in it)
    while stack:
        value, path, siblings, index = stack.pop()
        if siblings is not None:
            siblings[index] = len(nodes)
        if isinstance(value, (dict, list, tuple)):
            if id(value) in containers:
                raise ValueError(f"ndl.save: the same {type(value).__name__} appears twice (or inside itself) "
                                 f"{_describe(path)}")
            containers.add(id(value))
            if isinstance(value, dict):
                bad = [k for k in value if type(k) not in (str, int)]
                if bad:
                    raise TypeError(f"ndl.save: dict keys must be str or int, got {bad[0]!r} {_describe(path)}")
                items = [(f"{path}.{k}" if path else str(k), v) for k, v in value.items()]
                node = ["dict", [[k, None] for k in value]]  # [key, child node], the child filled in below
                slots = [(pair, 1) for pair in node[1]]
            else:
                items = [(f"{path}[{k}]", v) for k, v in enumerate(value)]
                node = [type(value).__name__, [None] * len(value)]
                slots = [(node[1], k) for k in range(len(value))]
            nodes.append(node)
            for (child_path, child), (holder, at) in reversed(list(zip(items, slots))):
                stack.append((child, child_path, holder, at))
        elif type(value) in _PLAIN:
            nodes.append(["value", value])
        else:
            array = _as_numpy(value, _describe(path))
            name = f"arr_{len(arrays)}"
            dtype = array.dtype.name if array.dtype != np.dtype(ml_dtypes.bfloat16) else "bfloat16"
            arrays[name] = array.view(np.uint16) if dtype == "bfloat16" else array
            nodes.append(["scalar" if isinstance(value, np.generic) else "array", name, dtype])
    return nodes, arrays


def _write_npz(file, members):
    """members {name: array} as an uncompressed .npz (what np.savez writes), never pickling."""
    with zipfile.ZipFile(file, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in members.items():
            with archive.open(name + ".npy", "w", force_zip64=True) as member:
                npy_format.write_array(member, array, allow_pickle=False)


def _replace_atomically(path, members):
    """Write the archive to a temporary file beside `path`, make it durable, rename it over `path`."""
    folder = os.path.dirname(os.path.abspath(path))
    temporary = f"{path}.{secrets.token_hex(4)}.tmp"
    try:
        with open(temporary, "xb") as f:
            _write_npz(f, members)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(temporary, path)
    except BaseException:  # also KeyboardInterrupt: no temporary file is left behind
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    if os.name == "posix":  # the rename itself made durable (a folder can be opened and fsynced there)
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _npz_path(path):
    """`path` as a string ending in .npz (what np.savez writes to)."""
    path = os.fspath(path)
    return path if path.endswith(".npz") else path + ".npz"


def save(obj, path):
    """Write `obj` (nested dicts, lists and tuples of Tensors, arrays, numbers and strings) to `path` as .npz,
    atomically: the file at `path` is the old one or the new one, never a broken one. Returns the path.

    What can be saved, nested as deep as you like: dicts (str or int keys, order kept), lists and tuples; Tensors,
    NDArrays and NumPy arrays, which come back as NumPy arrays on the host in their dtype (a Tensor's device is not
    stored: `load_state_dict` puts each value on its parameter's device); NumPy scalars, which come back as NumPy
    scalars; and bool, int, float, str and None, which come back as themselves. A path without the `.npz` suffix
    gets it, in `save` as `np.savez` does and in `load` alike, so `save(x, "w")` and `load("w")` both mean `w.npz`.

    The file: a zip of .npy members "arr_0", "arr_1", ... (one per array, in the order they were met) and a member
    "__needle_manifest__", UTF-8 JSON: the nesting as a flat table of nodes (a container's children come after it,
    so `load` rebuilds it bottom-up, without recursion), the plain values, and each array's dtype. Dtypes live in
    the manifest, not in names: .npy has no bfloat16, so a bfloat16 array is stored as its uint16 bits and the
    manifest says "bfloat16". Files of the earlier format (no manifest; nested dicts flattened to dotted keys)
    still load, as the flat dict they hold.

    A save never destroys the last good file: it writes `<path>.<random>.tmp` in the same folder, fsyncs it and
    renames it over `path` (atomic), then fsyncs the folder. A reader sees the old file or the new one, never half
    of one; a save that fails removes its temporary file, and one killed outright (SIGKILL, power loss) may leave
    the .tmp behind but has not touched `path`.
    """
    nodes, arrays = _encode(obj)  # everything converted before the file is opened: a bad value writes nothing
    manifest = json.dumps({"format": "needle", "version": FORMAT_VERSION, "nodes": nodes})
    members = {**arrays, MANIFEST: np.frombuffer(manifest.encode("utf-8"), dtype=np.uint8)}
    path = _save_target(path)
    _replace_atomically(path, members)
    return path


def _save_target(path):
    """The file `save` replaces: `path` with .npz, or the file a symbolic link there points at. A folder is refused
    (not written as `<folder>.npz` beside it), and so is a name that is not a regular file (a device, a FIFO): the
    rename would replace the node itself."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"ndl.save: {os.fspath(path)} is a folder; give a file name")
    path = _npz_path(path)
    path = os.path.realpath(path) if os.path.islink(path) else path
    if os.path.exists(path) and not os.path.isfile(path):
        raise FileExistsError(f"ndl.save: {path} exists and is not a regular file (a folder, a device, a FIFO)")
    return path


# ----- load: manifest -> nodes rebuilt bottom-up -----------------------------------------------------------------
_NPY_HEADERS = {(1, 0): npy_format.read_array_header_1_0, (2, 0): npy_format.read_array_header_2_0}


def _member(archive, name):
    """The array of member `name`, its .npy header checked first against the bytes the member holds: NumPy makes
    the array a header claims before reading into it, so a corrupt shape of 10^12 elements would be a MemoryError
    (or all free memory taken) instead of an error about the file."""
    info = archive.zip.getinfo(name + ".npy")
    with archive.zip.open(info.filename) as member:
        try:
            version = npy_format.read_magic(member)
        except ValueError:  # (NumPy would hand the member back as bytes)
            version = None
        read_header = _NPY_HEADERS.get(version)
        if read_header is None:
            raise ValueError(f"member {name!r} is not in a .npy format ndl.save writes")
        shape, _, dtype = read_header(member)
        claimed, held = math.prod(shape) * dtype.itemsize, info.file_size - member.tell()
    if claimed > held:
        raise ValueError(f"member {name!r} claims shape {shape} of {dtype} ({claimed} bytes) but holds {held} bytes")
    return archive[name]


def _stored_array(archive, name, dtype):
    array = _member(archive, name)
    stored = "uint16" if dtype == "bfloat16" else dtype
    if array.dtype.name != stored:
        raise ValueError(f"member {name!r} holds {array.dtype.name}, the manifest says {dtype}")
    return array.view(ml_dtypes.bfloat16) if dtype == "bfloat16" else array


def _decode(manifest, archive):
    """The saved object from the manifest's node table (children after their parent: built last to first)."""
    if not isinstance(manifest, dict) or manifest.get("format") != "needle" or \
            manifest.get("version") != FORMAT_VERSION or not isinstance(manifest.get("nodes"), list):
        raise ValueError(f"the manifest is not one of ndl.save's format {FORMAT_VERSION}")
    nodes = manifest["nodes"]
    if not nodes:
        raise ValueError("the manifest has no nodes")
    members = set(archive.files)
    values = [None] * len(nodes)

    def child(parent, k):
        if type(k) is not int or not parent < k < len(nodes):
            raise ValueError(f"node {parent} names child {k!r}, not a later node")
        return values[k]

    for i in reversed(range(len(nodes))):
        node = nodes[i]
        kind = node[0] if isinstance(node, list) and node else None
        if kind == "value" and len(node) == 2 and type(node[1]) in _PLAIN:
            values[i] = node[1]
        elif kind in ("array", "scalar") and len(node) == 3 and node[1] in members and isinstance(node[2], str):
            array = _stored_array(archive, node[1], node[2])
            values[i] = array[()] if kind == "scalar" else array
        elif kind in ("list", "tuple") and len(node) == 2 and isinstance(node[1], list):
            items = [child(i, k) for k in node[1]]
            values[i] = items if kind == "list" else tuple(items)
        elif kind == "dict" and len(node) == 2 and isinstance(node[1], list) and all(
                isinstance(pair, list) and len(pair) == 2 and type(pair[0]) in (str, int) for pair in node[1]):
            values[i] = {key: child(i, k) for key, k in node[1]}
        else:
            raise ValueError(f"node {i} is not one ndl.save writes: {str(node)[:80]}")
    return values[0]


_LEGACY_ARRAY_KEY = "__array__"  # format 1: the key of a lone array, which `load` returns unwrapped
_LEGACY_BFLOAT16_SUFFIX = ":bfloat16"  # format 1: bfloat16 arrays stored as uint16 under key + this suffix


def _decode_legacy(archive):
    """A file of the earlier format: a lone array, or the flat {dotted key: array} dict it holds."""
    arrays = {}
    for key in archive.files:
        if key.endswith(_LEGACY_BFLOAT16_SUFFIX):
            arrays[key[:-len(_LEGACY_BFLOAT16_SUFFIX)]] = _member(archive, key).view(ml_dtypes.bfloat16)
        else:
            arrays[key] = _member(archive, key)
    return arrays[_LEGACY_ARRAY_KEY] if list(arrays) == [_LEGACY_ARRAY_KEY] else arrays


def _open_regular_file(path):
    """`path` opened for reading, if it is a regular file. A FIFO is refused, not waited on: opening one for reading
    blocks until a writer comes, so it is opened non-blocking, and the check is made on what was opened."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"ndl.load: no such file {path!r} (save() and load() add .npz to a path without "
                                f"it)") from None
    except OSError as err:
        raise type(err)(err.errno, f"ndl.load: cannot open {path!r}: {err.strerror}") from err
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"ndl.load: {path!r} is not a regular file (a FIFO, a device or a folder): only a file "
                         f"ndl.save wrote can be loaded")
    return os.fdopen(fd, "rb")


def _read(f):
    """The object saved in the open file `f`."""
    if f.read(4) != b"PK\x03\x04":  # (np.load would read a lone .npy: an array as large as its header claims)
        raise ValueError("it is not a zip archive")
    f.seek(0)
    archive = np.load(f, allow_pickle=False)  # never unpickles: a pickle or an object array raises
    if MANIFEST not in archive.files:
        return _decode_legacy(archive)
    manifest = json.loads(_member(archive, MANIFEST).tobytes().decode("utf-8"))
    return _decode(manifest, archive)


def load(path):
    """Read a file written by `save`: the object that was saved, arrays as NumPy arrays (see above)."""
    path = _npz_path(path)
    with _open_regular_file(path) as f:  # ours to close, also when np.load fails half-way through a bad zip
        try:
            return _read(f)
        except MemoryError as err:  # (a member's size is checked first: this one does fit in the file)
            raise MemoryError(f"ndl.load: {path!r} holds an array larger than the memory free: {err}") from err
        except Exception as err:
            # A corrupt file fails wherever the corruption is met: in zipfile (a bad CRC, an "encrypted" member,
            # an unknown compression method: NotImplementedError), NumPy's .npy header parser (tokenize's
            # TokenError, ast's SyntaxError, ...) or json. Each is the file's fault, so each is this one error.
            raise ValueError(f"ndl.load: {path!r} is not an .npz archive of plain arrays as ndl.save writes "
                             f"(pickled objects are never loaded): {type(err).__name__}: {err}") from err


# ----- the random state: everything needle draws comes from NumPy's global RNG ------------------------------------
def random_state():
    """The state of NumPy's global RNG, from which needle draws everything random (initialization, dropout's
    masks and seeds, DataLoader's shuffles): a dict of an array and numbers that `ndl.save` stores as it is."""
    return np.random.get_state(legacy=False)


_MT19937_WORDS = 624  # an MT19937 state: 624 32-bit words of key, and the position of the next one to use


def _check_mt19937(state):
    """Raise ValueError unless the key and position of `state` make an MT19937 state. NumPy takes them as they are,
    and its next draw reads key[pos]: a pos past 624 read outside the key (a crash, not an error)."""
    if isinstance(state, dict):
        inner = state.get("state")
        key, pos = (inner.get("key"), inner.get("pos")) if isinstance(inner, dict) else (None, None)
    else:  # the legacy tuple: ("MT19937", key, pos, has_gauss, cached_gaussian)
        key, pos = (state[1], state[2]) if isinstance(state, tuple) and len(state) == 5 else (None, None)
    key = np.asarray(key)
    if key.shape != (_MT19937_WORDS,) or key.dtype.kind not in "iu" or key.min() < 0 or key.max() >= 2**32:
        raise ValueError(f"an MT19937 key is {_MT19937_WORDS} unsigned 32-bit integers, got shape {key.shape} of "
                         f"{key.dtype}")
    if isinstance(pos, bool) or not isinstance(pos, (int, np.integer)) or not 0 <= pos <= _MT19937_WORDS:
        raise ValueError(f"an MT19937 position is an integer in [0, {_MT19937_WORDS}], got {pos!r}")


def set_random_state(state):
    """Restore NumPy's global RNG to `state`, as `random_state()` returned it (or `ndl.load` gave it back)."""
    try:
        _check_mt19937(state)
        np.random.set_state(state)
    except (TypeError, ValueError, KeyError) as err:
        raise ValueError(f"ndl.set_random_state: not a state random_state() returns: {err}") from err
