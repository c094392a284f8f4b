"""gc.py — how much memory gradient checkpointing saves on a PTB Transformer language model, and what it costs.

    python gc.py                          # gc off vs on, side by side (embedded default, about a minute on a CPU)
    python gc.py --policy sqrt --batch_size 128 --hidden_size 256 --num_layers 4
    python gc.py sweep --over batch_size --values 32 64 128 256     # fresh process per run, JSON + PNG plots
    python gc.py max-batch --memory_limit_mb 600                     # largest batch under a memory cap

What is measured, per training step (forward + backward + optimizer), from the device allocator's exact byte
counts (needle.backend_ndarray.memory_stats):
  M_act   activation bytes held at the start of backward: allocator current bytes minus the baseline
          (parameters, optimizer state and the batch);
  M_peak  the allocator's peak over forward + backward (reset at the step's start) minus the same baseline:
          what Budget(b) bounds (the optimizer's update follows; the JSON's step_peak_bytes includes it);
  M_floor the least M_act checkpointing could reach on this graph: what no policy can drop (leaves such as
          masks and constants, and the boundaries of the annotated regions);
  T_step  median step time; overhead = T_on / T_off - 1.
Both runs release every activation after its last backward use, so the difference is checkpointing alone.
Next to the allocator's figures, what the operating system sees:
  RSS_peak the process's peak resident memory during the step minus its resident memory at the step's start
          (JSON rss_peak_bytes; rss_start_bytes per step; CPU devices, null on CUDA).  Exact: the kernel's
          high-water mark (VmHWM), reset at the step's start through /proc/self/clear_refs; where that cannot be
          reset, the largest VmRSS of samples at the step's start, after forward, after backward and at its end
          (a lower bound).  It counts every page the process touches, and memory that a free kept resident (in
          a heap, a cache) and the step reuses shows as no growth: needle's C++ allocator gives buffers of 1 MiB
          and more back to the OS, caching at most 64 MiB, so on cpu() RSS_peak follows M_peak.
  GPUtil  on CUDA, the GPU memory the driver reports in use (gpu_memory_mb; needs the GPUtil package, else
          null): the caching allocator's reserved blocks plus the CUDA context, not a per-step peak.
JSON files hold null, never NaN or Infinity, where a value is not finite.
"""
import argparse
import gc as python_gc  # the standard module (built in, so this file's name does not shadow it)
import json
import math
import os
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "apps"))

import needle as ndl  # noqa: E402
from needle import autograd, checkpoint, nn  # noqa: E402
from needle import backend_ndarray as nd  # noqa: E402
from needle.data import Corpus, batchify, get_batch  # noqa: E402

from models import LanguageModel  # noqa: E402

PTB_VOCAB = 10000
OOM_EXIT = 3  # exit status of a run that hit --memory_limit_mb (max-batch reads it)


# ----- data ---------------------------------------------------------------------------------------------------
def synthetic_corpus(num_tokens=200_000, vocab=PTB_VOCAB, seed=0):
    """Zipf-distributed word ids over a PTB-sized vocabulary (deterministic), standing in for PTB text."""
    rs = np.random.RandomState(seed)
    ranks = np.arange(1, vocab + 1)
    p = 1.0 / ranks
    return rs.choice(vocab, size=num_tokens, p=p / p.sum()).astype(np.float32), vocab


def has_ptb(path):
    return os.path.exists(os.path.join(path, "train.txt"))


def load_data(path):
    """(train token ids, vocabulary size) from a PTB folder, or the synthetic corpus if it is absent."""
    if has_ptb(path):
        corpus = Corpus(path)
        return np.array(corpus.train, dtype=np.float32), len(corpus.dictionary)
    return synthetic_corpus()


def pick_device(name):
    if name == "cuda" or (name is None and nd.cuda().enabled()):
        if not nd.cuda().enabled():
            raise SystemExit("gc.py: --device cuda, but no GPU / CUDA build is available")
        return nd.cuda()
    if name == "cpu_numpy":
        return nd.cpu_numpy()
    if not nd.cpu().enabled():
        raise SystemExit("gc.py: the C++ backend is not built; run `make` first")
    return nd.cpu()


