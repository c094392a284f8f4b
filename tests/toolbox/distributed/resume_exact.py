"""Run under `mpiexec -n 2 python tests/toolbox/distributed/resume_exact.py FOLDER` (tests/toolbox/test_distributed.py
does): ZeRO stages 1 and 2 resume bit for bit.

Each rank trains K steps, saves its own optimizer shard and RNG state to FOLDER/<name>.rank<R>.npz (rank 0 also
the model), trains M more steps (the uninterrupted run); then a fresh model and optimizer load the files and train
M steps: every parameter equals the uninterrupted run's, byte for byte, on every rank. Every check asserts and
prints one line "rank R ok NAME ..."; the test reads those lines.
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
K, M = 3, 3
RANK, N = dist.rank(), dist.world_size()
OPTIMIZERS = {  # flat partition (element-wise updates) and tensor partition (whole-tensor updates)
    "adam": (ndl.optim.Adam, {"lr": 0.01}),
    "sgd": (ndl.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adafactor": (ndl.optim.Adafactor, {"beta1": 0.9}),
    "adam8bit": (ndl.optim.Adam8bit, {"lr": 0.01, "min_8bit_size": 64, "block_size": 64}),
}


def say(name, detail=""):
    """One result line, in one write (print's separate newline could interleave with the other rank's line)."""
    sys.stdout.write(f"rank {RANK} ok {name} {detail}".rstrip() + "\n")
    sys.stdout.flush()


def build(name, stage, seed):
    np.random.seed(seed)  # DataParallel broadcasts rank 0's initial values
    model = dist.DataParallel(nn.Sequential(nn.Linear(6, 16, device=DEVICE), nn.ReLU(), nn.Dropout(0.1),
                                            nn.Linear(16, 16, device=DEVICE), nn.ReLU(),
                                            nn.Linear(16, 3, device=DEVICE)), bucket_mb=0.0005)
    cls, kw = OPTIMIZERS[name]
    return model, dist.ZeroRedundancyOptimizer(model.parameters(), cls, stage=stage, **kw)


def train(model, opt, steps):
    """`steps` steps on batches (and dropout masks) drawn from this rank's global RNG."""
    for _ in range(steps):
        x = ndl.Tensor(np.random.randn(8, 6).astype(np.float32), device=DEVICE, requires_grad=False)
        y = ndl.Tensor(np.random.randint(0, 3, 8), device=DEVICE, requires_grad=False)
        opt.reset_grad()
        nn.SoftmaxLoss()(model(x), y).backward()
        opt.step()
    return [p.numpy().tobytes() for p in model.parameters()]


def same_on_every_rank(params):
    flat = np.frombuffer(b"".join(params), dtype=np.uint8).astype(np.float32)
    gathered = dist.all_gather(ndl.Tensor(flat, device=DEVICE).realize_cached_data()).numpy()
    return all(np.array_equal(gathered[0], g) for g in gathered)


def resumed(folder, name, stage, with_optimizer=True):
    model, opt = build(name, stage, seed=99)  # another initialization: everything must come from the files
    model.module.load_state_dict(ndl.load(os.path.join(folder, f"{name}{stage}.model.npz")))
    mine = ndl.load(os.path.join(folder, f"{name}{stage}.rank{RANK}.npz"))
    if with_optimizer:
        opt.load_state_dict(mine["optimizer"])
    ndl.set_random_state(mine["rng"])
    return train(model, opt, M), opt


def main(folder):
    assert N == 2, "run with mpiexec -n 2"
    dist.init()
    for name in OPTIMIZERS:
        for stage in (1, 2):
            model, opt = build(name, stage, seed=0)
            np.random.seed(100 + RANK)  # each rank its own batches
            train(model, opt, K)
            ndl.save({"optimizer": opt.state_dict(), "rng": ndl.random_state()},
                     os.path.join(folder, f"{name}{stage}.rank{RANK}.npz"))
            if RANK == 0:
                ndl.save(model.module.state_dict(), os.path.join(folder, f"{name}{stage}.model.npz"))
            dist.barrier()  # rank 0's model file is complete before anyone reads it
            expected = train(model, opt, M)
            got, fresh = resumed(folder, name, stage)
            assert got == expected, (name, stage)
            assert same_on_every_rank(got)
            if name in ("adam", "adafactor"):
                without, _ = resumed(folder, name, stage, with_optimizer=False)
                assert without != expected, (name, stage, "resuming without the optimizer state did not differ")
            say(f"resume_zero{stage}_{name}", f"partition={fresh.partition} bit-identical after {K}+{M} steps, "
                f"shard of {fresh.shard_size()} elements")
    other = ndl.load(os.path.join(folder, f"adam1.rank{1 - RANK}.npz"))["optimizer"]
    try:
        build("adam", 1, seed=0)[1].load_state_dict(other)
    except ValueError as err:
        assert f"rank={1 - RANK}, this rank has rank={RANK}" in str(err), err
        say("zero_refuses_another_ranks_shard", str(err))


if __name__ == "__main__":
    main(sys.argv[1])
