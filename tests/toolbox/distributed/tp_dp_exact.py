"""Run under `mpiexec -n 4` (oversubscribed on 2 cores is fine): a 2-D layout, tensor x data parallel.

Ranks {0, 1} and {2, 3} are tensor-parallel groups (each holds the model split in two); ranks {0, 2} and {1, 3}
are data-parallel groups (the same slice, each on half of the batch). After 5 Adam steps every rank's gathered
state_dict equals the one-process model's trained on the whole batch (relative L2 within 1e-5; the key pre-norm
biases, whose exact gradient is zero, within 2 lr steps). Prints "rank R ok NAME ...".
"""
import os
import sys

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "apps"))

import needle as ndl  # noqa: E402
from needle import distributed as dist  # noqa: E402
from needle.toolbox.distributed import tensor_parallel as tp  # noqa: E402

from models import LanguageModel  # noqa: E402

DEVICE = ndl.cpu() if ndl.cpu().enabled() else ndl.cpu_numpy()
VOCAB, EMBED, HIDDEN, SEQ, BATCH, STEPS, LR = 100, 32, 64, 8, 4, 5, 1e-3
TP_SIZE = 2


def build():
    np.random.seed(0)
    return LanguageModel(EMBED, VOCAB, HIDDEN, num_layers=2, seq_model="transformer", seq_len=SEQ, device=DEVICE,
                         num_head=4, dim_head=8)


def batches():
    rs = np.random.RandomState(1)
    for _ in range(STEPS):
        tokens = rs.randint(0, VOCAB, size=(SEQ + 1, BATCH)).astype(np.float32)
        yield tokens[:-1], tokens[1:]


def train(model, group=None):
    opt = ndl.optim.Adam(model.parameters(), lr=LR)
    for X, y in batches():
        if group is not None:  # this data-parallel rank's columns of the batch
            X, y = dist.split_batch(X, axis=1, group=group), dist.split_batch(y, axis=1, group=group)
        opt.reset_grad()
        loss, _ = model.loss(ndl.Tensor(X, device=DEVICE, requires_grad=False),
                             ndl.Tensor(y.reshape(-1), device=DEVICE, requires_grad=False))
        loss.backward()
        opt.step()


if __name__ == "__main__":
    dist.init()
    n, me = dist.world_size(), dist.rank()
    assert n % TP_SIZE == 0, f"run with a multiple of {TP_SIZE} ranks"
    tensor_groups = [dist.new_group(range(s, s + TP_SIZE)) for s in range(0, n, TP_SIZE)]
    data_groups = [dist.new_group(range(t, n, TP_SIZE)) for t in range(TP_SIZE)]
    tensor_group, data_group = tensor_groups[me // TP_SIZE], data_groups[me % TP_SIZE]
    reference = build()
    train(reference)
    expected = reference.state_dict()
    for sp in (False, True):
        model = tp.parallelize_transformer(build(), group=tensor_group, sequence_parallel=sp)
        wrapped = dist.DataParallel(model, group=data_group)
        train(wrapped, data_group)
        state = model.state_dict()
        worst = 0.0
        for name, ref in expected.items():
            delta = state[name] - ref
            if name.endswith("attention.prenorm_k.bias"):
                assert np.abs(delta).max() <= 2 * LR * STEPS, name
                continue
            rel = np.linalg.norm(delta) / np.linalg.norm(ref)
            assert rel <= 1e-5, (name, rel)
            worst = max(worst, rel)
        sys.stdout.write(f"rank {me} ok exact_tp_dp{'_sp' if sp else ''} max relative L2 {worst:.1e} "
                         f"(tensor group {list(tensor_group.ranks)}, data group {list(data_group.ranks)})\n")
        sys.stdout.flush()
