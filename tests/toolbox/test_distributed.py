"""needle.distributed: collectives, DataParallel, ZeRO and Pipeline.

Two tiers: in this process (a job of one: world size 1, where everything must still work and equal plain needle),
and `mpiexec -n 2 python tests/toolbox/distributed/<script>.py` as subprocesses (each script asserts and prints a
line per check; a timeout kills the job's whole process group, so a hung rank fails the test instead of hanging it).
The MPI tier needs mpi4py (`pip install -e ".[distributed]"`) and is skipped with that reason without it.
"""
import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

import needle as ndl
from needle import distributed as dist
from needle import nn, optim
from needle.toolbox.distributed import comm

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed")
DEVICE = ndl.cpu() if ndl.cpu().enabled() else ndl.cpu_numpy()
TIMEOUT = 120


def _mpi_available():
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


needs_mpi = pytest.mark.skipif(not _mpi_available(), reason='mpi4py is not installed (pip install -e ".[distributed]": '
                                                           "mpi4py and MPICH from wheels)")


def mpiexec(*argv, n=2, timeout=TIMEOUT):
    """Run `mpiexec -n n python ARGV` from the repository root; (exit status, stdout + stderr).

    The job runs in its own process group, killed whole when it outlives `timeout` (the test then fails)."""
    launcher = comm.mpiexec_path()
    assert launcher, "mpi4py is installed but no mpiexec was found next to python or on PATH (pip install mpich)"
    env = {**comm.child_environment(), "OMP_NUM_THREADS": "1"}  # two ranks on two cores: one thread each
    proc = subprocess.Popen([launcher, "-n", str(n), sys.executable, *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"mpiexec -n {n} python {' '.join(argv)} did not finish in {timeout} s (a rank hung):\n{out}")
    return proc.returncode, out


def passed(out):
    """{check name: ranks that printed "rank R ok NAME"}."""
    checks = {}
    for r, name in re.findall(r"rank (\d+) ok (\w+?)(?=rank \d|\W|$)", out):
        checks.setdefault(name, set()).add(int(r))
    return checks


def build_mlp(seed=0):
    np.random.seed(seed)
    return nn.Sequential(nn.Linear(6, 16, device=DEVICE), nn.ReLU(), nn.Linear(16, 16, device=DEVICE), nn.ReLU(),
                         nn.Linear(16, 3, device=DEVICE))


def batch(seed=1, n=8):
    rs = np.random.RandomState(seed)
    return (ndl.Tensor(rs.randn(n, 6), device=DEVICE, requires_grad=False),
            ndl.Tensor(rs.randint(0, 3, n), device=DEVICE, requires_grad=False))


def train(model, opt, steps=5, accumulate=1):
    X, y = batch()
    for _ in range(steps):
        opt.reset_grad()
        if accumulate == 1:
            nn.SoftmaxLoss()(model(X), y).backward()
        else:
            b = X.shape[0] // accumulate
            parts = [(ndl.Tensor(X.numpy()[j * b:(j + 1) * b], device=DEVICE),
                      ndl.Tensor(y.numpy()[j * b:(j + 1) * b], device=DEVICE)) for j in range(accumulate)]
            for j, (Xj, yj) in enumerate(parts):
                if j < accumulate - 1:
                    with model.no_sync():
                        (nn.SoftmaxLoss()(model(Xj), yj) / accumulate).backward()
                else:
                    (nn.SoftmaxLoss()(model(Xj), yj) / accumulate).backward()
        opt.step()
    return [p.numpy() for p in model.parameters()]


def reference(steps=5, accumulate=1):
    """Plain needle: the model and Adam, gradients of the micro-batches summed by hand."""
    model = build_mlp()
    opt = ndl.optim.Adam(model.parameters(), lr=0.01)
    X, y = batch()
    params = model.parameters()
    for _ in range(steps):
        opt.reset_grad()
        b = X.shape[0] // accumulate
        total = None
        for j in range(accumulate):
            Xj = ndl.Tensor(X.numpy()[j * b:(j + 1) * b], device=DEVICE)
            yj = ndl.Tensor(y.numpy()[j * b:(j + 1) * b], device=DEVICE)
            loss = nn.SoftmaxLoss()(model(Xj), yj)
            (loss if accumulate == 1 else loss / accumulate).backward()
            grads = [p.grad.realize_cached_data() for p in params]
            total = grads if total is None else [a + g for a, g in zip(total, grads)]
        for p, g in zip(params, total):
            p.grad = ndl.Tensor(g, device=DEVICE, requires_grad=False)
        opt.step()
    return [p.numpy() for p in params]


# ----- the grad hook autograd gives DataParallel ----------------------------------------------------------------
def test_a_grad_hook_runs_once_per_backward_with_the_gradient_set_and_can_be_removed():
    w = ndl.Tensor(np.ones((3, 2)), device=DEVICE)
    seen = []
    remove = w.register_grad_hook(lambda t: seen.append(t.grad.numpy().copy()))
    x = ndl.Tensor(np.arange(6.0).reshape(2, 3), device=DEVICE, requires_grad=False)
    (x @ w).sum().backward()
    assert len(seen) == 1 and np.array_equal(seen[0], w.grad.numpy())
    remove()
    (x @ w).sum().backward()
    assert len(seen) == 1


# ----- a job of one ------------------------------------------------------------------------------------------------
def test_without_mpiexec_the_world_is_one_process_and_mpi4py_is_not_imported():
    code = ("import sys, needle; from needle import distributed as d; d.init(); "
            "print(d.world_size(), d.rank(), 'mpi4py' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=comm.child_environment())
    assert out.stdout.split() == ["1", "0", "False"], out.stderr


def test_collectives_in_a_job_of_one_return_the_input():
    x = DEVICE.full((2, 3), 1.5)
    host = np.asarray  # NDArray, or numpy.ndarray under NEEDLE_BACKEND=np
    assert np.array_equal(host(dist.all_reduce(x)), host(x))
    assert np.array_equal(host(dist.all_reduce(x, op="mean", async_op=True).wait()), host(x))
    assert dist.all_gather(x).shape == (1, 2, 3)
    assert np.array_equal(host(dist.reduce_scatter(x)), host(x).reshape(-1))
    assert np.array_equal(host(dist.broadcast(x)), host(x))
    assert dist.all_gather_object({"a": 1}) == [{"a": 1}] and dist.broadcast_object(3) == 3
    dist.barrier()
    with pytest.raises(ValueError, match="op must be one of"):
        dist.all_reduce(x, op="product")
    with pytest.raises(ValueError, match="cannot send to rank 1"):
        dist.send(x, 1)


def test_the_timeout_is_set_read_and_checked():
    previous = dist.get_timeout()
    assert previous == comm.DEFAULT_TIMEOUT == 300
    try:
        dist.set_timeout(2.5)
        assert dist.get_timeout() == 2.5
        for bad in (0, -1, float("nan"), float("inf"), "5", True, None):
            with pytest.raises(ValueError, match="seconds must be a positive finite number"):
                dist.set_timeout(bad)
        assert dist.get_timeout() == 2.5
    finally:
        dist.set_timeout(previous)


def test_arrival_notices_agree_only_on_the_same_call_and_name_each_ranks_call():
    from needle.toolbox.distributed import notices

    three = notices.make_notice("all_reduce", "float32", "sum", size=3, shape=(3,))
    five = notices.make_notice("all_reduce", "float32", "sum", size=5, shape=(5,))
    later = three.copy()
    later[notices.SEQ] = 7  # sequence numbers are this rank's own count: not compared
    assert notices.disagreement(np.stack([three, later]), [0, 1]) is None
    assert notices.disagreement(np.stack([three, five]), [0, 1]) == (
        "rank 0: all_reduce of shape (3,) float32 (sum); rank 1: all_reduce of shape (5,) float32 (sum)")
    half = notices.make_notice("all_reduce", "float16", "sum", size=3, shape=(3,))
    assert "float16" in notices.disagreement(np.stack([three, half]), [0, 1])
    barrier = notices.make_notice("barrier")
    assert notices.disagreement(np.stack([barrier, three]), [0, 1]).startswith("rank 0: barrier; rank 1: all_reduce")
    # pickled objects differ in size by design; buffers gathered with different counts lists do not agree
    objects = [notices.make_notice("all_gather_object", size=n) for n in (10, 20)]
    assert notices.disagreement(np.stack(objects), [0, 1]) is None
    gathers = [notices.make_notice("all_gather", "float32", size=6, counts=c) for c in ([3, 3], [2, 4])]
    assert "counts checksum" in notices.disagreement(np.stack(gathers), [0, 1])
    with pytest.raises(ValueError, match="op must be one of"):
        notices.make_notice("all_reduce", "float32", "product")


def test_join_in_one_process_changes_nothing_and_is_refused_under_zero_2():
    model = dist.DataParallel(build_mlp())
    opt = ndl.optim.Adam(model.parameters(), lr=0.01)
    with model.join():
        got = train(model, opt)
    assert all(np.array_equal(a, b) for a, b in zip(got, reference()))
    zero = dist.DataParallel(build_mlp())
    dist.ZeroRedundancyOptimizer(zero.parameters(), ndl.optim.Adam, stage=2, lr=0.01)
    with pytest.raises(ValueError, match="not with ZeroRedundancyOptimizer"):
        with zero.join():
            pass


def test_mpiexec_is_found_next_to_python_or_on_path():
    path = comm.mpiexec_path()
    if _mpi_available():
        assert path and os.access(path, os.X_OK)
    env = comm.child_environment({"PMI_RANK": "1", "PMI_SIZE": "2", "OMP_NUM_THREADS": "1", "PMI_FD": "9"})
    assert env == {"OMP_NUM_THREADS": "1"}


def test_data_parallel_of_one_process_equals_plain_needle_bit_for_bit():
    model = dist.DataParallel(build_mlp(), bucket_mb=0.001)  # one bucket per parameter or so
    got = train(model, ndl.optim.Adam(model.parameters(), lr=0.01))
    assert all(np.array_equal(a, b) for a, b in zip(got, reference()))
    stats = model.last_sync_stats()
    assert stats["buckets"] == len(model.buckets()) >= 3 and stats["started_before_last_gradient"] >= 2
    assert stats["bytes"] == 4 * sum(p.numpy().size for p in model.parameters())
    assert model.buckets()[0][:2] == ["modules.4.bias", "modules.4.weight"]  # reverse order of definition


def test_no_sync_accumulates_and_the_next_backward_synchronizes_the_sum():
    model = dist.DataParallel(build_mlp())
    got = train(model, ndl.optim.Adam(model.parameters(), lr=0.01), accumulate=2)
    expected = reference(accumulate=2)
    assert max(float(np.abs(a - b).max()) for a, b in zip(got, expected)) < 1e-6


def test_unused_parameters_get_a_zero_gradient_and_do_not_stall_the_buckets():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 2, device=DEVICE), nn.Linear(4, 2, device=DEVICE)

        def forward(self, x):
            return self.used(x)

    model = dist.DataParallel(TwoHeads())
    model(ndl.Tensor(np.ones((3, 4)), device=DEVICE)).sum().backward()
    assert np.array_equal(model.module.unused.weight.grad.numpy(), np.zeros((4, 2)))
    assert model.module.used.weight.grad is not None


def test_a_backward_that_bypasses_the_wrapper_and_misses_a_parameter_is_named():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 2, device=DEVICE), nn.Linear(4, 2, device=DEVICE)

    inner = TwoHeads()
    model = dist.DataParallel(inner)
    x = ndl.Tensor(np.ones((3, 4)), device=DEVICE)
    inner.used(x).sum().backward()  # not through the wrapper: nobody told it `unused` gets no gradient
    with pytest.raises(RuntimeError, match="through the DataParallel wrapper"):
        inner.used(x).sum().backward()
    assert model is not None


