"""benchmarks/torch_lm.py, the PyTorch oracle of bench_perplexity.py: needle's Transformer LM written again in
PyTorch with needle's parameters copied in computes the same loss and the same gradients, and after the same Adam
steps on the same batches holds the same parameters. Otherwise the benchmark's "same model" would be a claim."""
import argparse
import importlib
import importlib.util
from pathlib import Path

import numpy as np
import pytest

import needle as ndl
from needle import nn
from apps.models import LanguageModel

from conftest import device_params, requires_torch

DEVICE = ndl.cpu() if ndl.cpu().enabled() else ndl.cpu_numpy()
VOCAB, T, B = 23, 6, 4
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def torch_lm():
    spec = importlib.util.spec_from_file_location("torch_lm", BENCHMARKS / "torch_lm.py")
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


@pytest.mark.parametrize("device", device_params("cpu"))  # the benchmark trains on the C++ backend
def test_the_benchmark_trains_both_to_the_same_test_perplexity(device, tmp_path, monkeypatch):
    """bench_perplexity.run end to end on a small corpus: one epoch each, the same first loss, both learned, and
    test perplexities as close as the benchmark's figure says they are on PTB."""
    requires_torch()
    rs = np.random.RandomState(0)
    words = [f"w{i}" for i in range(30)]
    for name, lines in (("train.txt", 120), ("test.txt", 40)):
        (tmp_path / name).write_text("\n".join(" ".join(rs.choice(words[:20 + rs.randint(10)], size=6))
                                               for _ in range(lines)) + "\n")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = importlib.import_module("bench_perplexity")
    args = argparse.Namespace(batch_size=4, seq_len=8, embedding_size=16, hidden_size=24, num_layers=1, num_head=4,
                              lr=1e-2, seed=0, max_batches=None, data=str(tmp_path))
    results, setup = bench.run(args)
    (ppl, first, last, _), (ppl_torch, first_torch, last_torch, _) = results["needle"], results["PyTorch"]
    assert "1 layers" in setup and "batch 4 x seq_len 8" in setup
    assert first == pytest.approx(first_torch, rel=1e-5)
    assert last < first - 0.3 and last_torch < first_torch - 0.3  # both trained, not just started alike
    assert ppl == pytest.approx(ppl_torch, rel=2e-3)
