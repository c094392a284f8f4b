"""needle.distributed on this machine, 2 ranks: exactness, memory per rank, communication, overlap, scaling.

    python benchmarks/bench_distributed.py                       # every part (a few minutes on 2 cores)
    python benchmarks/bench_distributed.py --parts memory comm   # some of them

Each part starts its own job, `mpiexec -n 2 python bench_distributed.py --worker PART` (or gc.py runs), one
OpenMP thread per rank (two ranks, two cores), and prints a table:

- exactness: 5 Adam steps of a Transformer LM, 2 ranks x batch B/2 against 1 process x batch B (max relative
  difference per tensor), ZeRO-1/2 and Adafactor/Adam8bit under ZeRO against plain data parallelism.
- memory: the benchmark LM (gc.py's defaults: E = H = 256, 4 layers, vocabulary 10,000): per-rank optimizer state
  and gradient bytes, plain data parallelism vs ZeRO-1 vs ZeRO-2 (Adam; Adam8bit and Adafactor by tensors).
- comm: bytes each rank sends per all-reduce / reduce-scatter / all-gather, measured on the loopback interface:
  MPICH is told to go through TCP (MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp MPIR_CVAR_NOLOCAL=1; its default
  shared-memory path has no counter to read), and /proc/net/dev's transmitted bytes of `lo`, over both ranks,
  halved, are compared with the ring bound 2(n-1)/n x buffer (reduce-scatter, all-gather: (n-1)/n). The counter
  is the whole machine's and a single try is sometimes read early, so each figure is the median of 5 tries. Then
  the time of an all-reduce on the default (shared-memory) path.
- overlap: DataParallel on the benchmark LM with 25 MB and 4 MB buckets: buckets, how many started while backward
  ran, how long backward waited at its end, against a blocking all-reduce of the same bytes after backward.
- scaling: `gc.py run` tokens/s, 1 process (1 thread, and 2 threads) vs `--parallel dp` on 2 ranks, the same
  global batch, and two plain processes of half the batch at once (no communication: the machine's ceiling for two
  processes); `--parallel pipeline` with m micro-batches: measured bubble vs (d - 1)/(m + d - 1), and vs GPipe's
  bubble for the stages' measured (unequal) costs.
- tp: one model (E = 128, 2 layers, vocabulary 2,000, 4 heads, batch 8 x 32 tokens, dropout 0.1) trained with DP,
  ZeRO-1, ZeRO-2, ZeRO-3, tensor parallelism and tensor + sequence parallelism on 2 ranks: exact bytes per rank of
  parameters, gradients, Adam's state (parameter and state sizes) and activations (the allocator's bytes held at the
  start of backward, less those held before the forward; and of them the layer norms' and dropouts', from a
  recorded step: what sequence parallelism divides), the elements each rank's collectives moved per step (against
  Megatron's count for TP), and the step time (median of 3 after a warm-up); printed as a Markdown table
  (`python benchmarks/bench_distributed.py --parts tp`, what docs/distributed.md's table is made from).
"""
import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "apps")]

import numpy as np  # noqa: E402

import needle as ndl  # noqa: E402
from needle import distributed as dist  # noqa: E402
from needle import nn  # noqa: E402
from needle.data import batchify, get_batch  # noqa: E402
from needle.toolbox.distributed import comm  # noqa: E402

from models import LanguageModel  # noqa: E402

PARTS = ["exactness", "memory", "comm", "overlap", "scaling", "tp"]
TCP = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "MPIR_CVAR_NOLOCAL": "1"}
DEVICE = ndl.cpu() if ndl.cpu().enabled() else ndl.cpu_numpy()