def test_methods_of_the_model_run_through_the_wrapper_and_unwrap_gives_it_back():
    model = dist.DataParallel(build_mlp())
    assert model.modules is model.module.modules  # attributes come from the wrapped model
    assert [n for n, _ in model.named_parameters()][0] == "module.modules.0.weight"
    inner = model.unwrap()
    X, y = batch()
    for _ in range(2):  # backward through the bare model, twice: no hook is left to object
        nn.SoftmaxLoss()(inner(X), y).backward()
    assert dist.data_parallel.wrapper_of(inner.parameters()[0]) is None


def test_zero_of_one_process_equals_plain_needle_for_flat_and_tensor_partitions():
    for cls, kw, partition in ((ndl.optim.Adam, {"lr": 0.01}, "flat"), (ndl.optim.Adafactor, {}, "tensors")):
        plain_model = build_mlp()
        plain_opt = cls(plain_model.parameters(), **kw)
        expected = train(plain_model, plain_opt)
        for stage in (1, 2):
            model = dist.DataParallel(build_mlp())
            opt = dist.ZeroRedundancyOptimizer(model.parameters(), cls, stage=stage, **kw)
            assert opt.partition == partition
            got = train(model, opt)
            assert all(np.array_equal(a, b) for a, b in zip(got, expected)), (cls.__name__, stage)
            assert opt.state_bytes() == plain_opt.state_bytes()