def gpu_memory_mb():
    """The GPU's used memory as the driver reports it (GPUtil), as the earlier project measured; None on CPU."""
    try:
        import GPUtil
    except ImportError:
        return None
    gpus = GPUtil.getGPUs()
    return gpus[0].memoryUsed if gpus else None


def _proc_status():
    """{'VmRSS': bytes, 'VmHWM': bytes} of this process from /proc/self/status; {} where there is none."""
    try:
        with open("/proc/self/status") as f:
            return {line.split(":")[0]: int(line.split()[1]) * 1024
                    for line in f if line.startswith(("VmRSS:", "VmHWM:"))}
    except OSError:
        return {}


class PeakRSS:
    """The process's peak resident memory over a step minus its resident memory at the step's start (bytes).

    Exact where the kernel's high-water mark can be reset (Linux: writing 5 to /proc/self/clear_refs resets
    VmHWM to VmRSS, about 50 us with the read); otherwise the largest VmRSS of the samples taken with sample(),
    a lower bound.  growth() is None where /proc/self/status does not exist (not Linux)."""

    def __init__(self):
        self.start = _proc_status().get("VmRSS")
        self.peak, self.exact = self.start, False
        if self.start is not None:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # VmHWM := VmRSS
                self.exact = True
            except OSError:
                pass

    def sample(self):
        if self.start is not None and not self.exact:
            self.peak = max(self.peak, _proc_status().get("VmRSS", 0))

    def growth(self):
        if self.start is None:
            return None
        self.sample()
        peak = _proc_status().get("VmHWM", self.peak) if self.exact else self.peak
        return max(0, peak - self.start)


# ----- one run ------------------------------------------------------------------------------------------------
def make_policy(args):
    if args.policy == "budget":
        if args.budget_mb is None:
            raise SystemExit("gc.py: --policy budget needs --budget_mb")
        return checkpoint.Budget(int(args.budget_mb * 2**20))
    return None if args.policy in (None, "all") else args.policy


