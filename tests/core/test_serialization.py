"""Saving and loading: Module.state_dict / load_state_dict, and ndl.save / ndl.load (.npz, never pickle)."""
import errno
import os
import pathlib
import pickle
import subprocess
import sys
import textwrap
import zipfile

import ml_dtypes
import numpy as np
import pytest
from numpy.lib import format as npy_format

import needle as ndl
from needle import backend_ndarray as nd
from needle import nn


def _model(device, seed):
    np.random.seed(seed)
    return nn.Sequential(nn.Linear(4, 6, device=device), nn.BatchNorm1d(6, device=device), nn.ReLU(),
                         nn.Linear(6, 3, device=device))


def _batch(device, seed=1):
    return ndl.Tensor(np.random.RandomState(seed).randn(8, 4).astype(np.float32), device=device,
                      requires_grad=False)


KEYS = ["modules.0.weight", "modules.0.bias", "modules.1.weight", "modules.1.bias", "modules.1.running_mean",
        "modules.1.running_var", "modules.3.weight", "modules.3.bias"]


def test_state_dict_names_parameters_and_buffers_and_copies_values():
    """Parameters and BatchNorm's running statistics, by attribute path, in order; values are NumPy copies."""
    model = _model(nd.cpu_numpy(), seed=0)
    state = model.state_dict()
    assert list(state) == KEYS
    assert all(type(v) is np.ndarray for v in state.values())
    assert [k for k, _ in model.named_buffers()] == ["modules.1.running_mean", "modules.1.running_var"]
    np.testing.assert_array_equal(state["modules.1.running_var"], np.ones(6, np.float32))
    before = model.modules[0].weight.numpy().copy()
    state["modules.0.weight"][:] = 7.0  # a copy: the model is untouched
    np.testing.assert_array_equal(model.modules[0].weight.numpy(), before)


@pytest.mark.devices("cpu", "cpu_numpy")
@pytest.mark.smoke
def test_round_trip_through_save_and_load_gives_identical_outputs(device, tmp_path):
    """A trained model's state_dict, saved and loaded into a fresh model, gives bit-identical outputs."""
    model = _model(device, seed=0)
    opt = ndl.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):  # trains the weights and moves BatchNorm's running statistics
        model(_batch(device, seed=step)).sum().backward()
        opt.step()
    path = ndl.save(model.state_dict(), tmp_path / "model.npz")
    assert path == str(tmp_path / "model.npz")

    fresh = _model(device, seed=5)
    params = fresh.parameters()
    assert fresh.load_state_dict(ndl.load(path)) == ([], [])
    assert all(a is b for a, b in zip(fresh.parameters(), params)) and all(p.device == device for p in params)
    assert all(p.dtype == "float32" for p in params)
    for m in (model, fresh):
        m.eval()
    x = _batch(device, seed=9)
    np.testing.assert_array_equal(fresh(x).numpy(), model(x).numpy())
    np.testing.assert_array_equal(fresh.modules[1].running_mean.numpy(), model.modules[1].running_mean.numpy())


def test_load_state_dict_strict_errors_name_the_keys():
    model = _model(nd.cpu_numpy(), seed=0)
    state = model.state_dict()
    with pytest.raises(RuntimeError, match=r"missing keys \['modules.1.running_var'\], unexpected keys \[\]"):
        model.load_state_dict({k: v for k, v in state.items() if k != "modules.1.running_var"})
    with pytest.raises(RuntimeError, match=r"missing keys \[\], unexpected keys \['modules.9.weight'\]"):
        model.load_state_dict({**state, "modules.9.weight": np.zeros(3)})
    bad = {**state, "modules.3.bias": np.zeros((3, 1), np.float32)}
    with pytest.raises(RuntimeError, match=r"'modules.3.bias' has shape \(3, 1\) in the state dict, but \(1, 3\)"):
        model.load_state_dict(bad)
    with pytest.raises(RuntimeError, match="'modules.3.bias' has shape"):  # shapes are checked with strict=False too
        model.load_state_dict(bad, strict=False)