def test_zero_without_a_data_parallel_model_works_in_one_process():
    model = build_mlp()
    opt = dist.ZeroRedundancyOptimizer(model.parameters(), ndl.optim.SGD, lr=0.1)
    got = train(model, opt)
    plain = build_mlp()
    assert all(np.array_equal(a, b) for a, b in zip(got, train(plain, ndl.optim.SGD(plain.parameters(), lr=0.1))))


def test_zero_flat_partition_cuts_the_flat_buffer_evenly_and_tensor_partition_keeps_tensors_whole():
    pieces, shards = dist.zero.flat_partition([5, 3, 4], 2)
    assert shards == [6, 6]
    assert pieces == [[(0, 0, 5, 0, 0)], [(1, 0, 1, 0, 5), (1, 1, 3, 1, 0)], [(2, 0, 4, 1, 2)]]
    pieces, shards = dist.zero.flat_partition([7], 3)
    assert shards == [3, 3, 1]
    pieces, shards = dist.zero.tensor_partition([5, 3, 4], 2)
    assert shards == [5, 7] and [p[0][3] for p in pieces] == [0, 1, 1]


def test_zero_rejects_bad_arguments():
    params = build_mlp().parameters()
    with pytest.raises(ValueError, match="stage must be 1"):
        dist.ZeroRedundancyOptimizer(params, ndl.optim.Adam, stage=4)
    with pytest.raises(ValueError, match="partition must be one of"):
        dist.ZeroRedundancyOptimizer(params, ndl.optim.Adam, partition="rows")
    with pytest.raises(TypeError, match="Optimizer class"):
        dist.ZeroRedundancyOptimizer(params, ndl.optim.Adam(params))
    with pytest.raises(ValueError, match="fp32_state_params"):
        dist.ZeroRedundancyOptimizer(params, ndl.optim.Adam8bit, partition="flat", lr=0.1,
                                     fp32_state_params=params[:1])


def test_a_pipeline_of_one_stage_equals_accumulating_over_its_micro_batches():
    def micro(X, y, m):
        b = X.shape[0] // m
        return [(ndl.Tensor(X.numpy()[j * b:(j + 1) * b], device=DEVICE),
                 ndl.Tensor(y.numpy()[j * b:(j + 1) * b], device=DEVICE)) for j in range(m)]

    pipe = dist.Pipeline([build_mlp()], micro_batches=2)
    opt = ndl.optim.Adam(pipe.parameters(), lr=0.01)
    X, y = batch()
    for _ in range(5):
        opt.reset_grad()
        loss = pipe.train_step(micro(X, y, 2), nn.SoftmaxLoss())
        opt.step()
    assert all(np.array_equal(p.numpy(), e) for p, e in zip(pipe.parameters(), reference(accumulate=2)))
    assert isinstance(loss, float)
    stats = pipe.last_step_stats()
    assert stats["theory"] == 0 and stats["micro_batches"] == 2


