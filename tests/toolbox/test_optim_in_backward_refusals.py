"""The optimizer in backward (issue 47) where it cannot be exact: each says so in one clear error before any
parameter changes — loss scaling (a step with overflowing gradients could not be skipped), clipping by the global
norm, accumulation over micro-batches, ZeRO's sharded update."""
import numpy as np
import pytest

import needle as ndl
from needle import nn


def model_and_optimizer():
    model = nn.Linear(4, 3)
    return model, ndl.optim.Adam(model.parameters(), lr=0.01, in_backward=True)


def test_grad_scaler_refuses_an_optimizer_in_backward_before_backward_runs():
    model, _ = model_and_optimizer()
    before = [p.numpy() for p in model.parameters()]
    loss = model(ndl.Tensor(np.ones((2, 4), dtype="float32"), requires_grad=False)).sum()
    with pytest.raises(ValueError, match=r"GradScaler: Adam\(in_backward=True\) updates the parameters inside"):
        ndl.amp.GradScaler().scale(loss)
    assert all(np.array_equal(a, p.numpy()) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("kwargs, why", [({"clip": 1.0}, "clipped by their global norm"),
                                         ({"accumulation_steps": 2}, "cannot accumulate over micro-batches")])
def test_training_refuses_clipping_and_accumulation_with_an_optimizer_in_backward(kwargs, why):
    from apps.models import LanguageModel
    from apps.simple_ml import epoch_general_ptb
    model = LanguageModel(8, 20, 8, num_layers=1, seq_model="rnn", seq_len=4)
    opt = ndl.optim.SGD(model.parameters(), lr=0.1, in_backward=True)
    data = np.arange(40, dtype="float32").reshape(10, 4) % 20
    with pytest.raises(ValueError, match=f"in_backward=True\\), so .*{why}"):
        epoch_general_ptb(data, model, seq_len=4, opt=opt, **kwargs)


def test_zero_refuses_in_backward():
    model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match="ZeroRedundancyOptimizer: in_backward=True is not supported"):
        ndl.distributed.ZeroRedundancyOptimizer(model.parameters(), ndl.optim.Adam, in_backward=True, lr=0.1)
