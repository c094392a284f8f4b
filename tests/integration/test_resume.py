"""Resuming training: k steps, a checkpoint (model + optimizer + GradScaler + RNG state through ndl.save/ndl.load),
a fresh model and optimizer loaded from it, m more steps: every parameter equals k + m uninterrupted steps byte for
byte, for every optimizer. Each test also resumes without one part of the checkpoint (the optimizer's state, the
RNG state, the scaler's state) and shows that the parameters then differ: the comparison can fail."""
import ast
import pathlib

import numpy as np
import pytest

import needle as ndl
from needle import checkpoint
from needle import distributed as dist
from needle import nn, optim
from models import LanguageModel

from conftest import COMPILED_DEVICES

OPTIMIZERS_PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "optimizers.md"

K, M = 3, 4  # steps before the checkpoint, steps after it


def _model(device, dtype="float32"):
    """An MLP with dropout: its masks, like the batches, come from NumPy's global RNG."""
    model = nn.Sequential(nn.Linear(8, 32, device=device), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(32, 32, device=device), nn.ReLU(), nn.Linear(32, 4, device=device))
    return model.astype(dtype) if dtype != "float32" else model


def _step(model, opt, device, scaler=None, dtype="float32"):
    """One training step on a batch drawn from the global RNG; whether the optimizer stepped."""
    x = ndl.Tensor(np.random.randn(16, 8).astype(np.float32), device=device, requires_grad=False)
    y = ndl.Tensor(np.random.randint(0, 4, 16), device=device, requires_grad=False)
    opt.reset_grad()
    if scaler is None:
        nn.SoftmaxLoss()(model(x.astype(dtype) if dtype != "float32" else x), y).backward()
        opt.step()
        return True
    with ndl.autocast("float16"):
        loss = nn.SoftmaxLoss()(model(x), y)
    scaler.scale(loss).backward()
    taken = scaler.step(opt)
    scaler.update()
    return taken


def _checkpoint(model, opt, scaler):
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": ndl.random_state(), "step": K}
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    return state


def _bytes(model):
    return [p.numpy().tobytes() for p in model.parameters()]


def _resume(path, build, device, leave_out=None, dtype="float32"):
    """A fresh run (fresh model, optimizer and scaler, the RNG scrambled) loaded from `path` without the part
    `leave_out` names, then trained M steps: its parameters' bytes and the steps taken."""
    np.random.seed(12345)  # a fresh process: a different RNG state and model initialization
    model, opt, scaler = build(device)
    ckpt = ndl.load(path)
    assert ckpt["step"] == K
    model.load_state_dict(ckpt["model"])
    if leave_out != "optimizer":
        opt.load_state_dict(ckpt["optimizer"])
    if scaler is not None and leave_out != "scaler":
        scaler.load_state_dict(ckpt["scaler"])
    if leave_out != "rng":
        ndl.set_random_state(ckpt["rng"])
    taken = [_step(model, opt, device, scaler, dtype) for _ in range(M)]
    return _bytes(model), taken, opt


def _interrupted_equals_uninterrupted(build, device, tmp_path, leave_outs, dtype="float32"):
    """Train K steps, save, train M more (the uninterrupted run); resume from the file in a fresh run: bytes
    equal. Resuming without each part in `leave_outs` must differ. Returns (the resumed optimizer, steps taken
    after the checkpoint)."""
    np.random.seed(0)
    model, opt, scaler = build(device)
    for _ in range(K):
        _step(model, opt, device, scaler, dtype)
    path = ndl.save(_checkpoint(model, opt, scaler), tmp_path / "ckpt.npz")
    taken = [_step(model, opt, device, scaler, dtype) for _ in range(M)]
    expected = _bytes(model)

    got, resumed_taken, resumed_opt = _resume(path, build, device, dtype=dtype)
    assert resumed_taken == taken
    assert got == expected, "resumed parameters differ from uninterrupted training"
    for part in leave_outs:
        without, _, _ = _resume(path, build, device, leave_out=part, dtype=dtype)
        assert without != expected, f"resuming without the {part} state gave the same bytes: the test is blind"
    return resumed_opt, taken