def test_a_pipeline_needs_one_stage_per_rank():
    with pytest.raises(ValueError, match="2 stages for 1 rank"):
        dist.Pipeline([build_mlp(), build_mlp()], micro_batches=4)
    with pytest.raises(ValueError, match="micro_batches must be a positive integer"):
        dist.Pipeline([build_mlp()], micro_batches=0)
    assert dist.bubble_fraction(2, 8) == pytest.approx(1 / 9)
    assert dist.bubble_fraction(4, 16) == pytest.approx(3 / 19)


def test_split_batch_and_batchify_in_one_process_keep_everything():
    X = ndl.Tensor(np.ones((4, 3)), device=DEVICE)
    assert dist.split_batch(X) is X
    data = np.arange(40, dtype=np.float32)
    assert np.array_equal(dist.batchify(data, 4), ndl.data.batchify(data, 4, device=None, dtype="float32"))


# ----- two ranks under mpiexec ------------------------------------------------------------------------------------
@needs_mpi
def test_two_ranks_equal_one_process_and_zero_equals_data_parallel():
    code, out = mpiexec(os.path.join(SCRIPTS, "train_exact.py"))
    assert code == 0, out
    checks = passed(out)
    for name in ("collectives", "dp_equals_one_process", "no_sync_accumulation_equals_one_process",
                 "zero1_adam_equals_dp", "zero2_adam_equals_dp", "zero1_sgd_equals_dp", "zero2_sgd_equals_dp",
                 "zero1_adafactor_equals_dp", "zero2_adafactor_equals_dp", "zero1_adam8bit_equals_dp",
                 "zero2_adam8bit_equals_dp", "zero1_adafactor_flat_runs_unfactored"):
        assert checks.get(name) == {0, 1}, (name, out)


@needs_mpi
def test_zero_stages_1_and_2_resume_bit_identically_from_each_ranks_shard(tmp_path):
    code, out = mpiexec(os.path.join(SCRIPTS, "resume_exact.py"), str(tmp_path))
    assert code == 0, out
    checks = passed(out)
    for name in ("adam", "sgd", "adafactor", "adam8bit"):
        for stage in (1, 2):
            assert checks.get(f"resume_zero{stage}_{name}") == {0, 1}, (name, stage, out)
    assert checks.get("zero_refuses_another_ranks_shard") == {0, 1}, out


@needs_mpi
def test_a_two_stage_pipeline_equals_the_unsplit_model():
    code, out = mpiexec(os.path.join(SCRIPTS, "pipeline_exact.py"))
    assert code == 0, out
    checks = passed(out)
    for name in ("pipeline_equals_unsplit_nogc", "pipeline_equals_unsplit_all", "pipeline_forward"):
        assert checks.get(name) == {0, 1}, (name, out)


@needs_mpi
def test_bad_use_is_a_clear_error_on_every_rank():
    code, out = mpiexec(os.path.join(SCRIPTS, "bad_use.py"))
    assert code == 0, out
    for case, message in (("mismatched_shapes", "shape (4, 8) (float32) on rank 0 but 'modules.0.weight' of shape "
                                                "(4, 9) (float32) on rank 1"),
                          ("indivisible_batch", "a batch of 5 along axis 0 does not split evenly over 2 ranks"),
                          ("indivisible_batchify", "batchify: batch_size 5 does not split evenly over 2 ranks"),
                          ("wrong_stage_count", "3 stages for 2 ranks"),
                          ("zero_without_data_parallel", "must be those of one DataParallel model"),
                          ("tensor_parallel_other_weights", "holds other values on rank 1 than on rank 0"),
                          ("tensor_parallel_other_batches", "rank 1 was given other token ids than rank 0")):
        for r in (0, 1):
            assert f"rank {r} error {case}: " in out and message in out, (case, out)


@needs_mpi
def test_an_uncaught_error_on_one_rank_ends_the_whole_job_instead_of_hanging():
    # rank 1 raises, rank 0 waits in a barrier: the job must end (mpiexec's timeout would fail the test), with
    # an error status and rank 1's error in the output, and rank 0 never gets past its barrier
    code, out = mpiexec(os.path.join(SCRIPTS, "bad_use.py"), "uncaught", timeout=60)
    assert code != 0 and "rank 1 fails alone" in out and "not reached" not in out, out



# ----- ranks that go different ways: an error on every rank still running, never a hang -----------------------------
FAILURES = os.path.join(SCRIPTS, "failures.py")
# case: {rank: what its error says}; the job runs with a 3 s timeout (failures.py) and must end well before 30 s
FAILURE_MESSAGES = {
    "exit_early": {1: ["all_reduce (collective #1) on rank 1", "rank 0 has exited"]},
    "silent_rank": {1: ["all_reduce (collective #1) on rank 1", "timed out after 3 s", "rank 0 did not arrive"]},
    "uneven_data": {1: ["DataParallel bucket 1 of 1 (all_reduce, collective #", "on rank 1", "rank 0 has exited"]},
    "extra_backward": {r: [f"on rank {r}", "rank 0: all_reduce of shape (58,) float32 (mean), backward pass 1 "
                                           "since its forward", "rank 1: all_reduce of shape (58,) float32 (mean), "
                                           "backward pass 2 since its forward"] for r in (0, 1)},
    "different_collectives": {r: [f"(collective #1) on rank {r}", "rank 0: barrier",
                                  "rank 1: all_reduce of shape (3,) float32 (sum)"] for r in (0, 1)},
    "all_reduce_shapes": {r: [f"all_reduce (collective #1) on rank {r}", "rank 0: all_reduce of shape (3,) float32",
                              "rank 1: all_reduce of shape (5,) float32"] for r in (0, 1)},
    "reduce_scatter_sizes": {r: [f"reduce_scatter (collective #1) on rank {r}", "of shape (4,) float32",
                                 "of shape (6,) float32"] for r in (0, 1)},
    "all_gather_shapes": {r: [f"all_gather (collective #1) on rank {r}", "of shape (2,) float32",
                              "of shape (3,) float32"] for r in (0, 1)},
    "broadcast_dtypes": {r: [f"broadcast (collective #1) on rank {r}", "of shape (3,) float32",
                             "of shape (3,) float16"] for r in (0, 1)},
    "bucket_sizes": {r: ["DataParallel bucket 1 of ", f"on rank {r}", "rank 0: all_reduce of shape (58,)",
                         "rank 1: all_reduce of shape (26,)"] for r in (0, 1)},
    "recv_timeout": {1: ["recv from rank 0 (tag 5) on rank 1 timed out after 3 s", "rank 0 sent nothing"]},
    "send_timeout": {0: ["send to rank 1 (tag 2) on rank 0 timed out after 3 s", "rank 1 did not take part"]},
}


