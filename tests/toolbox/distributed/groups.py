"""Run under `mpiexec -n 2` (or 4): process groups (`new_group`), each with its own arrival notices.

`python groups.py`: prints "rank R ok CHECK" for each check that held on rank R.
`python groups.py mismatch`: the two members of a group call different collectives in it: a CollectiveMismatch
naming the job's ranks on both (and the job ends with exit status 1).
`python groups.py timeout`: rank 0 waits in a group all-reduce that rank 1 never calls: CollectiveTimeout naming
rank 1, within the (short) timeout.
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


def ok(name):
    sys.stdout.write(f"rank {dist.rank()} ok {name}\n")
    sys.stdout.flush()


def check_groups():
    n, me = dist.world_size(), dist.rank()
    everyone = dist.new_group(range(n))
    singles = [dist.new_group([r]) for r in range(n)]  # every rank makes every group, in the same order
    pairs = [dist.new_group([r, r + 1]) for r in range(0, n - 1, 2)]
    mine = singles[me]
    assert dist.world_size(mine) == 1 and dist.rank(mine) == 0
    x = ndl.cpu().full((3,), float(me + 1))
    assert np.array_equal(dist.all_reduce(x, group=mine).numpy(), np.full(3, me + 1.0))
    total = dist.all_reduce(x, group=everyone).numpy()
    assert np.array_equal(total, np.full(3, n * (n + 1) / 2)), total
    ok("group_all_reduce")
    pair = pairs[me // 2] if me // 2 < len(pairs) else None
    if pair is not None:
        got = dist.all_gather(x, group=pair).numpy()
        base = 2 * (me // 2)
        assert np.array_equal(got[:, 0], [base + 1.0, base + 2.0]), got
        assert dist.rank(pair) == me - base
        ok("group_all_gather")
    try:
        dist.all_reduce(x, group=singles[(me + 1) % n])
    except ValueError as err:
        assert "not in the group" in str(err), err
        ok("non_member_refused")
    calls = dist.traffic(group=everyone)["all_reduce"][0]
    assert calls == 1, dist.traffic(group=everyone)
    ok("traffic_counted")
    # DataParallel over a group: gradients averaged within it only
    np.random.seed(0)
    model = dist.DataParallel(nn.Linear(4, 2, device=DEVICE), group=pair if pair is not None else mine)
    rs = np.random.RandomState(me)
    loss = ndl.ops.summation(model(ndl.Tensor(rs.randn(3, 4), device=DEVICE)))
    loss.backward()
    grads = dist.all_gather(model.module.weight.grad.realize_cached_data()).numpy()
    if pair is not None:
        b = 2 * (me // 2)
        assert np.array_equal(grads[b], grads[b + 1])
        if n > 2:
            assert not np.allclose(grads[0], grads[2])  # another pair averaged other data
    ok("data_parallel_group")


def mismatch():
    group = dist.new_group(range(dist.world_size()))
    x = ndl.cpu().full((3,), 1.0)
    if dist.rank() == 0:
        dist.all_reduce(x, group=group)
    else:
        dist.all_gather(x, group=group)


def timeout():
    dist.set_timeout(3)
    group = dist.new_group(range(dist.world_size()))
    if dist.rank() == 0:
        dist.all_reduce(ndl.cpu().full((3,), 1.0), group=group)
    else:
        time.sleep(6)


if __name__ == "__main__":
    dist.init()
    case = sys.argv[1] if len(sys.argv) > 1 else "groups"
    if case == "groups":
        check_groups()
    else:
        try:
            {"mismatch": mismatch, "timeout": timeout}[case]()
        except dist.CollectiveError as err:
            sys.stdout.write(f"rank {dist.rank()} error {type(err).__name__}: {err}\n")
            sys.stdout.flush()
            raise SystemExit(1)
