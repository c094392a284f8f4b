"""benchmarks/torch_lm.py, the PyTorch oracle of bench_perplexity.py: needle's Transformer LM written again in
PyTorch with needle's parameters copied in computes the same loss and the same gradients, and after the same Adam
steps on the same batches holds the same parameters. Otherwise the benchmark's "same model" would be a claim."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

import needle as ndl
from needle import nn
from apps.models import LanguageModel

from conftest import requires_torch

DEVICE = ndl.cpu() if ndl.cpu().enabled() else ndl.cpu_numpy()
VOCAB, T, B = 23, 6, 4


def torch_lm():
    spec = importlib.util.spec_from_file_location(
        "torch_lm", Path(__file__).resolve().parents[2] / "benchmarks" / "torch_lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def models():
    torch = requires_torch()
    np.random.seed(0)
    model = LanguageModel(16, VOCAB, 24, num_layers=2, seq_model="transformer", seq_len=T, device=DEVICE,
                          num_head=4, dim_head=4)
    return torch, model, torch_lm().TorchLM(model)


def batch(seed):
    rs = np.random.RandomState(seed)
    return rs.randint(VOCAB, size=(T, B)), rs.randint(VOCAB, size=T * B)


def test_the_same_loss_and_gradients_as_needle():
    torch, model, oracle = models()
    x, y = batch(1)
    loss = nn.SoftmaxLoss()(model(ndl.Tensor(x, device=DEVICE, requires_grad=False))[0],
                            ndl.Tensor(y, device=DEVICE, requires_grad=False))
    loss.backward()
    theirs = torch.nn.functional.cross_entropy(oracle(torch.tensor(x)), torch.tensor(y))
    theirs.backward()
    assert float(loss.numpy()) == pytest.approx(theirs.item(), rel=1e-5)
    for name, p, q in zip(oracle.names, model.parameters(), oracle.weights):
        np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-3, atol=1e-5, err_msg=name)


def test_the_same_parameters_after_the_same_adam_steps():
    torch, model, oracle = models()
    ours, theirs = ndl.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(oracle.parameters(), lr=1e-2)
    for step in range(3):
        x, y = batch(10 + step)
        ours.reset_grad()
        nn.SoftmaxLoss()(model(ndl.Tensor(x, device=DEVICE, requires_grad=False))[0],
                         ndl.Tensor(y, device=DEVICE, requires_grad=False)).backward()
        ours.step()
        theirs.zero_grad()
        torch.nn.functional.cross_entropy(oracle(torch.tensor(x)), torch.tensor(y)).backward()
        theirs.step()
    moved = 0
    for name, p, q, start in zip(oracle.names, model.parameters(), oracle.weights, models()[1].parameters()):
        if name.endswith("prenorm_k.bias"):
            # Its gradient is 0 in exact arithmetic (it shifts every key's score for a query by the same amount,
            # which softmax ignores), so both frameworks' gradients are rounding noise, and Adam, which divides by
            # the gradient's own size, turns any noise into full steps: the two are not expected to agree.
            assert np.abs(p.grad.numpy()).max() < 1e-5 and np.abs(q.grad.numpy()).max() < 1e-5, name
            continue
        np.testing.assert_allclose(p.numpy(), q.detach().numpy(), rtol=1e-4, atol=1e-5, err_msg=name)
        moved += not np.allclose(p.numpy(), start.numpy())
    assert moved == len(oracle.names) - 2  # every other parameter trained: the comparison compares something