@needs_mpi
@pytest.mark.parametrize("case", sorted(FAILURE_MESSAGES))
def test_ranks_that_go_different_ways_end_the_job_with_an_error_naming_the_collective(case):
    code, out = mpiexec(FAILURES, case, timeout=30)  # a hang fails the test after 30 s
    assert code != 0, out
    for r, parts in FAILURE_MESSAGES[case].items():
        assert f"rank {r} finished" not in out, out
        lines = [line for line in out.splitlines() if f"on rank {r}" in line]
        assert any(all(part in line for part in parts) for line in lines), (case, r, parts, out)


@needs_mpi
def test_a_caught_collective_error_still_ends_the_job_with_status_1_and_later_collectives_raise_at_once():
    code, out = mpiexec(FAILURES, "caught_error", timeout=30)  # a normal exit would wait in MPI_Finalize
    assert code != 0, out
    for r in (0, 1):
        assert f"rank {r} caught needle.distributed: all_reduce (collective #1) on rank {r}" in out, out
        assert f"rank {r} caught again needle.distributed: barrier on rank {r}: an earlier collective failed" in out
        assert f"rank {r} finished caught_error" in out, out


@needs_mpi
def test_join_lets_ranks_with_uneven_batches_end_together_with_the_one_process_parameters():
    code, out = mpiexec(FAILURES, "join", timeout=60)
    assert code == 0, out
    assert "rank 0 ok join ran 3 batches" in out and "rank 1 ok join ran 5 batches" in out, out


def _tiny_gc_flags(tmp_path, batch_size=4, words=30):
    """gc.py's flags for a tiny model on a tiny corpus of `words` words (its vocabulary: words + 1, <eos>)."""
    folder = tmp_path / "ptb"  # a tiny corpus: the tests need no data from outside
    folder.mkdir()
    rs = np.random.RandomState(0)
    lines = [" ".join(rs.choice([f"w{i}" for i in range(words)], size=8)) for _ in range(40)]
    (folder / "train.txt").write_text("\n".join(lines) + "\n")
    (folder / "test.txt").write_text("\n".join(lines[:5]) + "\n")
    return ["--batch-size", str(batch_size), "--seq-len", "5", "--embedding-size", "8", "--hidden-size", "8",
            "--num-layers", "2", "--num-head", "2", "--warmup", "1", "--device",
            "cpu" if ndl.cpu().enabled() else "cpu_numpy", "--data", str(folder), "--no-progress"]


def test_gc_run_parallel_in_one_process_is_the_plain_run(tmp_path):
    flags = _tiny_gc_flags(tmp_path) + ["--policy", "off", "--max-batches", "2", "--accumulation-steps", "2"]
    for parallel in (None, "dp", "zero2", "pipeline"):
        argv = [os.path.join(ROOT, "gc.py"), "run", *flags, "--json", str(tmp_path / f"{parallel}.json")]
        proc = subprocess.run([sys.executable, *argv] + (["--parallel", parallel] if parallel else []),
                              capture_output=True, text=True, timeout=TIMEOUT, env=comm.child_environment())
        assert proc.returncode == 0, proc.stdout + proc.stderr
    records = {p: json.loads((tmp_path / f"{p}.json").read_text()) for p in (None, "dp", "zero2", "pipeline")}
    losses = {p: [s["loss"] for s in r["steps"]] for p, r in records.items()}
    assert losses["dp"] == losses[None] == losses["zero2"] and np.allclose(losses["pipeline"], losses[None], rtol=1e-6)
    assert records["dp"]["world_size"] == 1 and records["dp"]["per_rank"][0]["rank"] == 0


