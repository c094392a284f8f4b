"""Run under `mpiexec -n 2`: bad use is a clear error on every rank, and never a hang.

`python bad_use.py` catches each error and prints "rank R error CASE: TYPE: MESSAGE" on every rank;
`python bad_use.py uncaught`: rank 1 raises alone while rank 0 waits in a barrier it would never leave; init()'s
hook aborts the whole job (exit status 1) instead.
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
RANK = dist.rank()


def mismatched_shapes():
    np.random.seed(0)
    width = 8 if RANK == 0 else 9  # rank 1 built another model
    dist.DataParallel(nn.Sequential(nn.Linear(4, width, device=DEVICE), nn.Linear(width, 2, device=DEVICE)))


def indivisible_batch():
    dist.split_batch(ndl.Tensor(np.zeros((5, 3)), device=DEVICE))


def indivisible_batchify():
    dist.batchify(np.arange(100, dtype=np.float32), 5)


def wrong_stage_count():
    dist.Pipeline([nn.Identity(), nn.Identity(), nn.Identity()], micro_batches=4)


def zero_without_data_parallel():
    dist.ZeroRedundancyOptimizer(nn.Linear(3, 3, device=DEVICE).parameters(), ndl.optim.Adam)


def _tensor_parallel_lm(seed):
    sys.path.insert(0, os.path.join(ROOT, "apps"))
    from models import LanguageModel
    np.random.seed(seed)
    model = LanguageModel(16, 40, 16, num_layers=1, seq_model="transformer", seq_len=8, device=DEVICE, num_head=2,
                          dim_head=8)
    return dist.tensor_parallel.parallelize_transformer(model)


def tensor_parallel_other_weights():
    _tensor_parallel_lm(seed=RANK)  # rank 1 built its model with another seed


def tensor_parallel_other_batches():
    model = _tensor_parallel_lm(seed=0)
    ids = np.random.RandomState(RANK).randint(0, 40, (8, 2)).astype(np.float32)  # each rank its own batch
    model(ndl.Tensor(ids, device=DEVICE, requires_grad=False))


CASES = [mismatched_shapes, indivisible_batch, indivisible_batchify, wrong_stage_count, zero_without_data_parallel,
         tensor_parallel_other_weights, tensor_parallel_other_batches]

if __name__ == "__main__":
    dist.init()
    if sys.argv[1:] == ["uncaught"]:
        if RANK == 1:
            raise RuntimeError("rank 1 fails alone")
        dist.barrier()  # rank 0: without the abort, this waits for rank 1 forever
        raise SystemExit("not reached")
    for case in CASES:
        try:
            case()
        except (ValueError, TypeError) as err:
            sys.stdout.write(f"rank {RANK} error {case.__name__}: {type(err).__name__}: {err}\n")  # one write
            sys.stdout.flush()
        else:
            raise SystemExit(f"{case.__name__}: no error")
        dist.barrier()  # every rank got here: nobody is waiting in a collective