def lm(embedding, layers, vocab, seq_len=32, dropout=0.0):
    np.random.seed(0)
    return LanguageModel(embedding, vocab, embedding, num_layers=layers, seq_model="transformer", seq_len=seq_len,
                         device=DEVICE, num_head=4, dim_head=embedding // 4, dropout=dropout)


def emit(obj):
    """A worker's result: one JSON line from rank 0."""
    if dist.rank() == 0:
        print("RESULT " + json.dumps(obj), flush=True)


# ----- workers (under mpiexec) --------------------------------------------------------------------------------
def worker_exactness():
    vocab, seq, batch, steps = 1000, 16, 16, 5
    rs = np.random.RandomState(1)
    data = rs.randint(0, vocab, size=20000).astype(np.float32)
    full = batchify(data, batch, device=DEVICE, dtype="float32")
    mine = dist.batchify(data, batch, device=DEVICE, dtype="float32")

    def train(model, opt, batches):
        for step in range(steps):
            opt.reset_grad()
            X, y = get_batch(batches, step * seq, seq, device=DEVICE)
            nn.SoftmaxLoss()(model(X)[0], y).backward()
            opt.step()
        return [p.numpy() for p in model.parameters()]

    ref_model = lm(64, 2, vocab, seq)
    X, y = get_batch(full, 0, seq, device=DEVICE)
    nn.SoftmaxLoss()(ref_model(X)[0], y).backward()
    grads = [float(np.abs(p.grad.numpy()).max()) for p in ref_model.parameters()]
    noise = {i for i, g in enumerate(grads) if g < 1e-6 * max(grads)}  # gradient zero but for rounding
    ref_model = lm(64, 2, vocab, seq)
    reference = train(ref_model, ndl.optim.Adam(ref_model.parameters(), lr=1e-3), full)
    out = {"tensors": len(reference), "noise_tensors": [ref_model.parameters()[i].name for i in sorted(noise)]}
    model = dist.DataParallel(lm(64, 2, vocab, seq))
    dp = train(model, ndl.optim.Adam(model.parameters(), lr=1e-3), mine)
    rel = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(dp, reference)]
    out["dp_vs_one_process_max_rel"] = max(r for i, r in enumerate(rel) if i not in noise)
    out["dp_vs_one_process_max_rel_noise_tensors"] = max((rel[i] for i in noise), default=None)
    out["dp_vs_one_process_median_rel"] = statistics.median(rel)
    for name, cls, kw in (("adam", ndl.optim.Adam, {"lr": 1e-3}), ("adafactor", ndl.optim.Adafactor, {}),
                          ("adam8bit", ndl.optim.Adam8bit, {"lr": 1e-3})):
        model = dist.DataParallel(lm(64, 2, vocab, seq))
        plain = dp if name == "adam" else train(model, cls(model.parameters(), **kw), mine)
        for stage in (1, 2):
            model = dist.DataParallel(lm(64, 2, vocab, seq))
            got = train(model, dist.ZeroRedundancyOptimizer(model.parameters(), cls, stage=stage, **kw), mine)
            out[f"zero{stage}_{name}_vs_dp_max_abs"] = max(float(np.abs(a - b).max()) for a, b in zip(got, plain))
    emit(out)


def worker_memory():
    out = {"rank": []}
    for name, cls, kw in (("adam", ndl.optim.Adam, {"lr": 1e-3}), ("adam8bit", ndl.optim.Adam8bit, {"lr": 1e-3}),
                          ("adafactor", ndl.optim.Adafactor, {})):
        row = {}
        for setup in ("dp", "zero1", "zero2"):
            model = dist.DataParallel(lm(256, 4, 10000))
            params = model.parameters()
            extra = {"fp32_state_params": [model.module.embedding.weight]} if name == "adam8bit" else {}
            opt = cls(params, **kw, **extra) if setup == "dp" else \
                dist.ZeroRedundancyOptimizer(params, cls, stage=int(setup[-1]), **kw, **extra)
            X = ndl.Tensor(np.zeros((8, 2)), device=DEVICE, requires_grad=False)
            y = ndl.Tensor(np.zeros(16), device=DEVICE, requires_grad=False)
            model.loss(X, y)[0].backward()
            grads = opt.gradient_bytes() if setup != "dp" else sum(p.grad.realize_cached_data().nbytes
                                                                  for p in params)
            opt.step()
            row[setup] = dist.all_gather_object({"state": opt.state_bytes(), "grads": int(grads)})
            row["params"] = sum(int(np.prod(p.shape)) for p in params)
        out[name] = row
    emit(out)