@needs_mpi
@pytest.mark.parametrize("parallel", ["dp", "zero2", "zero3", "pipeline"])
def test_gc_run_parallel_on_two_ranks_reports_every_rank_and_rank_0_writes_the_json(tmp_path, parallel):
    json_path = tmp_path / "run.json"
    accumulate = "1" if parallel == "zero3" else "2"  # zero3 refuses accumulation (each backward reduce-scatters)
    code, out = mpiexec(os.path.join(ROOT, "gc.py"), "run", "--parallel", parallel, *_tiny_gc_flags(tmp_path),
                        "--policy", "off", "--max-batches", "2", "--accumulation-steps", accumulate, "--json",
                        str(json_path))
    assert code == 0, out
    assert f"--parallel {parallel} over 2 ranks" in out and "tokens/s" in out
    assert re.search(r"^\s+0\s+[\d.]+\s+[\d.]+", out, re.M) and re.search(r"^\s+1\s+[\d.]+\s+[\d.]+", out, re.M), out
    record = json.loads(json_path.read_text())
    assert record["parallel"] == parallel and record["world_size"] == 2 and len(record["steps"]) == 2
    ranks = record["per_rank"]
    assert [m["rank"] for m in ranks] == [0, 1] and record["tokens_per_second"] > 0
    assert not list(tmp_path.glob("*.tmp"))  # only rank 0 wrote, once per step
    if parallel == "zero2":  # each rank holds half the optimizer state and half the gradients (to an element)
        assert abs(ranks[0]["optimizer_bytes"] - ranks[1]["optimizer_bytes"]) <= 8
        assert sum(m["grad_bytes"] for m in ranks) == record["param_bytes"]
    if parallel == "zero3":  # parameters, gradients and optimizer state: each rank its half (to an element)
        assert abs(ranks[0]["param_bytes"] - ranks[1]["param_bytes"]) <= 4
        assert all(m["grad_bytes"] == m["param_bytes"] and m["optimizer_bytes"] == 2 * m["param_bytes"]
                   for m in ranks), ranks
    if parallel == "pipeline":
        assert 0 <= record["pipeline"]["bubble_median"] < 1 and record["pipeline"]["theory"] == pytest.approx(1 / 3)
        assert sum(m["param_bytes"] for m in ranks) > record["param_bytes"]  # each rank holds only its stage


@needs_mpi
@pytest.mark.parametrize("parallel", ["tp", "tp+sp", "tp+dp"])
def test_gc_run_tensor_parallel_equals_one_process_with_about_half_the_parameters_per_rank(tmp_path, parallel):
    """tp, tp+sp on 2 ranks; tp+dp on 4 (oversubscribed): tensor groups of 2, the batch split over 2 data groups."""
    n = 4 if parallel == "tp+dp" else 2
    flags = _tiny_gc_flags(tmp_path, words=31) + ["--seq-len", "6", "--embedding-size", "16", "--hidden-size", "32",
                                                   "--max-batches", "2", "--use-gc", "1"]
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "gc.py"), "run", *flags, "--json", str(one)],
                          capture_output=True, text=True, timeout=TIMEOUT, env=comm.child_environment())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    code, out = mpiexec(os.path.join(ROOT, "gc.py"), "run", "--parallel", parallel, *flags, "--json", str(two), n=n,
                        timeout=180)
    assert code == 0, out
    assert f"--parallel {parallel} over {n} ranks" in out and "the split layers' collectives" in out, out
    alone, split = json.loads(one.read_text()), json.loads(two.read_text())
    assert split["vocab_size"] == 32 and len(split["steps"]) == 2
    assert np.allclose([s["loss"] for s in split["steps"]], [s["loss"] for s in alone["steps"]], rtol=1e-5, atol=0)
    ranks = split["per_rank"]
    assert [m["rank"] for m in ranks] == list(range(n)) and all(m["time_seconds"] > 0 for m in ranks)
    for m in ranks:  # the split layers halved; the layer norms and positions whole on both ranks: about half
        assert 0.45 * alone["param_bytes"] <= m["param_bytes"] <= 0.55 * alone["param_bytes"], (m, alone)
        assert m["optimizer_bytes"] == 2 * m["param_bytes"] and m["grad_bytes"] == m["param_bytes"], m
    kinds = split["tensor_parallel"]
    assert set(kinds) == ({"all_reduce", "all_gather", "reduce_scatter"} if parallel == "tp+sp" else {"all_reduce"})
    if parallel == "tp+dp":  # and the data-parallel groups' gradient buckets
        assert split["sync"]["buckets"] >= 1, split["sync"]


@needs_mpi
def test_gc_under_mpiexec_refuses_bad_parallel_use_on_every_rank(tmp_path):
    flags = _tiny_gc_flags(tmp_path) + ["--policy", "off", "--max-batches", "1"]
    code, out = mpiexec(os.path.join(ROOT, "gc.py"), "run", *flags, timeout=60)
    assert code == 2 and out.count("give --parallel dp|zero1|zero2|zero3|pipeline") == 2, out
    code, out = mpiexec(os.path.join(ROOT, "gc.py"), "run", "--parallel", "zero3", *flags, "--accumulation-steps",
                        "2", timeout=60)
    assert code == 2 and out.count("--parallel zero3 needs --accumulation-steps 1") == 2, out
    code, out = mpiexec(os.path.join(ROOT, "gc.py"), "run", "--parallel", "dp", *flags, "--batch-size", "5",
                        timeout=60)
    assert code == 2 and out.count("--batch-size 5 does not split over 2 ranks") == 2, out
    code, out = mpiexec(os.path.join(ROOT, "gc.py"), "run", "--parallel", "tp", *flags, "--num-head", "1",
                        timeout=60)
    refused = "--parallel tp: --num-head 1 does not divide by the tensor-parallel size 2"
    assert code == 2 and out.count(refused) == 2, out
    code, out = mpiexec(os.path.join(ROOT, "gc.py"), "run", "--parallel", "tp+sp", *flags, "--seq-len", "6",
                        timeout=60)  # a corpus of 30 words: a vocabulary of 31
    assert code == 2 and out.count("the vocabulary of 31 words does not divide by the tensor-parallel size 2") == 2, out