def test_load_state_dict_checks_everything_before_writing_and_non_strict_loads_the_rest():
    model = _model(nd.cpu_numpy(), seed=0)
    before = model.state_dict()
    new = {k: v + 1 for k, v in before.items()}
    new["modules.3.bias"] = np.zeros(5, np.float32)  # the last key is bad: nothing may have been written
    with pytest.raises(RuntimeError):
        model.load_state_dict(new)
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v, before[k])
    partial = {"modules.0.weight": ndl.Tensor(new["modules.0.weight"]), "extra": np.zeros(1)}  # a Tensor works too
    missing, unexpected = model.load_state_dict(partial, strict=False)
    assert missing == KEYS[1:] and unexpected == ["extra"]
    np.testing.assert_array_equal(model.modules[0].weight.numpy(), new["modules.0.weight"])
    np.testing.assert_array_equal(model.modules[0].bias.numpy(), before["modules.0.bias"])


def test_save_and_load_tensors_arrays_and_nested_dicts(tmp_path):
    """A lone Tensor loads as a NumPy array; nested dicts come back nested, in order, numbers as they were."""
    t = ndl.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3), device=nd.cpu_numpy())
    path = ndl.save(t, tmp_path / "t.npz")
    loaded = ndl.load(path)
    assert type(loaded) is np.ndarray and loaded.dtype == np.float32
    np.testing.assert_array_equal(loaded, t.numpy())

    obj = {"model": {"w": t, "b": t.realize_cached_data()}, "step": 3, "lr": np.float64(0.5)}
    loaded = ndl.load(ndl.save(obj, tmp_path / "ckpt.npz"))
    assert list(loaded) == ["model", "step", "lr"] and list(loaded["model"]) == ["w", "b"]
    np.testing.assert_array_equal(loaded["model"]["b"], t.numpy())
    assert type(loaded["model"]["w"]) is np.ndarray and loaded["model"]["w"].dtype == np.float32
    assert loaded["step"] == 3 and type(loaded["step"]) is int
    assert loaded["lr"] == 0.5 and type(loaded["lr"]) is np.float64


def test_save_and_load_agree_on_a_path_without_npz(tmp_path):
    path = ndl.save({"a": np.ones(2)}, tmp_path / "weights")
    assert path == str(tmp_path / "weights.npz") and (tmp_path / "weights.npz").exists()
    np.testing.assert_array_equal(ndl.load(tmp_path / "weights")["a"], np.ones(2))
    with pytest.raises(FileNotFoundError, match=r"no such file '.*nothing\.npz'"):
        ndl.load(tmp_path / "nothing")


def test_save_refuses_a_folder_and_a_name_that_is_not_a_regular_file_and_writes_through_a_link(tmp_path):
    # save(obj, folder) used to write folder.npz beside it; the rename replaced a FIFO or a link with a file.
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(IsADirectoryError, match="is a folder"):
        ndl.save({"x": 1}, folder)
    os.mkfifo(tmp_path / "fifo.npz")
    with pytest.raises(FileExistsError, match="not a regular file"):
        ndl.save({"x": 1}, tmp_path / "fifo")
    assert sorted(os.listdir(tmp_path)) == ["fifo.npz", "folder"] and (tmp_path / "fifo.npz").is_fifo()
    ndl.save({"x": 1}, tmp_path / "target.npz")
    (tmp_path / "link.npz").symlink_to(tmp_path / "target.npz")
    ndl.save({"x": 2}, tmp_path / "link")
    assert (tmp_path / "link.npz").is_symlink() and ndl.load(tmp_path / "target.npz") == {"x": 2}


def test_save_rejects_what_would_need_pickle(tmp_path):
    with pytest.raises(TypeError, match=r"cannot store Sequential at the top level.*save its state_dict\(\)"):
        ndl.save(_model(nd.cpu_numpy(), seed=0), tmp_path / "m.npz")
    with pytest.raises(TypeError, match="cannot store object at key 'opt.state'"):
        ndl.save({"opt": {"state": object()}}, tmp_path / "m.npz")
    with pytest.raises(TypeError, match=r"cannot store ndarray at key 'x\[1\]'"):  # an object array
        ndl.save({"x": [np.ones(2), np.array([np.ones(2), np.ones(3)], dtype=object)]}, tmp_path / "m.npz")
    with pytest.raises(TypeError, match=r"dict keys must be str or int, got \(1, 2\) at key 'a'"):
        ndl.save({"a": {(1, 2): 3}}, tmp_path / "m.npz")
    looped = {"a": []}
    looped["a"].append(looped)
    with pytest.raises(ValueError, match=r"the same dict appears twice \(or inside itself\) at key 'a\[0\]'"):
        ndl.save(looped, tmp_path / "m.npz")
    assert list(tmp_path.iterdir()) == []  # a value that cannot be stored: nothing was written