OPTIMIZERS = {
    "sgd_momentum": lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam": lambda ps: optim.Adam(ps, lr=0.01, weight_decay=1e-3),
    "adam8bit": lambda ps: optim.Adam8bit(ps, lr=0.01, min_8bit_size=256, block_size=64),
    "adafactor": lambda ps: optim.Adafactor(ps, beta1=0.9),
    "adam_offloaded": lambda ps: optim.Adam(ps, lr=0.01, offload_state=True),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("device", COMPILED_DEVICES)  # cpu, and cuda where there is one
def test_resume_is_bit_identical(name, device, tmp_path):
    """Every optimizer: model + optimizer + RNG from one file continue training to the byte; without the
    optimizer's state (a model-only checkpoint) or without the RNG state the result differs."""
    def build(device):
        model = _model(device)
        return model, OPTIMIZERS[name](model.parameters()), None

    opt, _ = _interrupted_equals_uninterrupted(build, device, tmp_path, ("optimizer", "rng"))
    if name == "adam8bit":  # the 8-bit codes came back as 8-bit codes
        assert any(opt.quantizes(p) for p in opt.params) and any(not opt.quantizes(p) for p in opt.params)
        assert all(isinstance(opt.m[p], tuple) == opt.quantizes(p) for p in opt.params)
    if name == "adam_offloaded":  # the loaded state went where this optimizer keeps it: the host
        assert opt.state_bytes() == 0 and opt.host_state_bytes() == 8 * sum(p.realize_cached_data().size
                                                                               for p in opt.params)


@pytest.mark.parametrize("device", COMPILED_DEVICES)  # cpu, and cuda where there is one
def test_resume_16_bit_parameters_master_weights_and_stochastic_rounding(device, tmp_path):
    """bfloat16 parameters: Adam's float32 master copies are state too; pure-bf16 SGD with stochastic rounding
    resumes its rounding seeds (rounding_steps) and its 16-bit momentum."""
    for make in (lambda ps: optim.Adam(ps, lr=0.01),
                 lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, stochastic_rounding=True)):
        def build(device, make=make):
            model = _model(device, "bfloat16")
            return model, make(model.parameters()), None

        opt, _ = _interrupted_equals_uninterrupted(build, device, tmp_path, ("optimizer",), dtype="bfloat16")
        assert opt.master or opt._rounding_steps == (K + M) * 6


@pytest.mark.parametrize("device", COMPILED_DEVICES)  # cpu, and cuda where there is one
def test_resume_offloaded_and_not_offloaded_state_load_into_each_other(device, tmp_path):
    """Where the state lives is the loading optimizer's choice: an offloaded Adam's state dict loads into an Adam
    on the device and the other way round, with identical state."""
    np.random.seed(0)
    model = _model(device)
    host = optim.Adam(model.parameters(), lr=0.01, offload_state=True)
    for _ in range(2):
        _step(model, host, device)
    on_device = optim.Adam(model.parameters(), lr=0.01)
    on_device.load_state_dict(ndl.load(ndl.save(host.state_dict(), tmp_path / "a.npz")))
    assert on_device.host_state_bytes() == 0 and on_device.state_bytes() == host.host_state_bytes()
    back = optim.Adam(model.parameters(), lr=0.01, offload_state=True)
    back.load_state_dict(on_device.state_dict())
    assert back.state_bytes() == 0 and back.host_state_bytes() == host.host_state_bytes()
    for a, b in zip(host.state_dict()["state"].values(), back.state_dict()["state"].values()):
        assert all(a[slot].tobytes() == b[slot].tobytes() for slot in ("m", "v"))


@pytest.mark.parametrize("device", COMPILED_DEVICES)  # cpu, and cuda where there is one
def test_resume_mixed_fp16_with_grad_scaler_including_skipped_steps(device, tmp_path):
    """float16 autocast with dynamic loss scaling: a scale that grows every 2 clean steps until float16
    overflows, so steps are skipped before and after the checkpoint; the resumed run takes and skips the same
    steps and ends on the same bytes. Without the scaler's state (or the optimizer's) it does not."""
    def build(device):
        model = _model(device)
        return model, optim.Adam(model.parameters(), lr=0.01), ndl.amp.GradScaler(init_scale=2.0**12,
                                                                                   growth_interval=1)

    _, taken = _interrupted_equals_uninterrupted(build, device, tmp_path, ("optimizer", "scaler"))
    assert True in taken and False in taken, taken  # the window after the checkpoint has a skipped step


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("optimizer_class", [optim.Adam, optim.Adafactor])
@pytest.mark.parametrize("device", COMPILED_DEVICES)  # cpu, and cuda where there is one
def test_resume_zero_at_world_size_one(stage, optimizer_class, device, tmp_path):
    """ZeroRedundancyOptimizer in one process (flat partition for Adam, tensors for Adafactor): its state dict
    is the shard of rank 0 of 1 and resumes bit for bit (two ranks: tests/toolbox/distributed/resume_exact.py)."""
    def build(device):
        model = _model(device)
        return model, dist.ZeroRedundancyOptimizer(model.parameters(), optimizer_class, stage=stage), None

    opt, _ = _interrupted_equals_uninterrupted(build, device, tmp_path, ("optimizer",))
    state = opt.state_dict()
    assert (state["rank"], state["world_size"]) == (0, 1)
    assert ("shard" in state) == (optimizer_class is optim.Adam)