@needs_mpi
def test_gc_ablate_under_mpiexec_offers_the_dp_row(tmp_path):
    code, out = mpiexec(os.path.join(ROOT, "gc.py"), "ablate", *_tiny_gc_flags(tmp_path, batch_size=8), "--rows",
                        "baseline", "dp", "--steps", "2", "--out", str(tmp_path / "ablation"))
    assert code == 0, out
    result = json.loads((tmp_path / "ablation" / "ablation.json").read_text())
    base, dp = result["rows"]
    assert dp["row"] == "dp" and dp["world_size"] == 2 and "dp over 2 ranks (4 per rank)" in dp["setup"]
    assert abs(dp["loss"] - base["loss"]) < 1e-5  # the same global batch, on two ranks
    assert dp["activation_bytes"] < base["activation_bytes"]  # each rank holds half the batch's activations


@needs_mpi
def test_gc_ablate_under_mpiexec_offers_the_zero3_and_tp_rows(tmp_path):
    flags = _tiny_gc_flags(tmp_path, batch_size=8, words=31) + ["--embedding-size", "16", "--hidden-size", "32"]
    code, out = mpiexec(os.path.join(ROOT, "gc.py"), "ablate", *flags, "--rows", "baseline", "zero3", "tp", "--steps",
                        "2", "--out", str(tmp_path / "ablation"))
    assert code == 0, out
    base, zero3, tp = json.loads((tmp_path / "ablation" / "ablation.json").read_text())["rows"]
    assert "zero3 over 2 ranks (4 per rank)" in zero3["setup"] and "tp over 2 ranks (8 per rank)" in tp["setup"]
    for row in (zero3, tp):  # the same global batch; each rank holds about half the parameters and Adam state
        assert row["world_size"] == 2 and abs(row["loss"] - base["loss"]) < 1e-5, (row, base)
        assert row["param_bytes"] <= 0.55 * base["param_bytes"], (row["row"], row["param_bytes"], base["param_bytes"])
        assert row["optimizer_bytes"] <= 0.55 * base["optimizer_bytes"], row["row"]


@needs_mpi
@pytest.mark.parametrize("parallel", ["zero2", "pipeline"])
def test_gc_run_on_two_ranks_resumes_from_one_file_per_rank_bit_for_bit(tmp_path, parallel):
    """gc.py run --save-checkpoint under mpiexec: each rank its own file (its RNG, its ZeRO shard or pipeline
    stage); --resume continues as the uninterrupted job does, losses and final parameters alike (issue 26, item 6)."""
    flags = ["run", "--parallel", parallel, *_tiny_gc_flags(tmp_path), "--policy", "off", "--dropout", "0.1",
             "--accumulation-steps", "2"]
    ckpt, gc_py = str(tmp_path / "ckpt"), os.path.join(ROOT, "gc.py")
    for extra in (["--max-batches", "4", "--json", str(tmp_path / "whole.json")],
                  ["--max-batches", "2", "--json", str(tmp_path / "first.json"), "--save-checkpoint", ckpt],
                  ["--max-batches", "4", "--json", str(tmp_path / "rest.json"), "--resume", ckpt]):
        code, out = mpiexec(gc_py, *flags, *extra)
        assert code == 0, out
    whole, first, rest = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("whole", "first", "rest"))
    assert sorted(p.name for p in tmp_path.glob("ckpt*")) == ["ckpt.rank0.npz", "ckpt.rank1.npz"]
    assert [s["loss"] for s in first["steps"] + rest["steps"]] == [s["loss"] for s in whole["steps"]]
    assert rest["parameters_sha256"] == whole["parameters_sha256"]  # rank 0's parameters (a stage, for pipeline)


def test_zero_flat_shard_follows_a_model_loaded_after_it_was_built():
    # The flat shard was a copy taken at construction: a model loaded afterwards (a warm start from a model-only
    # file) was silently overwritten by the first step's all-gather of the old values.
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    warm = {k: v + 1.0 for k, v in model.state_dict().items()}
    opt = dist.ZeroRedundancyOptimizer(model.parameters(), optim.SGD, lr=0.1)
    model.load_state_dict(warm)
    reference = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    reference.load_state_dict(warm)
    ref_opt = optim.SGD(reference.parameters(), lr=0.1)
    x = ndl.Tensor(np.random.randn(5, 4).astype(np.float32), requires_grad=False)
    for m, o in ((model, opt), (reference, ref_opt)):
        o.reset_grad()
        (m(x) * m(x)).sum().backward()
        o.step()
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values()):
        np.testing.assert_array_equal(got, want, err_msg=name)


# ----- process groups -----------------------------------------------------------------------------------------------
def test_a_group_in_a_job_of_one_is_the_job():
    group = dist.new_group([0])
    assert dist.world_size(group) == 1 and dist.rank(group) == 0
    x = DEVICE.full((3,), 2.0)
    assert np.array_equal(dist.all_reduce(x, group=group).numpy(), [2.0, 2.0, 2.0])
    with pytest.raises(ValueError, match="distinct ranks"):
        dist.new_group([0, 0])


@needs_mpi
def test_groups_run_their_own_collectives_and_data_parallel_averages_within_its_group():
    code, out = mpiexec(os.path.join(SCRIPTS, "groups.py"))
    assert code == 0, out
    checks = passed(out)
    for name in ("group_all_reduce", "group_all_gather", "non_member_refused", "traffic_counted",
                 "data_parallel_group"):
        assert checks.get(name) == {0, 1}, (name, out)