_SIDE_EFFECTS = []


class _Payload:
    """Unpickling this calls a function: what a malicious checkpoint would do."""

    def __reduce__(self):
        return _SIDE_EFFECTS.append, ("code ran",)


@pytest.mark.parametrize("kind", ["pickle", "object-array", "npy", "text", "truncated"])
def test_load_refuses_non_npz_and_pickled_files_with_a_clear_error(tmp_path, kind):
    """No code is ever executed: pickles and object arrays are refused, and so is anything not an .npz."""
    path = tmp_path / "evil.npz"
    if kind == "pickle":
        path.write_bytes(pickle.dumps(_Payload()))
    elif kind == "object-array":  # a valid .npz whose member is a pickled object array
        with open(path, "wb") as f:
            np.savez(f, w=np.array([_Payload()], dtype=object))
    elif kind == "npy":
        with open(path, "wb") as f:
            np.save(f, np.ones(3))
    elif kind == "text":
        path.write_text("not an archive\n")
    else:
        ndl.save({"w": np.ones(1000)}, path)
        path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match=r"ndl.load: '.*evil\.npz' is not an \.npz archive of plain arrays"):
        ndl.load(path)
    assert _SIDE_EFFECTS == []
    assert zipfile.is_zipfile(path) == (kind == "object-array")


# ----- the format: nesting and dtypes in a manifest ----------------------------------------------------------------
def test_every_kind_of_value_comes_back_as_it_was_saved(tmp_path):
    """dicts with str and int keys, lists, tuples, empty ones; arrays of every dtype (bfloat16 too, zero-size,
    0-d); NumPy scalars; bool, int, float (nan and inf too), str and None."""
    obj = {"state": {0: {"m": np.arange(3, dtype=np.float32)}, 2: {"pair": (np.zeros((2, 2), np.uint8),
                                                                            np.ones(1, np.float32))}},
           "groups": [{"lr": 0.1, "eps": (1e-30, 1e-3), "none": None, "on": True, "name": "adam", "t": 2**70}],
           "empty": {}, "nothing": [], "unit": (), "floats": [float("inf"), -0.0],
           "bf16": np.array([1.5, -2.25], dtype=ml_dtypes.bfloat16), "zero_size": np.zeros((0, 3), np.int32),
           "scalar_array": np.array(7, dtype=np.int8), "np_scalar": np.float32(0.25), "nan": float("nan")}
    loaded = ndl.load(ndl.save(obj, tmp_path / "all.npz"))
    assert list(loaded) == list(obj) and list(loaded["state"]) == [0, 2]
    assert loaded["groups"] == [{"lr": 0.1, "eps": (1e-30, 1e-3), "none": None, "on": True, "name": "adam",
                                 "t": 2**70}]
    assert loaded["empty"] == {} and loaded["nothing"] == [] and loaded["unit"] == ()
    assert loaded["floats"] == [float("inf"), -0.0] and np.signbit(loaded["floats"][1])
    assert np.isnan(loaded["nan"])
    q, absmax = loaded["state"][2]["pair"]
    assert q.dtype == np.uint8 and q.shape == (2, 2) and absmax.dtype == np.float32
    for key in ("bf16", "zero_size", "scalar_array"):
        assert loaded[key].dtype == obj[key].dtype and loaded[key].shape == obj[key].shape
        assert loaded[key].tobytes() == obj[key].tobytes()
    assert type(loaded["np_scalar"]) is np.float32 and loaded["np_scalar"] == 0.25