@pytest.mark.parametrize("device", COMPILED_DEVICES)  # cpu, and cuda where there is one
def test_a_zero_state_dict_of_another_rank_or_partition_is_refused(device):
    np.random.seed(0)
    model = _model(device)
    opt = dist.ZeroRedundancyOptimizer(model.parameters(), optim.Adam, lr=0.01)
    _step(model, opt, device)
    state = opt.state_dict()
    with pytest.raises(ValueError, match=r"the state is for rank=1, this rank has rank=0 \(each rank loads the "
                                         r"file its own rank saved\)"):
        opt.load_state_dict({**state, "rank": 1})
    with pytest.raises(ValueError, match="partition='tensors', this rank has partition='flat'"):
        opt.load_state_dict({**state, "partition": "tensors"})
    with pytest.raises(ValueError, match="the state lacks shard"):
        opt.load_state_dict({k: v for k, v in state.items() if k != "shard"})


def _documented_recipe():
    """docs/optimizers.md's recipe, its Python block under "Saving and resuming training": (the save statement,
    the statements that load), compiled."""
    section = OPTIMIZERS_PAGE.read_text().split("## Saving and resuming training")[1]
    body = ast.parse(section.split("```python\n")[1].split("```")[0]).body
    return [compile(ast.Module(part, type_ignores=[]), str(OPTIMIZERS_PAGE), "exec") for part in (body[:1], body[1:])]


@pytest.mark.parametrize("device", COMPILED_DEVICES)  # cpu, and cuda where there is one
def test_the_documented_recipe_resumes_a_compressed_run_bit_for_bit(device, tmp_path, monkeypatch):
    # checkpoint.compress draws each value's rounding noise from a count of the values it compressed: the recipe
    # used to leave that state out, so a resumed run drew the noise of step 0 again.
    monkeypatch.chdir(tmp_path)  # the recipe writes ckpt.npz here
    save, load = _documented_recipe()

    def fresh_run():
        np.random.seed(0)
        model = LanguageModel(16, 40, 32, num_layers=1, seq_model="transformer", seq_len=8, device=device,
                              num_head=2, dim_head=8, activation="gelu")
        policy = checkpoint.compress(8)
        model.enable_gc(policy=policy)
        opt = optim.Adam(model.parameters(), lr=0.01)
        return {"ndl": ndl, "model": model, "opt": opt, "scaler": ndl.amp.GradScaler(), "policy": policy}

    def train(run, steps):
        for _ in range(steps):
            X = ndl.Tensor(np.random.randint(0, 40, (8, 4)).astype(np.float32), device=device, requires_grad=False)
            y = ndl.Tensor(np.random.randint(0, 40, (32,)).astype(np.float32), device=device, requires_grad=False)
            run["opt"].reset_grad()
            run["model"].loss(X, y)[0].backward()
            run["opt"].step()
        return _bytes(run["model"])

    run = fresh_run()
    train(run, K)
    exec(save, {**run, "step": K})
    expected = train(run, M)
    assert run["policy"].values_compressed > 0  # the steps compressed values: the noise depends on the count
    resumed = fresh_run()
    np.random.seed(12345)  # a fresh process: another RNG state
    exec(load, resumed)
    assert train(resumed, M) == expected
    without = fresh_run()
    exec(load, without)
    without["policy"].load_state_dict({"seed": 0, "values_compressed": 0})  # the recipe without the policy's state
    assert train(without, M) != expected, "resuming without the policy's state gave the same bytes: the test is blind"