TP_MODEL = {"embedding": 128, "layers": 2, "vocab": 2000, "seq": 32, "batch": 8, "dropout": 0.1}
TP_SETUPS = ("dp", "zero1", "zero2", "zero3", "tp", "tp+sp")
# elements a rank sends per element of a collective's buffer, by the ring algorithm on 2 ranks (2(n-1)/n, (n-1)/n)
RING = {"all_reduce": 1.0, "reduce_scatter": 0.5, "all_gather": 0.5, "barrier": 0, "all_gather_object": 0,
        "broadcast_object": 0, "broadcast": 0.5}


def worker_tp():
    """Per-rank bytes, communicated elements and step time of one model under each setup (TP_SETUPS)."""
    from needle.backend_ndarray import ndarray
    from needle.toolbox.distributed import tensor_parallel as tp
    cfg = TP_MODEL
    rs = np.random.RandomState(1)
    tokens = rs.randint(0, cfg["vocab"], size=(cfg["seq"] + 1, cfg["batch"])).astype(np.float32)
    out = {"model": cfg, "rows": {}}
    for setup in TP_SETUPS:
        model = lm(cfg["embedding"], cfg["layers"], cfg["vocab"], cfg["seq"], cfg["dropout"])
        X, y = tokens[:-1], tokens[1:]
        if setup.startswith("tp"):
            tp.parallelize_transformer(model, sequence_parallel=setup == "tp+sp")
        else:  # data parallel: this rank's half of the batch
            model = dist.DataParallel(model)
            X, y = dist.split_batch(X, axis=1), dist.split_batch(y, axis=1)
        X = ndl.Tensor(X, device=DEVICE, requires_grad=False)
        y = ndl.Tensor(y.reshape(-1), device=DEVICE, requires_grad=False)
        params = model.parameters()
        opt = dist.ZeroRedundancyOptimizer(params, ndl.optim.Adam, stage=int(setup[-1]), lr=1e-3) \
            if setup.startswith("zero") else ndl.optim.Adam(params, lr=1e-3)
        times = []
        for step in range(4):
            opt.reset_grad()
            dist.barrier()
            dist.traffic(reset=True)
            recording = ndl.memory.record(DEVICE) if step == 0 else contextlib.nullcontext()
            with recording as snap:  # the first step (its time is left out): what the layer norms and dropouts keep
                t0, before = time.perf_counter(), ndarray.memory_stats(DEVICE)["current_bytes"]
                loss, _ = model.loss(X, y)
                activations = ndarray.memory_stats(DEVICE)["current_bytes"] - before
                loss.backward()
            if step == 0:
                norms = tp.norm_and_dropout_bytes(snap)
            grads = opt.gradient_bytes() if setup.startswith("zero") else \
                sum(p.grad.realize_cached_data().nbytes for p in params if p.grad is not None)
            opt.step()
            times.append(time.perf_counter() - t0)
            traffic = dist.traffic()
        held = opt.params if setup == "zero3" else params  # ZeRO-3: the shards (the model's are placeholders)
        mine = {"parameters": sum(p.realize_cached_data().nbytes for p in held), "gradients": int(grads),
                "state": opt.state_bytes(), "activations": int(activations), "norms_dropouts": int(norms),
                "elements": sum(RING[kind] * elements for kind, (_, elements) in traffic.items()),
                "seconds": statistics.median(times[1:])}
        out["rows"][setup] = dist.all_gather_object(mine)
    emit(out)