def test_keys_are_kept_exactly_and_dtypes_live_in_the_manifest(tmp_path):
    """The earlier format kept dtypes in key suffixes and flattened nesting into dots: a key "w:bfloat16" came
    back as another tensor, and "w" with "w:bfloat16", or "a.b" with {"a": {"b"}}, kept only one."""
    w16 = np.array([1.0, 3.5], dtype=ml_dtypes.bfloat16)
    obj = {"w": w16, "w:bfloat16": np.array([7, 8], np.uint16), "a.b": np.ones(1), "a": {"b": np.zeros(1)}}
    loaded = ndl.load(ndl.save(obj, tmp_path / "k.npz"))
    assert list(loaded) == ["w", "w:bfloat16", "a.b", "a"]
    assert loaded["w"].dtype == ml_dtypes.bfloat16 and loaded["w"].tobytes() == w16.tobytes()
    assert loaded["w:bfloat16"].dtype == np.uint16 and loaded["w:bfloat16"].tolist() == [7, 8]
    assert loaded["a.b"].tolist() == [1.0] and loaded["a"]["b"].tolist() == [0.0]
    with zipfile.ZipFile(tmp_path / "k.npz") as archive:  # member names carry no dtype
        assert sorted(archive.namelist()) == ["__needle_manifest__.npy"] + [f"arr_{i}.npy" for i in range(4)]


def test_files_of_the_previous_format_still_load(tmp_path):
    """No manifest: the flat dict of dotted keys it holds, ":bfloat16" suffixes read as before, a lone array
    unwrapped."""
    bits = np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16).view(np.uint16)
    np.savez(tmp_path / "old.npz", **{"model.w": np.ones(2, np.float32), "model.e:bfloat16": bits})
    loaded = ndl.load(tmp_path / "old.npz")
    assert list(loaded) == ["model.w", "model.e"] and loaded["model.e"].dtype == ml_dtypes.bfloat16
    assert loaded["model.e"].astype(np.float32).tolist() == [1.5, -2.0]
    np.savez(tmp_path / "lone.npz", __array__=np.arange(3))
    assert ndl.load(tmp_path / "lone.npz").tolist() == [0, 1, 2]


def _archive_with_manifest(path, manifest, **arrays):
    members = {**arrays, "__needle_manifest__": np.frombuffer(manifest.encode(), dtype=np.uint8)}
    np.savez(path, **members)


@pytest.mark.parametrize("manifest, why", [
    ('{"format": "needle", "version": 2, "nodes": [["array", "missing", "float32"]]}', "is not one ndl.save"),
    ('{"format": "needle", "version": 2, "nodes": [["list", [0]]]}', "names child 0, not a later node"),
    ('{"format": "needle", "version": 2, "nodes": [["array", "arr_0", "float64"]]}', "the manifest says float64"),
    ('{"format": "needle", "version": 2, "nodes": [["object", "os.system"]]}', "is not one ndl.save"),
    ('{"format": "needle", "version": 9, "nodes": []}', "not one of ndl.save's format 2"),
    ('{"format": "needle", "version": 2, "nodes": ' + "[" * 100000 + "]" * 100000 + "}", "not an .npz"),
    ("not json", "not an .npz"),
], ids=["missing-member", "cycle", "wrong-dtype", "unknown-node", "version", "deep-nesting", "not-json"])
def test_a_bad_manifest_is_a_clear_error(tmp_path, manifest, why):
    path = tmp_path / "bad.npz"
    _archive_with_manifest(path, manifest, arr_0=np.ones(2, np.float32))
    with pytest.raises(ValueError, match=r"ndl.load: '.*bad\.npz' is not an \.npz archive") as err:
        ndl.load(path)
    assert why in str(err.value)


def _npy_bytes(header, data=b""):
    """A .npy member whose header text is `header` (padded as NumPy pads it), then `data`."""
    text = header.encode("latin1")
    text += b" " * (-(10 + len(text) + 1) % 64) + b"\n"
    return npy_format.MAGIC_PREFIX + b"\x01\x00" + len(text).to_bytes(2, "little") + text + data


