"""Run under `mpiexec -n 2` (tests/toolbox/test_distributed.py does): data parallelism and ZeRO against one process.

Each rank also trains the one-process reference itself (the whole batch, the plain optimizer), so no second job
is needed. Every check asserts and prints one line "rank R ok NAME ..."; the test reads those lines.
"""
import os
import sys

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "apps"))

import needle as ndl  # noqa: E402
from needle import distributed as dist  # noqa: E402
from needle import nn  # noqa: E402
from needle.data import batchify, get_batch  # noqa: E402

from models import LanguageModel  # noqa: E402

DEVICE = ndl.cpu() if ndl.cpu().enabled() else ndl.cpu_numpy()
VOCAB, SEQ, BATCH, STEPS = 50, 6, 8, 5
RANK, N = dist.rank(), dist.world_size()


def say(name, detail=""):
    """One result line, in one write (print's separate newline could interleave with the other rank's line)."""
    sys.stdout.write(f"rank {RANK} ok {name} {detail}".rstrip() + "\n")
    sys.stdout.flush()


def build():
    np.random.seed(0)
    return LanguageModel(16, VOCAB, 16, num_layers=2, seq_model="transformer", seq_len=SEQ, device=DEVICE,
                         num_head=2, dim_head=8)


def corpus():
    rs = np.random.RandomState(1)
    return rs.randint(0, VOCAB, size=2000).astype(np.float32)


def loss_of(model, X, y):
    return nn.SoftmaxLoss()(model(X)[0], y)


def train(model, opt, batches, steps=STEPS, accumulate=1):
    """`steps` optimizer steps on the windows of `batches`; with accumulate k, k micro-batches (columns) per step."""
    for step in range(steps):
        opt.reset_grad()
        X, y = get_batch(batches, step * SEQ, SEQ, device=DEVICE)
        if accumulate == 1:
            loss_of(model, X, y).backward()
        else:
            Xn, yn = X.numpy(), y.numpy().reshape(X.shape)
            b = Xn.shape[1] // accumulate
            for j in range(accumulate):
                Xj = ndl.Tensor(Xn[:, j * b:(j + 1) * b], device=DEVICE, requires_grad=False)
                yj = ndl.Tensor(yn[:, j * b:(j + 1) * b].reshape(-1), device=DEVICE, requires_grad=False)
                if j < accumulate - 1:
                    with model.no_sync():
                        (loss_of(model, Xj, yj) / accumulate).backward()
                else:
                    (loss_of(model, Xj, yj) / accumulate).backward()
        opt.step()
    return [p.numpy() for p in model.parameters()]


def relative(a, b, skip=()):
    """The largest per-tensor max |a - b| / max |b| (tensors whose index is in `skip` left out)."""
    return max(float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30))
               for i, (x, y) in enumerate(zip(a, b)) if i not in skip)