def _lo_bytes():
    with open("/proc/net/dev") as f:
        for line in f:
            if line.strip().startswith("lo:"):
                return int(line.split(":")[1].split()[8])
    return 0


def worker_comm():
    n = dist.world_size()
    out = []
    for mb in (1, 25, 64):
        size = mb * 2**20 // 4
        row = {"MB": mb}
        for op in ("all_reduce", "reduce_scatter", "all_gather"):
            sent = []
            for _ in range(5):
                buffer = np.ones(size, np.float32)
                dist.barrier()
                before = _lo_bytes()
                if op == "all_reduce":
                    comm.all_reduce_buffer(buffer)
                elif op == "reduce_scatter":
                    comm.reduce_scatter_buffer(buffer, [size // n] * n).wait()
                else:
                    comm.all_gather_buffer(buffer[:size // n], [size // n] * n)
                dist.barrier()
                sent.append((_lo_bytes() - before) / n)
            row[op] = statistics.median(sent) / buffer.nbytes
        times = []
        for _ in range(5):
            buffer = np.ones(size, np.float32)
            dist.barrier()
            t0 = time.perf_counter()
            comm.all_reduce_buffer(buffer)
            times.append(time.perf_counter() - t0)
        row["all_reduce_seconds"] = statistics.median(times)
        out.append(row)
    small = np.ones(16, np.float32)
    emit({"buffers": out, "all_reduce_16_floats_seconds": _latency(lambda: comm.all_reduce_buffer(small)),
          "barrier_seconds": _latency(dist.barrier)})


def _latency(collective, calls=2000):
    """The median time of one small collective (each checks the ranks' arrival notices first)."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        collective()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker_overlap():
    """Backward with DataParallel against backward of the same model without it (same batch, same rank), the setups
    interleaved over 7 rounds (medians of the last 6): the difference is what communication adds to backward,
    split into copying gradients into and out of the buckets and waiting at the end (rank skew included); a
    blocking all-reduce of the same bytes after backward is what it would cost unhidden."""
    seq, batch = 32, 8  # per rank
    rs = np.random.RandomState(dist.rank())
    X = ndl.Tensor(rs.randint(0, 10000, (seq, batch)), device=DEVICE, requires_grad=False)
    y = ndl.Tensor(rs.randint(0, 10000, seq * batch), device=DEVICE, requires_grad=False)
    setups = {"plain": lm(256, 4, 10000)}
    for bucket_mb in (25, 4, 1):
        setups[bucket_mb] = dist.DataParallel(lm(256, 4, 10000), bucket_mb=bucket_mb)
    total = sum(int(np.prod(p.shape)) for p in setups["plain"].parameters())
    times = {key: [] for key in list(setups) + ["blocking"]}
    stats = {key: [] for key in setups}
    for _ in range(7):
        for key, model in setups.items():
            for p in model.parameters():
                p.grad = None
            loss = model.loss(X, y)[0]
            dist.barrier()
            t0 = time.perf_counter()
            loss.backward()
            times[key].append(time.perf_counter() - t0)
            if key != "plain":
                stats[key].append(model.last_sync_stats())
        buffer = np.ones(total, np.float32)
        dist.barrier()
        t0 = time.perf_counter()
        comm.all_reduce_buffer(buffer)
        times["blocking"].append(time.perf_counter() - t0)
    median = {key: statistics.median(values[1:]) for key, values in times.items()}
    rows = []
    for bucket_mb in (25, 4, 1):
        last = stats[bucket_mb][1:]
        rows.append({"bucket_mb": bucket_mb, "buckets": last[-1]["buckets"],
                     "started_before_last_gradient": last[-1]["started_before_last_gradient"],
                     "wait_seconds": statistics.median(s["wait_seconds"] for s in last),
                     "copy_seconds": statistics.median(s["copy_seconds"] for s in last),
                     "backward_seconds": median[bucket_mb], "plain_backward_seconds": median["plain"],
                     "blocking_all_reduce_seconds": median["blocking"],
                     "buffer_peak_bytes": last[-1]["buffer_peak_bytes"], "bytes": last[-1]["bytes"]})
    emit(rows)


WORKERS = {"exactness": worker_exactness, "memory": worker_memory, "comm": worker_comm, "overlap": worker_overlap,
           "tp": worker_tp}


# ----- the driver -----------------------------------------------------------------------------------------------
def launch(argv, n=2, env=None, timeout=1200, threads=1):
    """Run python ARGV (under mpiexec -n n when n > 1); return (exit status, output)."""
    cmd = [sys.executable, *argv]
    if n > 1:
        cmd = [comm.mpiexec_path() or "mpiexec", "-n", str(n)] + cmd
    environment = {**comm.child_environment(), "OMP_NUM_THREADS": str(threads), **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def run_worker(part, env=None):
    code, out = launch([os.path.abspath(__file__), "--worker", part], env=env)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if code != 0 or not lines:
        raise SystemExit(f"bench_distributed: the {part} job failed (exit {code}):\n{out}")
    return json.loads(lines[-1][len("RESULT "):])


def mb(x):
    return f"{x / 2**20:.2f}"


def part_exactness(results):
    r = run_worker("exactness")
    results["exactness"] = r
    print("\nexactness: Transformer LM (E = 64, 2 layers, vocabulary 1000), batch 16 x seq_len 16, 5 Adam steps")
    print(f"  2 ranks x 8 vs 1 process x 16: max relative difference per tensor {r['dp_vs_one_process_max_rel']:.2e} "
          f"over {r['tensors'] - len(r['noise_tensors'])} of {r['tensors']} tensors (median "
          f"{r['dp_vs_one_process_median_rel']:.1e}); the other {len(r['noise_tensors'])} "
          f"({', '.join(r['noise_tensors'])}) have a gradient that is zero but for rounding, so Adam follows the "
          f"noise: {r['dp_vs_one_process_max_rel_noise_tensors']:.1e}")
    for key in sorted(k for k in r if k.startswith("zero")):
        print(f"  {key.replace('_vs_dp_max_abs', '')}: max |difference| to plain data parallelism {r[key]:g}")


def part_memory(results):
    r = run_worker("memory")
    results["memory"] = r
    n = 2
    print(f"\nmemory per rank: the benchmark LM ({r['adam']['params']:,} parameters), 2 ranks")
    print(f"  {'optimizer':10s}{'setup':7s}{'state MB r0':>13s}{'state MB r1':>13s}{'x plain':>9s}"
          f"{'grads MB r0':>13s}{'grads MB r1':>13s}")
    for name in ("adam", "adam8bit", "adafactor"):
        plain = r[name]["dp"][0]["state"]
        for setup in ("dp", "zero1", "zero2"):
            ranks = r[name][setup]
            print(f"  {name:10s}{setup:7s}{mb(ranks[0]['state']):>13s}{mb(ranks[1]['state']):>13s}"
                  f"{ranks[0]['state'] / plain:9.4f}{mb(ranks[0]['grads']):>13s}{mb(ranks[1]['grads']):>13s}")
    p = r["adam"]["params"]
    print(f"  Adam, ZeRO-1: {r['adam']['zero1'][0]['state']} + {r['adam']['zero1'][1]['state']} bytes = 8 x "
          f"{p} = {8 * p} (1/{n} each: {8 * -(-p // n)} and {8 * (p - -(-p // n))})")


def part_tp(results):
    """The Markdown table of the tp worker (stdout), one row per setup, rank 0's figures (and rank 1's where they
    differ); ratios to one process's bytes (dp's parameters and state, dp's activations x 2 ranks)."""
    r = run_worker("tp")
    results["tp"] = r
    cfg, rows = r["model"], r["rows"]
    whole = rows["dp"][0]
    one_activations = 2 * whole["activations"]  # one process holds both halves of the batch
    bte, layers = cfg["batch"] * cfg["seq"] * cfg["embedding"], cfg["layers"]
    print(f"\nPer rank, 2 ranks: Transformer LM (E = {cfg['embedding']}, {layers} layers, vocabulary {cfg['vocab']:,}, "
          f"batch {cfg['batch']} x {cfg['seq']} tokens), Adam; x = fraction of one process's bytes "
          f"(activations: one process's, the whole batch)\n")
    print("| setup | parameters | gradients | Adam state | activations | of which layer norms + dropouts | "
          "elements sent / step (ring) | step time |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    one_norms = 2 * whole["norms_dropouts"]
    for setup in TP_SETUPS:
        m = rows[setup][0]
        cells = [f"{mb(m[k])} MB ({m[k] / whole[k]:.2f}x)" for k in ("parameters", "gradients", "state")]
        cells.append(f"{mb(m['activations'])} MB ({m['activations'] / one_activations:.2f}x)")
        cells.append(f"{mb(m['norms_dropouts'])} MB ({m['norms_dropouts'] / one_norms:.2f}x)")
        cells.append(f"{m['elements']:,.0f}")
        cells.append(f"{m['seconds'] * 1e3:.0f} ms")
        print(f"| {setup} | " + " | ".join(cells) + " |")
    megatron = 4 * layers * bte
    print(f"\nSent per rank: a ring all-reduce sends 2(n-1)/n of its buffer, a reduce-scatter or all-gather (n-1)/n "
          f"(n = 2). Megatron's TP: 4 all-reduces of B·T·E per layer and step = {megatron:,} elements; needle's TP "
          f"adds the embedding's and the head's (2 B·T·E), the pre-norms' parameters and the loss's per-row "
          f"numbers. Bytes are exact (parameter and state sizes, the allocator's counts); times are one run's on a "
          f"shared machine. needle keeps every forward value until backward (eager mode, checkpointing off) "
          f"unless an op marks it not kept: the row-parallel partial sums, and under TP+SP the gathered sequence "
          f"(gathered again in backward), so TP+SP keeps the sequence shards. Layer norms + dropouts: "
          f"tensor_parallel.norm_and_dropout_bytes of a recorded step (dropout {cfg['dropout']}), against one "
          f"process's (DP's x 2 ranks).")


def part_comm(results):
    r = run_worker("comm", env=TCP)
    results["comm"] = r
    print("\ncommunication: bytes each rank sends, per buffer byte (loopback TCP, median of 5); ring bounds "
          "2(n-1)/n = 1.00, (n-1)/n = 0.50")
    print(f"  {'buffer':>8s}{'all-reduce':>12s}{'reduce-scatter':>16s}{'all-gather':>12s}{'all-reduce, TCP':>17s}")
    for row in r["buffers"]:
        print(f"  {row['MB']:>5d} MB{row['all_reduce']:12.3f}{row['reduce_scatter']:16.3f}{row['all_gather']:12.3f}"
              f"{row['all_reduce_seconds'] * 1e3:14.1f} ms")
    shm = run_worker("comm")
    results["comm_shared_memory"] = shm
    print("  the same all-reduces on MPICH's default (shared-memory) path: "
          + ", ".join(f"{row['MB']} MB {row['all_reduce_seconds'] * 1e3:.1f} ms "
                      f"({row['MB'] / 2**10 / row['all_reduce_seconds']:.2f} GB/s of buffer)"
                      for row in shm["buffers"]))
    print(f"  small collectives there (median of 2000; each sends its arrival notice first): an all-reduce of 16 "
          f"floats {shm['all_reduce_16_floats_seconds'] * 1e6:.1f} us, a barrier "
          f"{shm['barrier_seconds'] * 1e6:.1f} us")


def part_overlap(results):
    r = run_worker("overlap")
    results["overlap"] = r
    print(f"\noverlap: DataParallel on the benchmark LM, 8 sequences x 32 tokens per rank, fused head; backward "
          f"without DataParallel {r[0]['plain_backward_seconds']:.3f} s, a blocking all-reduce of all gradients "
          f"({mb(r[0]['bytes'])} MB) {r[0]['blocking_all_reduce_seconds'] * 1e3:.1f} ms")
    print(f"  {'bucket MB':>9s}{'buckets':>8s}{'started early':>14s}{'backward s':>11s}{'added ms':>9s}"
          f"{'copies ms':>10s}{'waited ms':>10s}{'comm hidden':>12s}{'buffer peak MB':>16s}")
    for row in r:
        added = row["backward_seconds"] - row["plain_backward_seconds"]
        hidden = 1 - row["wait_seconds"] / row["blocking_all_reduce_seconds"]
        print(f"  {row['bucket_mb']:>9g}{row['buckets']:>8d}{row['started_before_last_gradient']:>14d}"
              f"{row['backward_seconds']:>11.3f}{added * 1e3:>9.1f}{row['copy_seconds'] * 1e3:>10.1f}"
              f"{row['wait_seconds'] * 1e3:>10.1f}{hidden:>12.0%}{mb(row['buffer_peak_bytes']):>16s}")
    print("  added: backward's time with DataParallel minus without; copies: gradients into the buckets and back "
          "(3 host copies of every byte); waited: at backward's end, for the all-reduces and the slower rank; comm "
          "hidden: 1 - waited / blocking all-reduce (medians of 6 interleaved rounds)")


def gc_run(flags, n=1, threads=1):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.json")
        code, out = launch([os.path.join(ROOT, "gc.py"), "run", *flags, "--json", path], n=n, threads=threads)
        if code != 0 or not os.path.exists(path):
            raise SystemExit(f"bench_distributed: gc.py run {' '.join(flags)} failed (exit {code}):\n{out}")
        with open(path) as f:
            return json.load(f)


def ceiling(flags, batch_size):
    """Two plain gc.py runs of batch B/2 at the same time, no communication: what this machine gives two
    processes (its other jobs included); their tokens/s summed, their step times averaged."""
    flags = [f if flags[i - 1] != "--batch-size" else str(batch_size // 2) for i, f in enumerate(flags)]
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"lone{r}.json") for r in range(2)]
        env = {**comm.child_environment(), "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "gc.py"), "run", *flags, "--json", path],
                                  cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for path in paths]
        for proc in procs:
            if proc.wait(timeout=1200) != 0:
                raise SystemExit(f"bench_distributed: a lone gc.py run failed:\n{proc.stderr.read()}")
        records = []
        for path in paths:
            with open(path) as f:
                records.append(json.load(f))
    return {"tokens_per_second": sum(r["tokens_per_second"] for r in records),
            "step_time_seconds": statistics.mean(r["step_time_seconds"] for r in records),
            "activation_bytes": records[0]["activation_bytes"], "loss": None}


def part_scaling(results, args):
    base = ["--policy", "off", "--max-batches", str(args.steps), "--warmup", "2", "--no-progress", "--batch-size",
            str(args.batch_size)] + (["--data", args.data] if args.data else [])
    rows = []
    for label, flags, n, threads in (("1 process, 1 thread", [], 1, 1), ("1 process, 2 threads", [], 1, 2),
                                     ("dp, 2 ranks x 1 thread", ["--parallel", "dp"], 2, 1)):
        r = gc_run(base + flags, n=n, threads=threads)
        rows.append((label, r))
    rows.append(("2 lone processes x B/2", ceiling(base, args.batch_size)))
    results["scaling"] = [{"setup": label, "tokens_per_second": r["tokens_per_second"],
                           "step_time_seconds": r["step_time_seconds"], "activation_bytes": r["activation_bytes"],
                           "sync": r.get("sync"), "loss": r["loss"]} for label, r in rows]
    print(f"\nscaling: gc.py run, the benchmark LM, global batch {args.batch_size} x seq_len 32, {args.steps} steps "
          f"(median after 2 warm-up steps)")
    one = rows[0][1]["tokens_per_second"]
    for label, r in rows:
        sync = r.get("sync")
        extra = "" if not sync else (f"; backward waited {sync['wait_seconds'] * 1e3:.0f} ms for "
                                     f"{sync['buckets']} all-reduce buckets")
        print(f"  {label:24s}{r['tokens_per_second']:9.0f} tokens/s  {r['tokens_per_second'] / one:5.2f}x  T_step "
              f"{r['step_time_seconds']:.3f} s  M_act {mb(r['activation_bytes'])} MB (rank 0){extra}")
    print("  (2 lone processes: two plain runs of B/2 at once, no communication, throughputs summed: the most two "
          "processes get from this machine as it is loaded)")
    pipe_rows = []
    for m in args.micro_batches:
        r = gc_run(["--policy", "off", "--max-batches", str(args.steps), "--warmup", "2", "--no-progress",
                    "--batch-size", str(args.batch_size // m), "--accumulation-steps", str(m), "--parallel",
                    "pipeline"] + (["--data", args.data] if args.data else []), n=2)
        pipe_rows.append({"micro_batches": m, "bubble": r["pipeline"]["bubble_median"],
                          "theory": r["pipeline"]["theory"], "tokens_per_second": r["tokens_per_second"],
                          "compute_seconds_per_rank": r["pipeline"]["compute_seconds_per_rank"],
                          "activation_bytes": [x["activation_bytes"] for x in r["per_rank"]]})
    results["pipeline"] = pipe_rows
    print(f"  pipeline, 2 stages (embedding + 2 layers | 2 layers + head), global batch {args.batch_size}; "
          f"'unequal stages': GPipe's bubble for the stages' measured costs")
    for row in pipe_rows:
        c, m = row["compute_seconds_per_rank"], row["micro_batches"]
        row["unequal_stages"] = unequal_bubble([t / m for t in c], m)
        print(f"    m = {m:2d}: bubble {row['bubble']:6.1%} measured, {row['theory']:6.1%} (d - 1)/(m + d - 1), "
              f"{row['unequal_stages']:6.1%} unequal stages; {row['tokens_per_second']:5.0f} tokens/s; compute per "
              f"step {c[0]:.3f} s | {c[1]:.3f} s; M_act {mb(row['activation_bytes'][0])} | "
              f"{mb(row['activation_bytes'][1])} MB")


def unequal_bubble(per_micro_batch, m):
    """GPipe's idle fraction, mean over stages, when stage s takes t_s per micro-batch (forward + backward): a step
    lasts (m - 1) max t + sum t (the slowest stage paces the steady state; every stage is crossed once more),
    and stage s computes m t_s of it."""
    step = (m - 1) * max(per_micro_batch) + sum(per_micro_batch)
    return statistics.mean(1 - m * t / step for t in per_micro_batch)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS)
    parser.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, default=32, help="scaling: the global batch")
    parser.add_argument("--steps", type=int, default=8, help="scaling: steps per gc.py run")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8], help="scaling: pipeline m")
    parser.add_argument("--data", default=None, help="scaling: gc.py's --data (default: gc.py's)")
    parser.add_argument("--json", default=None, help="also write every figure to this file")
    args = parser.parse_args()
    if args.worker:
        WORKERS[args.worker]()
        return
    if not comm.mpiexec_path():
        raise SystemExit('bench_distributed: no mpiexec (pip install -e ".[distributed]")')
    results = {}
    print(f"needle.distributed, 2 ranks on {os.cpu_count()} cores, 1 OpenMP thread per rank "
          f"({time.strftime('%Y-%m-%d %H:%M')})")
    for part in args.parts:
        if part == "scaling":
            part_scaling(results, args)
        else:
            globals()[f"part_{part}"](results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
