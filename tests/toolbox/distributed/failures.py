"""Run under `mpiexec -n 2 python failures.py CASE`: a job whose ranks go different ways ends, on every rank still
running, with an error naming the collective, and never hangs (tests/toolbox/test_distributed.py runs each CASE as
its own job: after such an error the job ends).

Every CASE sets a short timeout and lets the error go uncaught, as a training script would: the test reads the
tracebacks' messages and the job's exit status. `join` is the one case that ends well: two ranks with 3 and 5
batches train under `DataParallel.join()` and compare with one process doing the same arithmetic.
"""
import os
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
sys.path.insert(0, os.path.join(ROOT, "python"))

import needle as ndl  # noqa: E402
from needle import distributed as dist  # noqa: E402
from needle import nn  # noqa: E402

DEVICE = ndl.cpu() if ndl.cpu().enabled() else ndl.cpu_numpy()
RANK = dist.rank()
TIMEOUT = 3.0


def say(text):
    sys.stdout.write(f"rank {RANK} {text}\n")  # one write: lines of the two ranks do not interleave
    sys.stdout.flush()


def build(seed=0):
    np.random.seed(seed)
    return nn.Sequential(nn.Linear(4, 8, device=DEVICE), nn.ReLU(), nn.Linear(8, 2, device=DEVICE))


def batches(rank, count):
    """`count` batches of rank `rank`: 4 rows of 4 features and their targets, seeded by (rank, index)."""
    out = []
    for j in range(count):
        rs = np.random.RandomState(100 * rank + j)
        out.append((rs.randn(4, 4).astype(np.float32), rs.randn(4, 2).astype(np.float32)))
    return out


def step(model, opt, X, y, backwards=1):
    opt.reset_grad()
    x = ndl.Tensor(X, device=DEVICE, requires_grad=False)
    loss = ((model(x) - ndl.Tensor(y, device=DEVICE, requires_grad=False)) ** 2).sum() / X.shape[0]
    for _ in range(backwards):
        loss.backward()
    opt.step()


def exit_early():
    """Rank 0 leaves normally; rank 1 enters an all_reduce that rank 0 never will."""
    if RANK == 0:
        sys.exit(0)
    dist.all_reduce(DEVICE.full((3,), 1.0))


def silent_rank():
    """Rank 0 is alive but never comes (busy, or waiting elsewhere): rank 1's all_reduce times out."""
    if RANK == 0:
        time.sleep(60)  # the job's abort ends this long before
    dist.all_reduce(DEVICE.full((3,), 1.0))


def uneven_data():
    """Rank 0 has 2 batches, rank 1 has 3, and no join(): rank 1's third backward has no partner."""
    model = dist.DataParallel(build())
    opt = ndl.optim.SGD(model.parameters(), lr=0.1)
    for X, y in batches(RANK, 2 + RANK):
        step(model, opt, X, y)


def extra_backward():
    """Rank 1 runs backward twice through one forward: its second pass would pair with rank 0's next one."""
    model = dist.DataParallel(build())
    opt = ndl.optim.SGD(model.parameters(), lr=0.1)
    for j, (X, y) in enumerate(batches(RANK, 3)):
        step(model, opt, X, y, backwards=2 if RANK == 1 and j == 1 else 1)


def different_collectives():
    if RANK == 0:
        dist.barrier()
    else:
        dist.all_reduce(DEVICE.full((3,), 1.0))


def all_reduce_shapes():
    dist.all_reduce(DEVICE.full((3,) if RANK == 0 else (5,), 1.0))  # today: [2, 2, 2] and [2, 2, 2, 1, 1]


def reduce_scatter_sizes():
    dist.reduce_scatter(DEVICE.full((4,) if RANK == 0 else (6,), 1.0))


def all_gather_shapes():
    dist.all_gather(DEVICE.full((2,) if RANK == 0 else (3,), 1.0))