def _corrupt(path, kind):
    """A file `ndl.save` wrote, corrupted as byte-flipped checkpoints were where ndl.load's wrapper let the error
    through (with valid CRCs: in a large member the corruption is met before the CRC is checked)."""
    w = np.arange(12000, dtype=np.float32)
    good = pathlib.Path(ndl.save({"w": w}, path)).read_bytes()
    if kind in ("encrypted", "unknown-compression"):
        data, entry = bytearray(good), good.index(b"PK\x01\x02")  # arr_0.npy's central directory entry (first)
        if kind == "encrypted":
            data[entry + 8] |= 1  # flag bit 0: zipfile's RuntimeError, "password required"
        else:
            data[entry + 10] = 99  # compression method 99: zipfile's NotImplementedError
        pathlib.Path(path).write_bytes(bytes(data))
        return
    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    if kind == "manifest-not-npy":  # NumPy gives a member without the .npy magic back as bytes: AttributeError
        members["__needle_manifest__.npy"] = b'{"format": "needle", "version": 2, "nodes": []}'
    else:
        shape = {"unterminated-header": "(12000, }", "claims-10^12-elements": "(1000000000000,), }"}[kind]
        members["arr_0.npy"] = _npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': " + shape, w.tobytes())
    with zipfile.ZipFile(path, "w") as archive:
        for name, member in members.items():
            archive.writestr(name, member)


@pytest.mark.parametrize("kind, cause", [
    ("encrypted", "RuntimeError: File 'arr_0.npy' is encrypted, password required"),
    ("unknown-compression", "NotImplementedError: That compression method is not supported"),
    ("unterminated-header", "TokenError"),
    ("manifest-not-npy", "member '__needle_manifest__' is not in a .npy format"),
    ("claims-10^12-elements", "member 'arr_0' claims shape (1000000000000,) of float32 (4000000000000 bytes) but "
                              "holds 48000 bytes"),
])
def test_a_corrupt_file_is_ndl_loads_own_error_naming_it(tmp_path, kind, cause):
    """Six of 400 byte-flipped checkpoints escaped the wrapper: zipfile's RuntimeError and NotImplementedError,
    tokenize's TokenError, an AttributeError (a member that is not .npy comes back as bytes), and NumPy's bare
    MemoryError for a header claiming 10^12 elements, which it allocates before reading."""
    path = tmp_path / "bad.npz"
    _corrupt(path, kind)
    with pytest.raises(ValueError, match=r"^ndl.load: '.*bad\.npz' is not an \.npz archive") as err:
        ndl.load(path)
    assert cause in str(err.value)