def structural_zeros(model, batches):
    """Indices of the parameters whose gradient is zero in exact arithmetic, only rounding noise in floats: the
    attention's key LayerNorm bias (adding b W_k to every key adds a constant to each softmax row). Found as the
    tensors whose first gradient is below 1e-6 of the largest one. Adam divides a gradient by its own RMS, so
    such a parameter follows the sign of the noise, which one process and two ranks round differently."""
    X, y = get_batch(batches, 0, SEQ, device=DEVICE)
    loss_of(model, X, y).backward()
    grads = [np.abs(p.grad.numpy()).max() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return {i for i, g in enumerate(grads) if g < 1e-6 * max(grads)}


def same_on_every_rank(params):
    flat = np.concatenate([p.reshape(-1) for p in params])
    gathered = dist.all_gather(ndl.Tensor(flat, device=DEVICE).realize_cached_data()).numpy()
    return all(np.array_equal(gathered[0], g) for g in gathered)


def check_collectives():
    x = ndl.cpu_numpy().full((4,), float(RANK + 1))
    assert np.array_equal(dist.all_reduce(x).numpy(), np.full(4, sum(range(1, N + 1)), np.float32))
    assert np.allclose(dist.all_reduce(x, op="mean").numpy(), sum(range(1, N + 1)) / N)
    assert np.array_equal(dist.all_reduce(x, op="max").numpy(), np.full(4, N, np.float32))
    pending = dist.all_reduce(DEVICE.full((3,), 1.0), async_op=True)
    assert np.array_equal(pending.wait().numpy(), np.full(3, N, np.float32))
    g = dist.all_gather(DEVICE.full((2, 3), float(RANK)))
    assert g.shape == (N, 2, 3) and all((g.numpy()[r] == r).all() for r in range(N))
    rs = dist.reduce_scatter(ndl.backend_ndarray.array(np.arange(2 * N, dtype=np.float32), device=DEVICE))
    assert np.array_equal(rs.numpy(), N * np.arange(2 * RANK, 2 * RANK + 2, dtype=np.float32)), rs.numpy()
    b = dist.broadcast(DEVICE.full((5,), float(RANK + 7)))
    assert (b.numpy() == 7).all()
    bf = ndl.backend_ndarray.array(np.array([1.5, -2.25, 3.0], np.float32), dtype="bfloat16", device=DEVICE)
    assert dist.broadcast(bf).dtype == "bfloat16" and np.array_equal(dist.broadcast(bf).numpy(), bf.numpy())
    assert np.array_equal(dist.all_reduce(bf).numpy().astype(np.float32), N * bf.numpy().astype(np.float32))
    if RANK == 0:
        dist.send(bf, 1, tag=3).wait()
    elif RANK == 1:
        got = dist.recv(0, tag=3, device=DEVICE)
        assert got.dtype == "bfloat16" and np.array_equal(got.numpy(), bf.numpy())
    dist.barrier()
    say("collectives", "all_reduce sum/mean/max/async, all_gather, reduce_scatter, broadcast, send/recv, bf16")


def data_parallel_checks(mine, reference, noise):
    """Plain data parallelism (B/2 per rank, small buckets: several, started during backward) and gradient
    accumulation equal the one-process reference."""
    torn = build()
    if RANK == 1:
        for p in torn.parameters():  # rank 0's values must win: DataParallel broadcasts them
            p.data = p.data + 1.0
    model = dist.DataParallel(torn, bucket_mb=0.004)
    dp = train(model, ndl.optim.Adam(model.parameters(), lr=0.01), mine)
    stats = model.last_sync_stats()
    err = relative(dp, reference, skip=noise)
    assert err <= 1e-5, err
    assert same_on_every_rank(dp)
    assert stats["buckets"] >= 3 and stats["started_before_last_gradient"] >= 1, stats
    say("dp_equals_one_process", f"max_rel={err:.2e} over {len(dp) - len(noise)} of {len(dp)} tensors (the "
        f"others: gradient zero but for rounding; max_rel there {relative(dp, reference):.1e}) "
        f"buckets={stats['buckets']} started_early={stats['started_before_last_gradient']} bytes={stats['bytes']}")

    # Gradient accumulation: 2 micro-batches per rank, the first under no_sync.
    model = dist.DataParallel(build(), bucket_mb=0.004)
    acc = train(model, ndl.optim.Adam(model.parameters(), lr=0.01), mine, accumulate=2)
    err = relative(acc, reference, skip=noise)
    assert err <= 1e-5, err
    say("no_sync_accumulation_equals_one_process", f"max_rel={err:.2e}")


def zero_flat_checks(mine):
    """ZeRO stages 1 and 2 with element-wise optimizers: equal to plain DP bit for bit."""
    sizes = [int(np.prod(p.shape)) for p in build().parameters()]
    total = sum(sizes)
    for cls, kw in ((ndl.optim.Adam, {"lr": 0.01}), (ndl.optim.SGD, {"lr": 0.1, "momentum": 0.9})):
        model = dist.DataParallel(build(), bucket_mb=0.004)
        plain = train(model, cls(model.parameters(), **kw), mine)
        for stage in (1, 2):
            model = dist.DataParallel(build(), bucket_mb=0.004)
            opt = dist.ZeroRedundancyOptimizer(model.parameters(), cls, stage=stage, **kw)
            got = train(model, opt, mine)
            assert opt.partition == "flat"
            assert all(np.array_equal(a, b) for a, b in zip(got, plain)), (cls.__name__, stage, relative(got, plain))
            assert same_on_every_rank(got)
            per_element = 8 if cls is ndl.optim.Adam else 4
            shard = -(-total // N) if RANK < N - 1 else total - (N - 1) * -(-total // N)
            assert opt.state_bytes() == per_element * shard, (opt.state_bytes(), shard)
            states = dist.all_gather_object(opt.state_bytes())
            assert sum(states) == per_element * total
            if stage == 2:
                opt.reset_grad()
                X, y = get_batch(mine, 0, SEQ, device=DEVICE)
                loss_of(model, X, y).backward()
                assert all(p.grad is None for p in model.parameters())
                assert opt.gradient_bytes() == 4 * shard
            say(f"zero{stage}_{cls.__name__.lower()}_equals_dp", f"bit-identical state_bytes={opt.state_bytes()} "
                f"of {per_element * total} ({opt.state_bytes() / (per_element * total):.4f})"
                + (f" grad_bytes={opt.gradient_bytes()} of {4 * total}" if stage == 2 else ""))


def zero_tensors_checks(mine):
    """Optimizers whose update reads whole tensors: partitioned by tensors, equal to plain DP; and a forced flat
    partition for Adafactor runs, its state unfactored (a vector per shard)."""
    for cls, kw in ((ndl.optim.Adafactor, {}), (ndl.optim.Adam8bit, {"lr": 0.01, "min_8bit_size": 64})):
        model = dist.DataParallel(build(), bucket_mb=0.004)
        fp32 = {"fp32_state_params": [model.module.embedding.weight]} if cls is ndl.optim.Adam8bit else {}
        plain_opt = cls(model.parameters(), **kw, **fp32)
        plain = train(model, plain_opt, mine)
        for stage in (1, 2):
            model = dist.DataParallel(build(), bucket_mb=0.004)
            fp32 = {"fp32_state_params": [model.module.embedding.weight]} if cls is ndl.optim.Adam8bit else {}
            opt = dist.ZeroRedundancyOptimizer(model.parameters(), cls, stage=stage, **kw, **fp32)
            got = train(model, opt, mine)
            assert opt.partition == "tensors"
            assert all(np.array_equal(a, b) for a, b in zip(got, plain)), (cls.__name__, stage, relative(got, plain))
            assert same_on_every_rank(got)
            states = dist.all_gather_object(opt.state_bytes())
            # Adam8bit's two 256-entry float32 maps are state on every rank: N copies instead of one
            maps = (N - 1) * 2 * 256 * 4 if cls is ndl.optim.Adam8bit else 0
            assert sum(states) == plain_opt.state_bytes() + maps, (states, plain_opt.state_bytes())
            say(f"zero{stage}_{cls.__name__.lower()}_equals_dp", f"bit-identical, tensors partition, state_bytes "
                f"{states} sum to plain {plain_opt.state_bytes()}")

    # Forced flat partition for Adafactor: it runs, its state is unfactored (a vector per shard).
    model = dist.DataParallel(build(), bucket_mb=0.004)
    opt = dist.ZeroRedundancyOptimizer(model.parameters(), ndl.optim.Adafactor, partition="flat")
    train(model, opt, mine, steps=1)
    assert opt.state_bytes() == 4 * opt.shard_size()
    say("zero1_adafactor_flat_runs_unfactored", f"state_bytes={opt.state_bytes()}")


def main():
    assert N == 2, "run with mpiexec -n 2"
    dist.init()
    check_collectives()
    data = corpus()
    full = batchify(data, BATCH, device=DEVICE, dtype="float32")
    mine = dist.batchify(data, BATCH, device=DEVICE, dtype="float32")
    assert mine.shape[1] == BATCH // N and np.array_equal(mine, full[:, RANK * BATCH // N:(RANK + 1) * BATCH // N])

    # The one-process reference: the whole batch B, plain Adam.
    ref_model = build()
    noise = structural_zeros(ref_model, full)
    names = [p.name for p in ref_model.parameters()]
    assert [names[i] for i in sorted(noise)] == [f"seq_model.layers.{k}.attention.prenorm_k.bias" for k in (0, 1)]
    reference = train(ref_model, ndl.optim.Adam(ref_model.parameters(), lr=0.01), full)
    data_parallel_checks(mine, reference, noise)
    zero_flat_checks(mine)
    zero_tensors_checks(mine)


if __name__ == "__main__":
    main()