def run(args, use_gc, out_dir=None, quiet=False, json_path=None):
    """Train for a few batches with checkpointing off or on; return the measured record (also as JSON: to
    json_path if given, else to a new file in out_dir if given)."""
    python_gc.collect()  # a previous run's model and optimizer must not count in this run's memory
    device = pick_device(args.device)
    data, vocab = load_data(args.data)
    np.random.seed(args.seed)
    model = LanguageModel(args.embedding_size, vocab, args.hidden_size, num_layers=args.num_layers,
                          seq_model="transformer", seq_len=args.seq_len, device=device, num_head=args.num_head,
                          dim_head=args.embedding_size // args.num_head, dropout=args.dropout)
    policy = make_policy(args) if use_gc else None
    if use_gc:
        model.enable_gc(segment_len=args.segment_len, policy=policy)
    model.train()
    params = model.parameters()
    opt = ndl.optim.Adam(params, lr=args.lr)
    loss_fn = nn.SoftmaxLoss()
    batches = batchify(data, args.batch_size * args.accumulation_steps, device=device, dtype="float32")
    if args.memory_limit_mb:
        nd.set_memory_limit(int(args.memory_limit_mb * 2**20), device)
    record = {
        "time": None, "batch_size": args.batch_size, "peak memory": None, "use_gc": bool(use_gc),
        "segment_len": args.segment_len, "policy": str(args.policy or "all") if use_gc else "off",
        "device": str(device), "lazy": args.lazy, "seq_len": args.seq_len, "embedding_size": args.embedding_size,
        "hidden_size": args.hidden_size, "num_layers": args.num_layers, "num_head": args.num_head,
        "accumulation_steps": args.accumulation_steps, "budget_mb": args.budget_mb, "steps": [],
    }
    path = json_path
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    elif out_dir:
        os.makedirs(out_dir, exist_ok=True)
        name = f"{record['policy']}_b{args.batch_size}_h{args.hidden_size}_l{args.num_layers}_s{args.segment_len}"
        path = os.path.join(out_dir, f"{name}_{os.getpid()}.json")
    nbatch = min(args.max_batches, (batches.shape[0] - 1) // args.seq_len)
    if nbatch < 1:
        raise SystemExit(f"gc.py: corpus too small for batch {args.batch_size} x seq_len {args.seq_len}")
    for i in range(nbatch * args.epochs):
        start = (i % nbatch) * args.seq_len
        try:
            step, loss = train_step(model, loss_fn, opt, batches, start, args, device, params)
        except ValueError as err:
            if isinstance(policy, checkpoint.Budget) and "infeasible" in str(err):
                print(f"gc.py: {err}", file=sys.stderr)  # planned before anything was computed
                raise SystemExit(2) from None
            raise
        if isinstance(policy, checkpoint.Budget) and "predicted_peak_activation_bytes" not in record:
            # Budget planned during this first step (lazy: before computing it; eager: at backward, after a
            # forward that kept everything)
            record["predicted_peak_activation_bytes"] = policy.predicted_peak
            record["budget_minimum_bytes"] = policy.minimum_peak
            step["traced"] = not args.lazy
        del loss
        record["steps"].append(step)
        _summarize(record, args.warmup)
        if path:
            _write_json(path, record)  # after every step: an interrupted run keeps what it measured
        if not quiet:
            rss = "" if step["rss_peak_bytes"] is None else f"  RSS_peak {step['rss_peak_bytes'] / 2**20:8.1f} MB"
            print(f"  step {i:3d}  loss {step['loss']:.3f}  M_act {step['activation_bytes'] / 2**20:8.1f} MB  "
                  f"M_peak {step['peak_activation_bytes'] / 2**20:8.1f} MB{rss}  {step['time']:.3f} s", flush=True)
    if args.memory_limit_mb:
        nd.set_memory_limit(0, device)
    record["json"] = path
    return record


def train_step(model, loss_fn, opt, batches, start, args, device, params):
    """One optimizer step (of `accumulation_steps` micro-batches), with its memory and time measured."""
    k = args.accumulation_steps
    opt.reset_grad()
    X_all, y_all = get_batch(batches, start, args.seq_len, device=device, dtype="float32")
    if k > 1:  # micro-batch j is columns [j*b, (j+1)*b) of the big batch
        X_np, b = X_all.numpy(), args.batch_size
        y_np = y_all.numpy().reshape(X_np.shape)
        micro = [(ndl.Tensor(X_np[:, j * b:(j + 1) * b], device=device, requires_grad=False),
                  ndl.Tensor(y_np[:, j * b:(j + 1) * b].reshape(-1), device=device, requires_grad=False))
                 for j in range(k)]
    else:
        micro = [(X_all, y_all)]
    nd.reset_peak_memory_stats(device)
    baseline = nd.memory_stats(device)["current_bytes"]
    rss = None if device.name == "cuda" else PeakRSS()  # host RSS says nothing of GPU memory: GPUtil there
    t0 = time.perf_counter()
    act, floor, losses, recomputed, accumulated = 0, 0, [], 0, None
    for j, (X, y) in enumerate(micro):
        with autograd.lazy_mode(args.lazy):
            out, _ = model(X)
            loss = loss_fn(out, y) if k == 1 else loss_fn(out, y) / k
            losses.append(float(loss.numpy()) * k)
            held = nd.memory_stats(device)["current_bytes"] - baseline
            if j == 0:
                act = held
                t_floor = time.perf_counter()  # bookkeeping of the measurement, left out of T_step
                floor = sum(b for _, reason, b in checkpoint.saved_residuals(loss, exclude=params + [X, y])
                            if reason in ("leaf", "boundary"))
                if rss:
                    rss.sample()
                t0 += time.perf_counter() - t_floor
            loss.backward()
        recomputed += checkpoint.last_backward_stats()["recomputed_nodes"]
        if rss:
            rss.sample()
        if k > 1:
            grads = [p.grad.realize_cached_data() for p in params]
            accumulated = grads if accumulated is None else [a + g for a, g in zip(accumulated, grads)]
            for p in params:
                p.grad = None
        del out
    del micro, X, y
    if k > 1:
        for p, g in zip(params, accumulated):
            p.grad = ndl.Tensor(g, device=device, requires_grad=False)
    # M_peak is forward + backward (what Budget bounds); the optimizer's own temporaries come after it.
    forward_backward_peak = nd.memory_stats(device)["peak_bytes"] - baseline
    opt.step()
    elapsed = time.perf_counter() - t0
    stats = nd.memory_stats(device)
    rss_peak = rss.growth() if rss else None
    return {
        "loss": float(np.mean(losses)), "time": elapsed, "activation_bytes": int(act), "floor_bytes": int(floor),
        "peak_bytes": int(stats["peak_bytes"]), "peak_activation_bytes": int(forward_backward_peak),
        "step_peak_bytes": int(stats["peak_bytes"] - baseline),
        "baseline_bytes": int(baseline), "recomputed_nodes": int(recomputed), "gpu_memory_mb": gpu_memory_mb(),
        "rss_peak_bytes": rss_peak, "rss_start_bytes": rss.start if rss else None,
    }, loss


def _summarize(record, warmup):
    steps = [s for s in record["steps"] if not s.get("traced")]
    steps = steps[warmup:] or steps or record["steps"]
    med = lambda key: statistics.median(s[key] for s in steps)  # noqa: E731
    record.update({
        "time": med("time"), "time_per_batch_median": med("time"), "peak memory": max(s["peak_bytes"] for s in steps),
        "peak_bytes": max(s["peak_bytes"] for s in steps),
        "peak_activation_bytes": max(s["peak_activation_bytes"] for s in steps),
        "activation_bytes": max(s["activation_bytes"] for s in steps),
        "floor_bytes": min(s["floor_bytes"] for s in steps), "loss": record["steps"][-1]["loss"],
        "recomputed_nodes": record["steps"][-1]["recomputed_nodes"],
        "rss_peak_bytes": max((s["rss_peak_bytes"] for s in steps if s.get("rss_peak_bytes") is not None),
                              default=None),
    })


def _json_safe(x):
    """x with every float that is not finite (NaN, +-Infinity) replaced by None, recursively; NumPy scalars as
    Python numbers.  JSON has no NaN: json.dump would write a bare NaN that strict parsers reject."""
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _dump_json(obj, f):
    json.dump(_json_safe(obj), f, indent=1, allow_nan=False)


def _write_json(path, record):
    tmp = f"{path}.{os.getpid()}.tmp"  # whole or not at all, even with another process writing the same name
    with open(tmp, "w") as f:
        _dump_json(record, f)
    os.replace(tmp, path)


# ----- reporting ----------------------------------------------------------------------------------------------
def mb(x):
    return f"{x / 2**20:9.1f}"


def print_table(off, on):
    rows = [("M_act (MB)", "activation_bytes"), ("M_peak (MB)", "peak_activation_bytes"),
            ("peak bytes (MB)", "peak_bytes")]
    print(f"\n{'':18s}{'gc off':>12s}{'gc on':>12s}{'change':>10s}")
    for label, key in rows:
        a, b = off[key], on[key]
        change = f"{(b / a - 1) * 100:+.1f}%" if a else ""
        print(f"{label:18s}{mb(a):>12s}{mb(b):>12s}{change:>10s}")
    print(f"{'M_floor (MB)':18s}{'':>12s}{mb(on['floor_bytes']):>12s}   (what no policy can drop)")
    print(f"{'T_step (s)':18s}{off['time']:12.3f}{on['time']:12.3f}{(on['time'] / off['time'] - 1) * 100:+9.1f}%")
    print(f"{'loss (last step)':18s}{off['loss']:12.4f}{on['loss']:12.4f}")
    print(f"{'recomputed nodes':18s}{off['recomputed_nodes']:12d}{on['recomputed_nodes']:12d}")
    if off.get("rss_peak_bytes") is not None and on.get("rss_peak_bytes") is not None:
        a, b = off["rss_peak_bytes"], on["rss_peak_bytes"]
        change = f"{(b / a - 1) * 100:+.1f}%" if a else ""
        print(f"{'RSS_peak (MB)':18s}{mb(a):>12s}{mb(b):>12s}{change:>10s}   (process peak RSS growth per step)")
    if off.get("steps") and off["steps"][0].get("gpu_memory_mb") is not None:
        used = [r["steps"][-1]["gpu_memory_mb"] for r in (off, on)]
        print(f"{'GPUtil used (MB)':18s}{used[0]:12.0f}{used[1]:12.0f}")
    print(f"\nactivation memory at backward start: {(1 - on['activation_bytes'] / off['activation_bytes']) * 100:.1f}% "
          f"lower; step peak: {(1 - on['peak_activation_bytes'] / off['peak_activation_bytes']) * 100:.1f}% lower; "
          f"time overhead {(on['time'] / off['time'] - 1) * 100:+.1f}%")
    if off.get("rss_peak_bytes") and on.get("rss_peak_bytes") is not None:
        print(f"process peak RSS growth per step (what the OS sees): "
              f"{(1 - on['rss_peak_bytes'] / off['rss_peak_bytes']) * 100:.1f}% lower")


def main_run(args):
    print(f"gc.py: Transformer LM, batch {args.batch_size} x seq_len {args.seq_len}, embedding {args.embedding_size}, "
          f"hidden {args.hidden_size}, {args.num_layers} layers, {args.num_head} heads, "
          f"device {pick_device(args.device)}, "
          f"lazy={args.lazy}, policy={args.policy or 'all'}, segment_len={args.segment_len}")
    if not has_ptb(args.data):
        print(f"gc.py: {args.data}/train.txt not found; using a synthetic Zipf corpus with a PTB-sized vocabulary")
    which = [False, True] if args.use_gc is None else [bool(args.use_gc)]
    if args.json and len(which) != 1:
        raise SystemExit("gc.py: --json names one run's file; give --use_gc 0 or 1 with it")
    results = {}
    for use_gc in which:
        print(f"{'gc on' if use_gc else 'gc off'}:")
        try:
            results[use_gc] = run(args, use_gc, out_dir=args.out, json_path=args.json)
        except MemoryError as err:
            print(f"gc.py: out of memory under --memory_limit_mb {args.memory_limit_mb}: {err}")
            sys.exit(OOM_EXIT)
    if len(results) == 2:
        print_table(results[False], results[True])
    for r in results.values():
        if r["json"]:
            print(f"wrote {r['json']}")


# ----- sweep and max-batch: each configuration in a fresh process ---------------------------------------------
def _child(args, overrides, use_gc, json_path, timeout=1800):
    """Run one configuration in a fresh process that writes its record to exactly json_path (chosen by the
    parent, so that two sweeps sharing an --out folder never read each other's files)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--use_gc", str(int(use_gc)),
           "--json", os.path.abspath(json_path)]
    for key, value in {**vars(args), **overrides}.items():
        if key in ("command", "over", "values", "repeats", "use_gc", "out", "json", "policies", "lazy") \
                or value is None:
            continue
        cmd += [f"--{key}", str(value)]
    cmd.append("--lazy" if overrides.get("lazy", args.lazy) else "--no-lazy")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def _read_json(path):
    with open(path) as f:
        return json.load(f)


def _invocation_id():
    """Names this sweep's (or max-batch search's) files apart from any other run's in the same folder."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{os.urandom(3).hex()}"


def main_sweep(args):
    out_dir = args.out or os.path.join("results", f"sweep_{args.over}")
    os.makedirs(out_dir, exist_ok=True)
    policies = args.policies or (["off", "all", "sqrt", "selective"] if args.over == "num_layers" else ["off", "all"])
    sweep_id = _invocation_id()
    records = []
    for rep in range(args.repeats):
        for value in args.values:
            for policy in policies:
                path = os.path.join(out_dir, f"sweep-{sweep_id}_{args.over}{value}_{policy}_rep{rep}.json")
                overrides = {args.over: value, "policy": None if policy in ("off", "all") else policy}
                code, log = _child(args, overrides, policy != "off", path)
                if code != 0 or not os.path.exists(path):
                    print(f"  {args.over}={value} {policy}: failed (exit {code})\n{log[-2000:]}")
                    continue
                r = _read_json(path)  # exactly the file this child was told to write
                r["repeat"], r["label"], r["sweep_id"], r["json"] = rep, policy, sweep_id, path
                records.append(r)
                print(f"  rep {rep} {args.over}={value:>6} {policy:>9s}: M_act {mb(r['activation_bytes'])} MB  "
                      f"M_peak {mb(r['peak_activation_bytes'])} MB  T {r['time']:.3f} s", flush=True)
    summary = os.path.join(out_dir, f"sweep-{sweep_id}.json")
    for name in (summary, os.path.join(out_dir, "sweep.json")):  # this sweep's; sweep.json: the latest to finish
        _write_json(name, records)
    png = plot_sweep(records, args.over, out_dir)
    print(f"wrote {summary} (also as {os.path.join(out_dir, 'sweep.json')}) and {png}")


def plot_sweep(records, over, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label in sorted({r["label"] for r in records}):
        xs = sorted({r[over] for r in records if r["label"] == label})
        for ax, key, title in ((axes[0], "peak_activation_bytes", "M_peak (MB)"), (axes[1], "time", "T_step (s)")):
            ys = [statistics.median(r[key] for r in records if r["label"] == label and r[over] == x) for x in xs]
            ys = [y / 2**20 for y in ys] if key != "time" else ys
            ax.plot(xs, ys, marker="o", label=label)
            ax.set_xlabel(over)
            ax.set_ylabel(title)
    axes[0].legend()
    fig.suptitle(f"needle gradient checkpointing: Transformer LM, sweep over {over}")
    fig.tight_layout()
    png = os.path.join(out_dir, f"sweep_{over}.png")
    fig.savefig(png, dpi=100)
    return png


def fits(args, batch, policy, out_dir, search_id):
    overrides = {"batch_size": batch, "max_batches": 2, "policy": None if policy in ("off", "all") else policy}
    code, log = _child(args, overrides, policy != "off",
                       os.path.join(out_dir, f"max-batch-{search_id}_{policy}_b{batch}.json"))
    if code not in (0, OOM_EXIT):
        raise SystemExit(f"gc.py max-batch: run failed (exit {code}):\n{log[-2000:]}")
    return code == 0


def main_max_batch(args):
    if not args.memory_limit_mb:
        raise SystemExit("gc.py max-batch needs --memory_limit_mb")
    out_dir = args.out or os.path.join("results", "max_batch")
    os.makedirs(out_dir, exist_ok=True)
    best, search_id = {}, _invocation_id()
    for policy in args.policies or ["off", "all", "sqrt", "selective"]:
        lo, hi = 0, 8
        while fits(args, hi, policy, out_dir, search_id):  # double until a batch does not fit...
            lo, hi = hi, hi * 2
        while hi - lo > max(1, lo // 16):  # ...then bisect to within ~6%
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(args, mid, policy, out_dir, search_id) else (lo, mid)
        best[policy] = lo
        print(f"  {policy:>9s}: largest batch under {args.memory_limit_mb} MB = {lo}", flush=True)
    if best.get("off"):
        for policy, b in best.items():
            print(f"  {policy:>9s}: {b / best['off']:.2f}x the batch of gc off")
    _write_json(os.path.join(out_dir, "max_batch.json"), {"memory_limit_mb": args.memory_limit_mb,
                                                            "largest_batch": best})


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("command", nargs="?", default="run", choices=["run", "sweep", "max-batch"])
    p.add_argument("--data", default=os.path.join("data", "ptb"), help="PTB folder (train.txt); synthetic if absent")
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--seq_len", type=int, default=20)
    p.add_argument("--embedding_size", type=int, default=64)
    p.add_argument("--hidden_size", type=int, default=64)
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--num_head", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--segment_len", type=int, default=None)
    p.add_argument("--use_gc", type=int, choices=[0, 1], default=None, help="run only gc off (0) or on (1)")
    p.add_argument("--policy", default=None, choices=[None, "all", "sqrt", "selective", "budget"])
    p.add_argument("--budget_mb", type=float, default=None)
    p.add_argument("--lazy", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--device", default=None, choices=[None, "cpu", "cuda", "cpu_numpy"])
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max_batches", type=int, default=30)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the time median")
    p.add_argument("--accumulation_steps", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--memory_limit_mb", type=float, default=None)
    p.add_argument("--out", default=None, help="folder for one JSON per run")
    p.add_argument("--json", default=None, help="write the (one) run's JSON to exactly this file (sweep and "
                   "max-batch give each child its own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--over", default="batch_size", choices=["batch_size", "hidden_size", "segment_len", "num_layers"])
    p.add_argument("--values", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--policies", nargs="+", default=None)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.command == "sweep":
        main_sweep(args)
    elif args.command == "max-batch":
        main_max_batch(args)
    else:
        main_run(args)


if __name__ == "__main__":
    main()