def broadcast_dtypes():
    dist.broadcast(ndl.backend_ndarray.array(np.ones(3), dtype="float32" if RANK == 0 else "float16", device=DEVICE))


def bucket_sizes():
    """The same model, bucketed differently on the two ranks: the first buckets' sizes differ."""
    model = dist.DataParallel(build(), bucket_mb=1 if RANK == 0 else 0.0001)
    step(model, ndl.optim.SGD(model.parameters(), lr=0.1), *batches(RANK, 1)[0])


def recv_timeout():
    if RANK == 0:
        time.sleep(60)
    else:
        dist.recv(0, tag=5)


def send_timeout():
    """Rank 0 sends 4 MB (too large to be buffered: it waits for a receive) that rank 1 never receives."""
    if RANK == 0:
        dist.send(DEVICE.full((2**20,), 1.0), 1, tag=2).wait()
    else:
        time.sleep(60)


def caught_error():
    """Both ranks catch the error and end normally: the job still ends with status 1, and the next collective
    raises at once."""
    try:
        all_reduce_shapes()
    except dist.CollectiveMismatch as err:
        say(f"caught {err}")
    try:
        dist.barrier()
    except dist.CollectiveError as err:
        say(f"caught again {err}")


def join():
    """3 batches on rank 0, 5 on rank 1, under join(): both end with the parameters of the one-process arithmetic:
    steps 1-3 the mean of both ranks' gradients, steps 4-5 rank 1's alone (the ranks still training)."""
    mine = batches(RANK, 3 + 2 * RANK)
    model = dist.DataParallel(build())
    opt = ndl.optim.SGD(model.parameters(), lr=0.1)
    with model.join():
        for j, (X, y) in enumerate(mine):
            step(model, opt, X, y)
            # other all-reduces are shadowed too: a mean over the ranks still training, a max that ignores rank 0
            mean = dist.all_reduce(DEVICE.full((2,), float(RANK + 1)), op="mean").numpy()
            top = dist.all_reduce(DEVICE.full((2,), float(-RANK - 1)), op="max").numpy()
            assert (mean == (1.5 if j < 3 else 2.0)).all() and (top == (-1.0 if j < 3 else -2.0)).all(), (j, mean, top)
    got = [p.numpy() for p in model.parameters()]

    ref = build()
    params = ref.parameters()
    ref_opt = ndl.optim.SGD(params, lr=0.1)
    first, second = batches(0, 3), batches(1, 5)
    for j in range(5):
        grads = []
        for X, y in ([first[j]] if j < 3 else []) + [second[j]]:
            ref_opt.reset_grad()
            x = ndl.Tensor(X, device=DEVICE, requires_grad=False)
            ((ref(x) - ndl.Tensor(y, device=DEVICE, requires_grad=False)) ** 2).sum().__truediv__(4).backward()
            grads.append([p.grad.numpy() for p in params])
        for p, *gs in zip(params, *grads):
            p.grad = ndl.Tensor(sum(gs) / len(gs), device=DEVICE, requires_grad=False)
        ref_opt.step()
    expected = [p.numpy() for p in params]
    err = max(float(np.abs(a - b).max()) for a, b in zip(got, expected))
    assert err < 1e-6, err
    gathered = dist.all_gather_object([g.tobytes() for g in got])
    assert gathered[0] == gathered[1]  # both ranks end with the same bits
    dist.barrier()  # after the join, the ranks communicate as before
    say(f"ok join ran {len(mine)} batches, max |error| {err:.1e}, parameters identical on both ranks")


CASES = {f.__name__: f for f in (exit_early, silent_rank, uneven_data, extra_backward, different_collectives,
                                 all_reduce_shapes, reduce_scatter_sizes, all_gather_shapes, broadcast_dtypes,
                                 bucket_sizes, recv_timeout, send_timeout, caught_error,
                                 join)}

if __name__ == "__main__":
    dist.set_timeout(TIMEOUT)
    CASES[sys.argv[1]]()
    say(f"finished {sys.argv[1]}")