def test_load_refuses_a_fifo_or_a_folder_at_once(tmp_path):
    """Opening a FIFO for reading waited for a writer: ndl.load blocked forever. Only regular files are read."""
    os.mkfifo(tmp_path / "fifo.npz")
    (tmp_path / "folder.npz").mkdir()
    script = textwrap.dedent(f"""
        import needle as ndl
        for name in ("fifo", "folder"):
            try:
                ndl.load({str(tmp_path)!r} + "/" + name)
            except ValueError as err:
                print(err)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and all(" is not a regular file (a FIFO, a device or a folder)" in line for line in lines)
    assert "fifo.npz" in lines[0] and "folder.npz" in lines[1]


# ----- atomic saves --------------------------------------------------------------------------------------------------
def _good_checkpoint(tmp_path):
    path = ndl.save({"w": np.arange(1000, dtype=np.float32), "step": 1}, tmp_path / "ckpt.npz")
    return path, pathlib.Path(path).read_bytes()


def test_save_writes_a_temporary_file_beside_the_target_fsyncs_it_and_renames_it(tmp_path, monkeypatch):
    path, _ = _good_checkpoint(tmp_path)
    events, fsync, replace = [], os.fsync, os.replace

    def spy_fsync(fd):
        events.append(("fsync",))
        fsync(fd)

    def spy_replace(src, dst):
        events.append(("replace", src, dst))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    ndl.save({"w": np.zeros(3), "step": 2}, path)
    monkeypatch.undo()
    assert [e[0] for e in events] == ["fsync", "replace", "fsync"]  # the file's data, the rename, the folder
    temporary, target = events[1][1:]
    assert target == path and os.path.dirname(temporary) == os.path.dirname(path) and temporary.endswith(".tmp")
    assert ndl.load(path)["step"] == 2 and os.listdir(tmp_path) == ["ckpt.npz"]


@pytest.mark.parametrize("failure", ["write", "fsync", "interrupt"])
def test_a_save_that_fails_midway_keeps_the_previous_file_and_removes_its_temporary(tmp_path, monkeypatch, failure):
    """The disk fills up after the first array (or fsync fails, or Ctrl-C arrives): the save raises, the last
    good checkpoint is byte for byte what it was, and no temporary file is left."""
    path, before = _good_checkpoint(tmp_path)
    write_array, written = npy_format.write_array, []

    def write_then_fail(f, array, **kw):
        if written:
            raise KeyboardInterrupt() if failure == "interrupt" else OSError(errno.ENOSPC, "No space left on device")
        written.append(array)
        write_array(f, array, **kw)

    if failure == "fsync":
        monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    else:
        monkeypatch.setattr(npy_format, "write_array", write_then_fail)
    with pytest.raises(KeyboardInterrupt if failure == "interrupt" else OSError):
        ndl.save({"w": np.zeros(5000, np.float32), "v": np.ones(5000, np.float32)}, path)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["ckpt.npz"]
    assert pathlib.Path(path).read_bytes() == before and ndl.load(path)["step"] == 1


@pytest.mark.skipif(os.name != "posix", reason="file-size limits (RLIMIT_FSIZE) are POSIX")
def test_a_save_past_the_file_size_limit_keeps_the_previous_file(tmp_path):
    """A real failure, not a mock: this process's file-size limit (ulimit -f), which the new checkpoint exceeds,
    set for the save alone."""
    import resource
    import signal

    path, before = _good_checkpoint(tmp_path)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing us
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        with pytest.raises(OSError) as failed:
            ndl.save({"w": np.zeros(1 << 20, np.float32)}, path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert failed.value.errno == errno.EFBIG, failed.value
    assert os.listdir(tmp_path) == ["ckpt.npz"]
    assert pathlib.Path(path).read_bytes() == before


# ----- the random state ----------------------------------------------------------------------------------------------
def test_the_random_state_survives_save_and_load(tmp_path):
    np.random.seed(3)
    np.random.randn()  # a cached Gaussian: part of the state too
    state = ndl.random_state()
    expected = (np.random.rand(5), np.random.randn(3))
    np.random.seed(99)
    ndl.set_random_state(ndl.load(ndl.save({"rng": state}, tmp_path / "rng.npz"))["rng"])
    got = (np.random.rand(5), np.random.randn(3))
    assert all(a.tobytes() == b.tobytes() for a, b in zip(got, expected))
    with pytest.raises(ValueError, match="ndl.set_random_state: not a state random_state"):
        ndl.set_random_state({"bit_generator": "MT19937"})


def test_a_random_state_that_would_read_outside_its_key_is_refused():
    """NumPy takes an MT19937 state as given, and its next draw reads key[pos]: pos 2^31 - 1 crashed the process
    (gc.py run --resume of a checkpoint carrying it too). A key is 624 uint32 words and 0 <= pos <= 624."""
    good = ndl.random_state()

    def edited(pos=None, key=None):
        state = ndl.random_state()
        state["state"] = {"key": state["state"]["key"] if key is None else key,
                          "pos": state["state"]["pos"] if pos is None else pos}
        return state

    try:
        for pos in (2**31 - 1, 625, -1, 2.5, True):
            with pytest.raises(ValueError, match=rf"not a state random_state\(\) returns: an MT19937 position is an "
                                                 rf"integer in \[0, 624\], got {pos!r}"):
                ndl.set_random_state(edited(pos=pos))
        for key in (np.zeros(623, np.uint32), np.full(624, -1, np.int64), np.zeros(624, np.float32)):
            with pytest.raises(ValueError, match=r"an MT19937 key is 624 unsigned 32-bit integers"):
                ndl.set_random_state(edited(key=key))
        ndl.set_random_state(edited(pos=624))  # every word used: the next draw makes new ones
        assert 0 <= np.random.rand() < 1
    finally:
        np.random.set_state(good)
