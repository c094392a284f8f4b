"""Saving and loading: Module.state_dict / load_state_dict, and ndl.save / ndl.load (.npz, never pickle)."""
import pickle
import zipfile

import numpy as np
import pytest

import needle as ndl
from needle import backend_ndarray as nd
from needle import nn

from conftest import DEVICES


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


@pytest.mark.parametrize("device", [DEVICES[0], DEVICES[1]])
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
    """A lone Tensor loads as a NumPy array; nested dicts come back flat with dotted keys, in order."""
    t = ndl.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3), device=nd.cpu_numpy())
    path = ndl.save(t, tmp_path / "t.npz")
    loaded = ndl.load(path)
    assert type(loaded) is np.ndarray and loaded.dtype == np.float32
    np.testing.assert_array_equal(loaded, t.numpy())

    obj = {"model": {"w": t, "b": t.realize_cached_data()}, "step": 3, "lr": np.float64(0.5)}
    loaded = ndl.load(ndl.save(obj, tmp_path / "ckpt.npz"))
    assert list(loaded) == ["model.w", "model.b", "step", "lr"]
    np.testing.assert_array_equal(loaded["model.b"], t.numpy())
    assert loaded["step"] == 3 and loaded["lr"] == 0.5


def test_save_and_load_agree_on_a_path_without_npz(tmp_path):
    path = ndl.save({"a": np.ones(2)}, tmp_path / "weights")
    assert path == str(tmp_path / "weights.npz") and (tmp_path / "weights.npz").exists()
    np.testing.assert_array_equal(ndl.load(tmp_path / "weights")["a"], np.ones(2))
    with pytest.raises(FileNotFoundError, match=r"no such file '.*nothing\.npz'"):
        ndl.load(tmp_path / "nothing")


def test_save_rejects_what_would_need_pickle(tmp_path):
    with pytest.raises(TypeError, match=r"cannot store Sequential at key '__array__'.*save its state_dict\(\)"):
        ndl.save(_model(nd.cpu_numpy(), seed=0), tmp_path / "m.npz")
    with pytest.raises(TypeError, match="cannot store object at key 'opt.state'"):
        ndl.save({"opt": {"state": object()}}, tmp_path / "m.npz")
    with pytest.raises(TypeError, match="cannot store list at key 'x'"):  # ragged
        ndl.save({"x": [np.ones(2), np.ones(3)]}, tmp_path / "m.npz")
    with pytest.raises(ValueError, match="'a.b' appears twice"):
        ndl.save({"a.b": 1, "a": {"b": 2}}, tmp_path / "m.npz")


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