@needs_mpi
@pytest.mark.parametrize("case, error, words", [
    ("mismatch", "CollectiveMismatch", "in the group of ranks [0, 1]"),
    ("timeout", "CollectiveTimeout", "rank 1 did not arrive"),
])
def test_a_mismatch_or_a_missing_rank_within_a_group_is_an_error_not_a_hang(case, error, words):
    code, out = mpiexec(os.path.join(SCRIPTS, "groups.py"), case, timeout=40)
    assert code != 0, out
    assert f"rank 0 error {error}" in out and words in out, out
    if case == "mismatch":
        assert f"rank 1 error {error}" in out, out


# ----- tensor and sequence parallelism --------------------------------------------------------------------------------
def test_checkpointing_never_drops_the_output_of_a_collective():
    from needle import checkpoint
    from needle.toolbox.distributed import tensor_parallel as tp
    np.random.seed(0)
    x = ndl.Tensor(np.random.randn(4, 3), device=DEVICE, requires_grad=True)
    inner = ndl.ops.relu(x) * 2.0
    reduced = tp.reduce_from_region(inner)  # a collective: computing it again would call it again
    copied = tp.copy_to_region(reduced)  # f: the identity forward, free to drop and recompute
    out = ndl.ops.relu(copied) + 1.0
    checkpoint.annotate(out, [x], policy="all")
    assert inner.drop and copied.drop and not reduced.drop
    assert not tp.regions.ReduceFromRegion.recomputable and tp.regions.CopyToRegion.recomputable
    out.sum().backward()
    assert np.allclose(x.grad.numpy(), 2.0 * (x.numpy() > 0))


def one_process(script):
    """The MPI script `script` run as one plain process (a job of one): the finished process."""
    return subprocess.run([sys.executable, os.path.join(SCRIPTS, script)], cwd=ROOT, env=comm.child_environment(),
                          capture_output=True, text=True, timeout=TIMEOUT)


def test_tensor_parallel_of_one_process_is_the_plain_model():
    # the MPI script's checks in a job of one: the same numbers, the collectives counted and unchanged by gc
    proc = one_process("tensor_parallel_exact.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(passed(proc.stdout)) >= {"exact_tp_all", "exact_tp_sp_all", "no_extra_collectives_tp"}, proc.stdout


@needs_mpi
def test_tensor_and_sequence_parallel_on_two_ranks_equal_one_process_with_and_without_checkpointing():
    code, out = mpiexec(os.path.join(SCRIPTS, "tensor_parallel_exact.py"))
    assert code == 0, out
    checks = passed(out)
    for name in ("state_dict_full_shapes", "exact_tp_off", "exact_tp_all", "exact_tp_sp_off", "exact_tp_sp_all",
                 "no_extra_collectives_tp", "no_extra_collectives_tp_sp", "parameter_bytes", "megatron_volume_tp",
                 "megatron_volume_tp_sp", "sp_norm_dropout_activations"):
        assert checks.get(name) == {0, 1}, (name, out)


@needs_mpi
def test_heads_that_do_not_divide_by_the_tensor_parallel_size_are_a_value_error_on_every_rank():
    code, out = mpiexec(os.path.join(SCRIPTS, "tensor_parallel_exact.py"), "indivisible", timeout=60)
    assert code == 0, out
    for r in (0, 1):
        assert (f"rank {r} error ValueError: parallelize_transformer: seq_model.layers.0.attention has 3 heads, "
                f"which do not divide by the tensor-parallel size 2") in out, out


# ----- ZeRO-3 ------------------------------------------------------------------------------------------------------
def test_zero_3_of_one_process_is_the_plain_model():
    # the MPI script's checks in a job of one: bit-identical numbers, state dicts in full shapes, gc and bf16
    proc = one_process("zero3_exact.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(passed(proc.stdout)) >= {"zero3_state_dict_full_shapes", "exact_zero3_off", "exact_zero3_all",
                                        "zero3_collectives_with_gc", "zero3_bf16_autocast"}, proc.stdout


def test_zero_3_needs_a_data_parallel_model_and_an_elementwise_optimizer():
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    with pytest.raises(ValueError, match="DataParallel model"):
        dist.ZeroRedundancyOptimizer(model.parameters(), optim.Adam, stage=3)
    with pytest.raises(ValueError, match="element by element"):
        dist.ZeroRedundancyOptimizer(dist.DataParallel(model).parameters(), optim.Adafactor, stage=3)


@needs_mpi
def test_zero_3_on_two_ranks_equals_one_process_with_half_the_model_state_and_1_5x_the_traffic():
    code, out = mpiexec(os.path.join(SCRIPTS, "zero3_exact.py"))
    assert code == 0, out
    checks = passed(out)
    for name in ("zero3_state_dict_full_shapes", "exact_zero3_off", "exact_zero3_all", "zero3_state_bytes",
                 "zero3_collectives_with_gc", "zero3_volume", "zero3_bf16_autocast"):
        assert checks.get(name) == {0, 1}, (name, out)


@needs_mpi
def test_tensor_by_data_parallel_on_four_ranks_equals_one_process():
    code, out = mpiexec(os.path.join(SCRIPTS, "tp_dp_exact.py"), n=4, timeout=180)  # 4 ranks oversubscribed
    assert code == 0, out
    checks = passed(out)
    assert checks.get("exact_tp_dp") == {0, 1, 2, 3} and checks.get("exact_tp_dp_sp") == {0, 1, 2, 3}, out
