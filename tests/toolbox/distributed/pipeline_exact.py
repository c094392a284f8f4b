"""Run under `mpiexec -n 2`: GPipe against the unsplit model accumulating over the same micro-batches.

Every rank also runs the unsplit reference itself. Prints "rank R ok NAME ..." per check.
"""
import os
import sys

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
sys.path.insert(0, os.path.join(ROOT, "python"))

import needle as ndl  # noqa: E402
from needle import distributed as dist  # noqa: E402
from needle import nn  # noqa: E402

DEVICE = ndl.cpu() if ndl.cpu().enabled() else ndl.cpu_numpy()
RANK, N = dist.rank(), dist.world_size()
M, B, D, C, STEPS = 4, 16, 12, 5, 3


def say(name, detail=""):
    """One result line, in one write (print's separate newline could interleave with the other rank's line)."""
    sys.stdout.write(f"rank {RANK} ok {name} {detail}".rstrip() + "\n")
    sys.stdout.flush()


def build_stages():
    np.random.seed(0)
    first = nn.Sequential(nn.Linear(D, 32, device=DEVICE), nn.ReLU(), nn.LayerNorm1d(32, device=DEVICE),
                          nn.Linear(32, 32, device=DEVICE), nn.ReLU())
    second = nn.Sequential(nn.Linear(32, 32, device=DEVICE), nn.ReLU(), nn.Linear(32, C, device=DEVICE))
    return [first, second]


def data(step):
    rs = np.random.RandomState(step)
    X = rs.randn(B, D).astype(np.float32)
    y = rs.randint(0, C, size=B).astype(np.float32)
    b = B // M
    return [(ndl.Tensor(X[j * b:(j + 1) * b], device=DEVICE, requires_grad=False),
             ndl.Tensor(y[j * b:(j + 1) * b], device=DEVICE, requires_grad=False)) for j in range(M)]


def loss_fn(out, y):
    return nn.SoftmaxLoss()(out, y)


def reference(checkpoint):
    """The unsplit model, one process: each micro-batch's loss / M backward, gradients summed in order."""
    stages = build_stages()
    model = nn.Sequential(*stages)
    if checkpoint:
        model.enable_gc()
    params = model.parameters()
    opt = ndl.optim.Adam(params, lr=0.01)
    for step in range(STEPS):
        opt.reset_grad()
        total = None
        for X, y in data(step):
            (loss_fn(model(X), y) / M).backward()
            grads = [p.grad.realize_cached_data() for p in params]
            total = grads if total is None else [a + g for a, g in zip(total, grads)]
        for p, g in zip(params, total):
            p.grad = ndl.Tensor(g, device=DEVICE, requires_grad=False)
        opt.step()
    return [[p.numpy() for p in s.parameters()] for s in stages]


def main():
    assert N == 2, "run with mpiexec -n 2"
    for checkpoint in (None, "all"):
        expected = reference(checkpoint)[RANK]
        pipe = dist.Pipeline(build_stages(), micro_batches=M, checkpoint=checkpoint)
        opt = ndl.optim.Adam(pipe.parameters(), lr=0.01)
        losses = []
        for step in range(STEPS):
            opt.reset_grad()
            losses.append(pipe.train_step(data(step), loss_fn))
            opt.step()
        got = [p.numpy() for p in pipe.parameters()]
        assert all(np.array_equal(a, b) for a, b in zip(got, expected)), \
            max(float(np.abs(a - b).max()) for a, b in zip(got, expected))
        assert len(set(dist.all_gather_object(losses[-1]))) == 1  # every rank returns the last stage's loss
        stats = pipe.last_step_stats()
        assert abs(stats["theory"] - 1 / 5) < 1e-12 and 0 <= stats["bubble_mean"] < 1, stats
        say(f"pipeline_equals_unsplit_{checkpoint or 'nogc'}", f"bit-identical loss={losses[-1]:.4f} "
            f"bubble={stats['bubble_mean']:.3f} theory={stats['theory']:.3f}")
    out = dist.Pipeline(build_stages(), micro_batches=1)(data(0)[0][0])
    model = nn.Sequential(*build_stages())
    if RANK == N - 1:
        assert np.array_equal(out.numpy(), model(data(0)[0][0]).numpy())
    else:
        assert out is None
    say("pipeline_forward")


if __name__ == "__main__":
    main()
