"""gc.py — how much memory gradient checkpointing saves on a PTB Transformer language model, and what it costs.

    python gc.py                          # gc off vs on ("all"), side by side: the demo model, ~1 minute on a CPU
    python gc.py run --policy sqrt --batch-size 128 --hidden-size 512
    python gc.py sweep --over batch-size --values 16 32 64     # a fresh process per run; JSON as it goes, PNGs
    python gc.py max-batch --memory-limit-mb 400                 # the largest batch under a memory cap, per policy
    python gc.py ablate --rows baseline all fused combined       # each technique, the same model and steps: a table
    mpiexec -n 2 python gc.py run --parallel dp                  # data parallel (also zero1, zero2, pipeline)
    python gc.py plot results/sweep_batch_size                   # the plots of whatever gc.py JSON a folder holds

`python gc.py CMD --help` lists CMD's flags with their defaults; every flag may be spelled with hyphens
(--batch-size) or, as in the earlier project, underscores (--batch_size).  A bad input is one line on stderr
and exit status 2, before any work.  MEASURES below defines what is measured (also in every --help).
"""
import argparse
import contextlib
import difflib
import gc as python_gc  # the standard module (built in, so this file's name does not shadow it)
import glob
import json
import math
import os
import statistics
import subprocess
import sys
import textwrap
import time

import numpy as np
from tqdm.auto import tqdm

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "apps"))

import needle as ndl  # noqa: E402
from needle import autograd, checkpoint, nn  # noqa: E402
from needle import distributed as dist  # noqa: E402
from needle import backend_ndarray as nd  # noqa: E402
from needle.data import Corpus, batchify, get_batch  # noqa: E402
from needle.ops.ops_fused import chunk_rows  # noqa: E402

from models import LanguageModel  # noqa: E402

MEASURES = """\
What is measured, per training step (forward + backward + Adam), from the allocator's exact byte counts
(needle.backend_ndarray.memory_stats); [JSON key]; memory in bytes, times in seconds:
  M_act    activation bytes held at the start of backward: allocator current bytes minus the
           baseline (parameters, optimizer state and the batch)  [activation_bytes]
  M_peak   the allocator's peak over forward + backward (reset at the step's start) minus the same
           baseline: what Budget(b) bounds  [peak_activation_bytes; step_peak_bytes adds Adam's update]
  M_floor  the least M_act checkpointing could reach on this graph: what no policy can drop (leaves
           such as masks and constants, and the boundaries of the annotated regions)  [floor_bytes]
  T_step   median step time over the steps after --warmup; overhead = T_on / T_off - 1; flagged
           unreliable when fewer than 3 steps were timed  [step_time_seconds, alias time]
  RSS_peak what the OS sees: the process's peak resident memory during the step minus its resident
           memory at the step's start (the kernel's high-water mark VmHWM, reset through
           /proc/self/clear_refs; where it cannot be reset, a lower bound from samples); CPU only
           [rss_peak_bytes]
Both runs release every activation after its last backward use: the difference is checkpointing alone."""

PTB_VOCAB = 10000
POLICIES = ["off", "all", "sqrt", "selective", "budget"]
HEADS = ["full", "fused"]  # the LM head + loss: the course's SoftmaxLoss(model(x)), or model.loss(x, y) (fused)
SUBCOMMANDS = ["run", "sweep", "max-batch", "ablate", "plot"]
OOM_EXIT = 3  # exit status of a run that hit --memory-limit-mb (max-batch reads it)
BAD_INPUT_EXIT = 2
DEFAULT_DATA = [os.path.join(ROOT, "data", "ptb"), os.path.join(ROOT, "..", "shared", "data", "ptb")]
SYNTHETIC = "synthetic"
# The earlier project's keys, kept next to the canonical ones (README: "gc.py — the experiment").
ALIASES = {"time": "step_time_seconds", "time_per_batch_median": "step_time_seconds", "peak memory": "peak_bytes",
           "use_gc": "policy != 'off'"}


def fail(message):
    """A bad input: one line on stderr, exit status 2, no traceback."""
    print(f"gc.py: {message}", file=sys.stderr)
    sys.exit(BAD_INPUT_EXIT)


# ----- data ---------------------------------------------------------------------------------------------------
def synthetic_corpus(num_tokens=200_000, vocab=PTB_VOCAB, seed=0):
    """Zipf-distributed word ids over a PTB-sized vocabulary (deterministic), standing in for PTB text."""
    rs = np.random.RandomState(seed)
    ranks = np.arange(1, vocab + 1)
    p = 1.0 / ranks
    return rs.choice(vocab, size=num_tokens, p=p / p.sum()).astype(np.float32), vocab


def has_ptb(path):
    return all(os.path.isfile(os.path.join(path, name)) for name in ("train.txt", "test.txt"))


def resolve_data(data):
    """The data source a run uses: a PTB folder, or SYNTHETIC.  An explicit folder must hold PTB; only the
    default (data/ptb, then ../shared/data/ptb next to this file) falls back to the synthetic corpus."""
    if data is None:
        return next((os.path.normpath(p) for p in DEFAULT_DATA if has_ptb(p)), SYNTHETIC)
    if data == SYNTHETIC or has_ptb(data):
        return data
    missing = "does not exist" if not os.path.exists(data) else "has no train.txt and test.txt"
    fail(f"--data {data} {missing} (fetch PTB with: python -m needle.data.download ptb --dir data; "
         f"or leave --data out, or give --data {SYNTHETIC}, for the synthetic corpus)")


def load_data(source):
    """(train token ids, vocabulary size) of a PTB folder, or of the synthetic corpus."""
    if source == SYNTHETIC:
        return synthetic_corpus()
    corpus = Corpus(source)
    return np.array(corpus.train, dtype=np.float32), len(corpus.dictionary)


def pick_device(name):
    if name == "cuda" or (name is None and nd.cuda().enabled()):
        if not nd.cuda().enabled():
            fail("--device cuda, but no GPU / CUDA build is available")
        return nd.cuda()
    if name == "cpu_numpy":
        return nd.cpu_numpy()
    if not nd.cpu().enabled():
        fail("the C++ backend is not built; run `make` first (or give --device cpu_numpy)")
    # RSS_peak is part of the experiment: a 64 MiB cache of freed buffers (the allocator's before its default grew to
    # the high-water mark, and every figure of this script's so far) keeps resident memory following the
    # allocator's bytes; the default would hold a step's freed buffers for the next one.
    nd.set_cache_limit(64 << 20, nd.cpu())
    return nd.cpu()


def gpu_memory_bytes():
    """The GPU's used memory as the driver reports it (GPUtil), as the earlier project measured; None on CPU."""
    try:
        import GPUtil
    except ImportError:
        return None
    gpus = GPUtil.getGPUs()
    return int(gpus[0].memoryUsed * 2**20) if gpus else None


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


# ----- what a JSON says about where it came from --------------------------------------------------------------
_COMMIT = []


def needle_commit():
    """`git rev-parse HEAD` of this checkout, or None where that is unavailable (no git, not a repository)."""
    if not _COMMIT:
        try:
            proc = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                                  timeout=10)
            _COMMIT.append(proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None)
        except (OSError, subprocess.SubprocessError):
            _COMMIT.append(None)
    return _COMMIT[0]


def threads():
    """The CPU backend's thread count: OpenMP's, i.e. OMP_NUM_THREADS, else the cores this process may use."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def config_of(args, source, vocab, device):
    """The whole configuration of a run, as the JSON records it (memory in bytes, like every figure)."""
    mb_to_bytes = lambda mb: None if mb is None else int(mb * 2**20)  # noqa: E731
    batch = getattr(args, "batch_size", None)  # max-batch searches it
    return {
        "data": source, "vocab_size": int(vocab), "batch_size": batch, "accumulation_steps": args.accumulation_steps,
        "effective_batch_size": None if batch is None else batch * args.accumulation_steps, "seq_len": args.seq_len,
        "embedding_size": args.embedding_size, "hidden_size": args.hidden_size, "num_layers": args.num_layers,
        "num_head": args.num_head, "dropout": args.dropout, "head_init_scale": args.head_init_scale,
        "head": getattr(args, "head", None), "precision": getattr(args, "precision", "fp32"),
        "stochastic_rounding": bool(getattr(args, "stochastic_rounding", False)),
        "init_scale": getattr(args, "init_scale", None) if getattr(args, "precision", "fp32") == "mixed-fp16" else None,
        "segment_len": args.segment_len, "budget_bytes": mb_to_bytes(args.budget_mb), "lazy": args.lazy,
        "device": str(device), "threads": threads(), "epochs": args.epochs, "max_batches": args.max_batches,
        "warmup": args.warmup, "lr": args.lr, "optimizer": getattr(args, "optimizer", "adam"),
        "offload_state": bool(getattr(args, "offload_state", False)), "seed": args.seed,
        "parallel": getattr(args, "parallel", None),
        "bucket_bytes": mb_to_bytes(getattr(args, "bucket_mb", None)) if getattr(args, "parallel", None) else None,
        "world_size": dist.world_size() if getattr(args, "parallel", None) else 1,
        "memory_limit_bytes": mb_to_bytes(args.memory_limit_mb), "needle_commit": needle_commit(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": [os.path.basename(__file__)] + sys.argv[1:],
    }


# ----- one run ------------------------------------------------------------------------------------------------
def make_policy(args):
    if args.policy == "budget":
        return checkpoint.Budget(int(args.budget_mb * 2**20))
    return None if args.policy in (None, "all") else args.policy


def build_model(args, vocab, device, policy):
    """The course's LanguageModel (a Transformer), seeded; checkpointing on when policy is not "off"."""
    np.random.seed(args.seed)
    model = LanguageModel(args.embedding_size, vocab, args.hidden_size, num_layers=args.num_layers,
                          seq_model="transformer", seq_len=args.seq_len, device=device, num_head=args.num_head,
                          dim_head=args.embedding_size // args.num_head, dropout=args.dropout)
    if args.head_init_scale != 1:
        # The course's init gives the output layer logits with a std of several units (its input, the residual
        # stream, is not normalized), so the loss starts far above ln(vocab), a uniform guess.  Scaled down,
        # training starts from about that guess.  Drawn the course's way first, so the random stream is the same.
        w = model.linear.weight
        w.data = w.data * args.head_init_scale
    if getattr(args, "precision", "fp32") == "bf16":
        model.astype("bfloat16")  # pure bf16: the weights themselves (drawn in float32 first, then rounded)
    if policy != "off":
        model.enable_gc(segment_len=args.segment_len, policy=policy)
    return model


# --precision -> (autocast dtype or None, loss scaling?)
PRECISIONS = ["fp32", "mixed-bf16", "mixed-fp16", "bf16"]
AUTOCAST = {"fp32": None, "mixed-bf16": "bfloat16", "mixed-fp16": "float16", "bf16": None}


OPTIMIZERS = ["adam", "adam8bit", "adafactor", "sgd"]
# --parallel: data parallel (gradients all-reduced), ZeRO stage 1 / 2 on top of it, or GPipe over the ranks
PARALLEL = ["dp", "zero1", "zero2", "pipeline"]
ZERO_STAGE = {"zero1": 1, "zero2": 2}
PARALLEL_TEXT = {"dp": "data parallel (gradients all-reduced in buckets during backward)",
                 "zero1": "ZeRO stage 1 (data parallel, the optimizer state partitioned)",
                 "zero2": "ZeRO stage 2 (data parallel, optimizer state and gradients partitioned: reduce-scatter)",
                 "pipeline": "GPipe (the layers cut into one stage per rank, --accumulation-steps micro-batches)"}


def make_optimizer(args, params, model=None):
    """--optimizer at --lr: Adam (the course's); Adam8bit (block-wise 8-bit moments; the embedding's state kept
    32-bit, the paper's stable-embedding recipe); Adafactor with the external lr (relative_step and
    scale_parameter off, so the rows compare at one learning rate; factored second moments, no first moment);
    SGD with momentum 0.9.  fp32 and mixed precision keep float32 parameters (the master weights); pure bf16 keeps
    weights and state in bfloat16, with stochastic rounding if asked.  --offload-state keeps the state in host
    memory.  --parallel zero1 / zero2 runs it inside ZeroRedundancyOptimizer (stage 1 / 2)."""
    name = getattr(args, "optimizer", "adam")
    kw = {"lr": args.lr, "offload_state": bool(getattr(args, "offload_state", False))}
    if getattr(args, "precision", "fp32") == "bf16":
        kw.update(master_weights=False, stochastic_rounding=getattr(args, "stochastic_rounding", False))
    cls = {"adam8bit": ndl.optim.Adam8bit, "adafactor": ndl.optim.Adafactor, "sgd": ndl.optim.SGD}.get(
        name, ndl.optim.Adam)
    if name == "adam8bit":
        embedding = getattr(model, "embedding", None)  # a pipeline stage without the embedding has None
        kw["fp32_state_params"] = [embedding.weight] if embedding is not None else []
    elif name == "adafactor":
        kw.update(relative_step=False, scale_parameter=False)
    elif name == "sgd":
        kw["momentum"] = 0.9
    stage = ZERO_STAGE.get(getattr(args, "parallel", None))
    if stage:
        return dist.ZeroRedundancyOptimizer(params, cls, stage=stage, **kw)
    return cls(params, **kw)


def make_loss(model, head, autocast=None):
    """loss(X, y): the mean cross-entropy of one micro-batch through the LM head.

    "full" is the course's path, nn.SoftmaxLoss()(model(X)[0], y): the (tokens x vocabulary) logits are a graph
    value, held whole, and so is their gradient.  "fused" is model.loss(X, y), ops.linear_cross_entropy: the same
    loss and gradients up to rounding, the logits computed a chunk of tokens at a time inside one op (again in its
    gradient) and never held whole."""
    if head == "fused":
        loss = lambda X, y: model.loss(X, y)[0]  # noqa: E731
    else:
        softmax_loss = nn.SoftmaxLoss()
        loss = lambda X, y: softmax_loss(model(X)[0], y)  # noqa: E731
    if autocast is None:
        return loss

    def mixed(X, y):
        with ndl.autocast(autocast):  # forward and loss; backward replays the graph's casts
            return loss(X, y)
    return mixed


def micro_batches(batches, start, args, device):
    """The step's (X, y) micro-batches: the window at `start`, its columns split `accumulation_steps` ways."""
    k = args.accumulation_steps
    X_all, y_all = get_batch(batches, start, args.seq_len, device=device, dtype="float32")
    if k == 1:
        return [(X_all, y_all)]
    X_np, b = X_all.numpy(), args.batch_size  # micro-batch j is columns [j*b, (j+1)*b) of the big batch
    y_np = y_all.numpy().reshape(X_np.shape)
    return [(ndl.Tensor(X_np[:, j * b:(j + 1) * b], device=device, requires_grad=False),
             ndl.Tensor(y_np[:, j * b:(j + 1) * b].reshape(-1), device=device, requires_grad=False))
            for j in range(k)]


def plan_budget(args, data, vocab, device, policy):
    """`policy`, a checkpoint.Budget, planned on the graph of the run's first micro-batch exactly as the run's
    first step will plan it; in lazy mode nothing is computed (the planner walks the graph with a byte ledger), in
    eager mode one forward pass is.  Its minimum_peak is the least M_peak checkpointing can reach, its
    predicted_peak the M_peak it plans for (with a budget above gc off's peak: gc off's, nothing dropped).
    ValueError when the budget is infeasible (minimum_peak is set then too)."""
    model = build_model(args, vocab, device, policy)
    model.train()
    batches = batchify(data, args.batch_size * args.accumulation_steps, device=device, dtype="float32")
    X, y = micro_batches(batches, 0, args, device)[0]
    k = args.accumulation_steps
    try:
        with autograd.lazy_mode(args.lazy):
            loss = make_loss(model, args.head)(X, y)
            policy.plan(loss if k == 1 else loss / k)
    finally:
        del model, X, y
        python_gc.collect()
    return policy


def check_budget(args, data, vocab, device):
    """Fail with one line, before any work, when --budget-mb is below the least peak this graph can reach."""
    policy = checkpoint.Budget(int(args.budget_mb * 2**20))
    try:
        plan_budget(args, data, vocab, device, policy)
    except ValueError as err:
        if "infeasible" in str(err):
            least = policy.minimum_peak / 2**20
            fail(f"--budget-mb {args.budget_mb:g} is infeasible: the least M_peak checkpointing can reach on this "
                 f"model is {least:.1f} MB ({policy.minimum_peak} bytes): give --budget-mb "
                 f"{math.ceil(least * 10) / 10:g} or more")
        raise
    return policy


def _progress_on(flag):
    """--progress / --no-progress, or by default: on when stderr is a terminal or this runs in a notebook."""
    return flag if flag is not None else (sys.stderr.isatty() or "ipykernel" in sys.modules)


def run(args, use_gc, data, vocab, source, out_dir=None, quiet=False, json_path=None):
    """Train for a few batches with checkpointing off or on; return the measured record (also as JSON: to
    json_path if given, else to a new file in out_dir if given), written after every step."""
    python_gc.collect()  # a previous run's model and optimizer must not count in this run's memory
    device = pick_device(args.device)
    policy = make_policy(args) if use_gc else "off"
    model = build_model(args, vocab, device, policy)
    model.train()
    parallel = getattr(args, "parallel", None)
    if parallel == "pipeline":  # this rank's stage of the model; the rest of it is freed
        model = dist.Pipeline(pipeline_stages(model, dist.world_size()), args.accumulation_steps)
        loss_fn = pipeline_loss(model.stage, args.head)
        params = model.parameters()
        opt = make_optimizer(args, params, model.stage)
    else:
        if parallel:
            model = dist.DataParallel(model, bucket_mb=args.bucket_mb)
        params = model.parameters()
        opt = make_optimizer(args, params, model)
        loss_fn = make_loss(model, args.head, AUTOCAST[getattr(args, "precision", "fp32")])
    scaler = ndl.amp.GradScaler(init_scale=getattr(args, "init_scale", 2.0**16)) \
        if getattr(args, "precision", "fp32") == "mixed-fp16" else None
    batches = batchify(data, args.batch_size * args.accumulation_steps, device=device, dtype="float32")
    label = (args.policy or "all") if use_gc else "off"
    record = {"kind": "run", "policy": label, "use_gc": bool(use_gc), **config_of(args, source, vocab, device),
              "aliases": ALIASES, "steps": []}
    if not use_gc:
        record["budget_bytes"] = None  # the gc-off pass has no budget
    path = json_path
    if parallel and dist.rank() > 0:
        path = out_dir = None  # rank 0 writes the JSON
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    elif out_dir:
        os.makedirs(out_dir, exist_ok=True)
        segment = f"_s{args.segment_len}" if args.segment_len else ""
        name = (f"{label}_b{args.batch_size}_h{args.hidden_size}_l{args.num_layers}{segment}_"
                f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{os.urandom(2).hex()}")
        path = os.path.join(out_dir, f"{name}.json")
    nbatch = min(args.max_batches, (batches.shape[0] - 1) // args.seq_len)
    if args.memory_limit_mb:
        nd.set_memory_limit(int(args.memory_limit_mb * 2**20), device)
    bar = tqdm(total=nbatch * args.epochs, desc=f"gc {'on, ' + label if use_gc else 'off'}", unit="step",
               file=sys.stderr, disable=not _progress_on(args.progress), leave=False, dynamic_ncols=True)
    try:
        for i in range(nbatch * args.epochs):
            start = (i % nbatch) * args.seq_len
            try:
                if parallel == "pipeline":
                    step, loss = pipeline_step(model, loss_fn, opt, batches, start, args, device, params)
                else:
                    step, loss = train_step(model, loss_fn, opt, batches, start, args, device, params, scaler)
            except ValueError as err:
                if isinstance(policy, checkpoint.Budget) and "infeasible" in str(err):
                    fail(str(err))  # planned before anything was computed
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
            bar.set_postfix(loss=f"{step['loss']:.3f}", M_peak=f"{step['peak_activation_bytes'] / 2**20:.0f}MB",
                            refresh=False)
            bar.update()
            if not quiet:
                rss = "" if step["rss_peak_bytes"] is None else \
                    f"  RSS_peak {step['rss_peak_bytes'] / 2**20:8.1f} MB"
                tqdm.write(f"  step {i:3d}  loss {step['loss']:.3f}  M_act {step['activation_bytes'] / 2**20:8.1f} MB"
                           f"  M_peak {step['peak_activation_bytes'] / 2**20:8.1f} MB{rss}  "
                           f"{step['time_seconds']:.3f} s", file=sys.stdout)
    finally:
        bar.close()
        if args.memory_limit_mb:
            nd.set_memory_limit(0, device)
    record["json"] = path
    return record


def train_step(model, loss_fn, opt, batches, start, args, device, params, scaler=None):
    """One optimizer step (of `accumulation_steps` micro-batches), with its memory and time measured; loss_fn(X, y)
    is make_loss's (the full or the fused head, under autocast for mixed precision); `scaler` a GradScaler for
    mixed-fp16 (the step is skipped, and counted, when a gradient overflowed).  With a DataParallel model (--parallel
    dp, zero1, zero2) each rank trains on its share of every micro-batch's columns, and the model sums the
    micro-batches' gradients itself (no_sync), averaging them across the ranks in the last backward."""
    k = args.accumulation_steps
    data_parallel = isinstance(model, dist.DataParallel)
    opt.reset_grad()
    micro = micro_batches(batches, start, args, device)
    if data_parallel:
        micro = [rank_share(X, y, device) for X, y in micro]
    nd.reset_peak_memory_stats(device)
    baseline = nd.memory_stats(device)["current_bytes"]
    rss = None if device.name == "cuda" else PeakRSS()  # host RSS says nothing of GPU memory: GPUtil there
    t0 = time.perf_counter()
    act, floor, losses, recomputed, accumulated = 0, 0, [], 0, None
    for j, (X, y) in enumerate(micro):
        with autograd.lazy_mode(args.lazy):
            loss = loss_fn(X, y) if k == 1 else loss_fn(X, y) / k
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
            accumulating = data_parallel and j < k - 1
            with model.no_sync() if accumulating else contextlib.nullcontext():
                (loss if scaler is None else scaler.scale(loss)).backward()
        recomputed += checkpoint.last_backward_stats()["recomputed_nodes"]
        if rss:
            rss.sample()
        if k > 1 and not data_parallel:
            grads = [p.grad.realize_cached_data() for p in params]
            accumulated = grads if accumulated is None else [a + g for a, g in zip(accumulated, grads)]
            for p in params:
                p.grad = None
    del micro, X, y
    if k > 1 and not data_parallel:
        for p, g in zip(params, accumulated):
            p.grad = ndl.Tensor(g, device=device, requires_grad=False)
    # M_peak is forward + backward (what Budget bounds); the optimizer's own temporaries come after it.
    forward_backward_peak = nd.memory_stats(device)["peak_bytes"] - baseline
    grad_bytes = gradient_bytes(opt, params)
    skipped = False
    if scaler is None:
        opt.step()
    else:
        skipped = not scaler.step(opt)
        scaler.update()
    elapsed = time.perf_counter() - t0
    stats = nd.memory_stats(device)
    rss_peak = rss.growth() if rss else None
    step = {
        "loss": float(np.mean(losses)), "time_seconds": elapsed, "activation_bytes": int(act),
        "floor_bytes": int(floor), "peak_bytes": int(stats["peak_bytes"]),
        "peak_activation_bytes": int(forward_backward_peak), "step_peak_bytes": int(stats["peak_bytes"] - baseline),
        "baseline_bytes": int(baseline), "recomputed_nodes": int(recomputed), "gpu_memory_bytes": gpu_memory_bytes(),
        "rss_peak_bytes": rss_peak, "rss_start_bytes": rss.start if rss else None,
        "param_bytes": int(sum(p.realize_cached_data().nbytes for p in params)), "grad_bytes": grad_bytes,
        "optimizer_bytes": int(opt.state_bytes()), "offloaded_bytes": int(opt.host_state_bytes()),
        "skipped_step": skipped,
        "loss_scale": None if scaler is None else scaler.get_scale(),
    }
    if data_parallel:
        step["loss"] = float(np.mean(dist.all_gather_object(step["loss"])))  # the global batch's mean loss
        step["sync"] = model.last_sync_stats()
        step["ranks"] = per_rank_memory(step)
    return step, loss


def gradient_bytes(opt, params):
    """Bytes of the gradients held for the optimizer step: every `.grad`, or with ZeRO-2 this rank's shard."""
    if isinstance(opt, dist.ZeroRedundancyOptimizer):
        return int(opt.gradient_bytes())
    return int(sum(p.grad.realize_cached_data().nbytes for p in params if p.grad is not None))


def rank_share(X, y, device):
    """This rank's columns of a micro-batch: X (seq_len, b) and its targets y (seq_len * b,), b/N columns each."""
    X_np = X.numpy()
    y_np = y.numpy().reshape(X_np.shape)
    X_mine, y_mine = dist.split_batch(X_np, axis=1), dist.split_batch(y_np, axis=1)
    return (ndl.Tensor(X_mine, device=device, requires_grad=False),
            ndl.Tensor(np.ascontiguousarray(y_mine).reshape(-1), device=device, requires_grad=False))


def per_rank_memory(step):
    """Every rank's memory in this step (one all-gather): parameters, gradients, optimizer state, activations."""
    keys = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "peak_activation_bytes")
    return dist.all_gather_object({"rank": dist.rank(), **{key: step[key] for key in keys}})


# ----- --parallel pipeline: the LanguageModel cut into stages -----------------------------------------------------
class LMStage(nn.Module):
    """A run of the LanguageModel's Transformer layers as one pipeline stage.  The first stage also embeds the word
    ids and adds the positions, the last one turns the (B, T, D) stream back into (T*B, D) rows for the head, whose
    weights it holds (the loss function applies them): exactly the operations of LanguageModel.forward /
    Transformer.forward, cut between layers."""

    def __init__(self, model, layers, first, last):
        super().__init__()
        transformer = model.seq_model
        self.embedding = model.embedding if first else None
        self.positional_embedding = transformer.positional_embedding if first else None
        self.layers = layers
        self.linear = model.linear if last else None
        self.width = transformer.embedding_size
        self.checkpoint_policy = transformer.checkpoint_policy  # checkpointed as the transformer is

    def forward(self, x):
        if self.embedding is not None:  # word ids (T, B) -> the layers' input (B, T, D), as Transformer.forward
            T, B = x.shape
            x = self.embedding(x)
            positions = ndl.Tensor(np.arange(T).reshape(T, 1), device=x.device, dtype="float32", requires_grad=False)
            pos = ndl.reshape(self.positional_embedding(positions), (1, T, self.width))
            x = self.checkpoint(ndl.transpose(x, (0, 1)) + ndl.broadcast_to(pos, (B, T, self.width)), [x])
        for layer in self.layers:
            x = layer(x)
        if self.linear is not None:  # (B, T, D) -> (T*B, D), as LanguageModel.forward
            B, T, _ = x.shape
            x = ndl.reshape(ndl.transpose(x, (0, 1)), (T * B, self.width))
        return x


def pipeline_stages(model, n):
    """The LanguageModel cut into n stages of consecutive layers (the first ones get the extra layer)."""
    layers = model.seq_model.layers
    cuts = np.cumsum([0] + [len(part) for part in np.array_split(np.arange(len(layers)), n)])
    return [LMStage(model, layers[cuts[s]:cuts[s + 1]], s == 0, s == n - 1) for s in range(n)]


def pipeline_loss(stage, head):
    """loss(rows, y) on the last stage: its head (the full or the fused one) and the mean cross-entropy."""
    if stage.linear is None:
        return None
    if head == "fused":
        return lambda h, y: ndl.ops.linear_cross_entropy(h, stage.linear.weight, stage.linear.bias, y)
    softmax_loss = nn.SoftmaxLoss()
    return lambda h, y: softmax_loss(stage.linear(h), y)


def pipeline_step(pipe, loss_fn, opt, batches, start, args, device, params):
    """One optimizer step of --parallel pipeline: the step's accumulation_steps micro-batches through the stages
    (GPipe), then this stage's optimizer step.  M_act is what this stage holds when its backward phase starts (all
    micro-batches' activations, GPipe's price); every rank reports its own."""
    opt.reset_grad()
    micro = micro_batches(batches, start, args, device)
    nd.reset_peak_memory_stats(device)
    baseline = nd.memory_stats(device)["current_bytes"]
    rss = None if device.name == "cuda" else PeakRSS()
    t0 = time.perf_counter()
    with autograd.lazy_mode(args.lazy):
        loss = pipe.train_step(micro, loss_fn)
    del micro
    forward_backward_peak = nd.memory_stats(device)["peak_bytes"] - baseline
    grad_bytes = gradient_bytes(opt, params)
    opt.step()
    elapsed = time.perf_counter() - t0
    stats, memory = pipe.last_step_stats(), nd.memory_stats(device)
    step = {
        "loss": loss, "time_seconds": elapsed, "activation_bytes": int(stats["activation_bytes"] or 0),
        "floor_bytes": None, "peak_bytes": int(memory["peak_bytes"]),
        "peak_activation_bytes": int(forward_backward_peak),
        "step_peak_bytes": int(memory["peak_bytes"] - baseline), "baseline_bytes": int(baseline),
        "recomputed_nodes": int(stats["recomputed_nodes"]), "gpu_memory_bytes": gpu_memory_bytes(),
        "rss_peak_bytes": rss.growth() if rss else None, "rss_start_bytes": rss.start if rss else None,
        "param_bytes": int(sum(p.realize_cached_data().nbytes for p in params)), "grad_bytes": grad_bytes,
        "optimizer_bytes": int(opt.state_bytes()), "offloaded_bytes": int(opt.host_state_bytes()),
        "skipped_step": False, "loss_scale": None,
        "pipeline": {key: stats[key] for key in ("bubble", "bubble_mean", "theory", "compute_seconds",
                                                 "step_seconds", "compute_seconds_per_rank")},
    }
    step["ranks"] = per_rank_memory(step)
    return step, None


MIN_TIMED_STEPS = 3  # a median of fewer step times is flagged as unreliable


def _summarize(record, warmup):
    steps = [s for s in record["steps"] if not s.get("traced")]
    timed = steps[warmup:]
    steps = timed or steps or record["steps"]  # too few steps: the warm-up ones, flagged below
    t_step = statistics.median(s["time_seconds"] for s in steps)
    peak = max(s["peak_bytes"] for s in steps)
    record.update({
        "step_time_seconds": t_step, "timed_steps": len(timed), "step_time_reliable": len(timed) >= MIN_TIMED_STEPS,
        "time": t_step, "time_per_batch_median": t_step,  # the earlier project's names (ALIASES)
        "peak_bytes": peak, "peak memory": peak,
        "peak_activation_bytes": max(s["peak_activation_bytes"] for s in steps),
        "step_peak_bytes": max(s["step_peak_bytes"] for s in steps),
        "activation_bytes": max(s["activation_bytes"] for s in steps),
        "floor_bytes": min((s["floor_bytes"] for s in steps if s["floor_bytes"] is not None), default=None),
        "loss": record["steps"][-1]["loss"],
        "recomputed_nodes": record["steps"][-1]["recomputed_nodes"],
        **{key: record["steps"][-1].get(key) for key in ("param_bytes", "grad_bytes", "optimizer_bytes",
                                                         "offloaded_bytes")},
        "rss_peak_bytes": max((s["rss_peak_bytes"] for s in steps if s.get("rss_peak_bytes") is not None),
                              default=None),
        "tokens_per_second": record["effective_batch_size"] * record["seq_len"] / t_step if t_step else None,
    })
    last = record["steps"][-1]
    if "ranks" in last:  # --parallel: every rank's memory, the last step's communication or pipeline figures
        record["per_rank"] = last["ranks"]
    if "sync" in last:
        record["sync"] = last["sync"]
    if "pipeline" in last:
        record["pipeline"] = {**last["pipeline"], "bubble_median": statistics.median(
            s["pipeline"]["bubble_mean"] for s in steps)}


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


def _read_json(path):
    with open(path) as f:
        return json.load(f)


# ----- reporting ----------------------------------------------------------------------------------------------
def mb(x):
    return f"{'n/a':>9s}" if x is None else f"{x / 2**20:9.1f}"


def _pct(new, old):
    return f"{(new / old - 1) * 100:+.1f}%" if old else ""


def _time_note(*records):
    few = [r for r in records if not r.get("step_time_reliable", True)]
    if not few:
        return ""
    n = min(r["timed_steps"] for r in few)
    return (f"unreliable: from {n} timed step{'s' * (n != 1)} (< {MIN_TIMED_STEPS}); "
            f"raise --max-batches or lower --warmup")


def print_table(off, on):
    rows = [("M_act (MB)", "activation_bytes"), ("M_peak (MB)", "peak_activation_bytes"),
            ("peak bytes (MB)", "peak_bytes")]
    print(f"\n{'':18s}{'gc off':>12s}{'gc on':>12s}{'change':>10s}")
    for label, key in rows:
        a, b = off[key], on[key]
        print(f"{label:18s}{mb(a):>12s}{mb(b):>12s}{_pct(b, a):>10s}")
    print(f"{'M_floor (MB)':18s}{'':>12s}{mb(on['floor_bytes']):>12s}   (what no policy can drop)")
    note = _time_note(off, on)
    print(f"{'T_step (s)':18s}{off['time']:12.3f}{on['time']:12.3f}{_pct(on['time'], off['time']):>10s}"
          + (f"   ({note})" if note else ""))
    print(f"{'loss (last step)':18s}{off['loss']:12.4f}{on['loss']:12.4f}")
    print(f"{'recomputed nodes':18s}{off['recomputed_nodes']:12d}{on['recomputed_nodes']:12d}")
    if off.get("rss_peak_bytes") is not None and on.get("rss_peak_bytes") is not None:
        a, b = off["rss_peak_bytes"], on["rss_peak_bytes"]
        print(f"{'RSS_peak (MB)':18s}{mb(a):>12s}{mb(b):>12s}{_pct(b, a):>10s}   (process peak RSS growth per step)")
    if off.get("steps") and off["steps"][0].get("gpu_memory_bytes") is not None:
        used = [r["steps"][-1]["gpu_memory_bytes"] for r in (off, on)]
        print(f"{'GPUtil used (MB)':18s}{mb(used[0]):>12s}{mb(used[1]):>12s}")
    lower = lambda key: (1 - on[key] / off[key]) * 100 if off[key] else 0.0  # noqa: E731
    overhead = f"time overhead {_pct(on['time'], off['time'])}" + (" (unreliable)" if note else "")
    print(f"\nactivation memory at backward start: {lower('activation_bytes'):.1f}% lower; step peak: "
          f"{lower('peak_activation_bytes'):.1f}% lower; {overhead}")
    if off.get("rss_peak_bytes") and on.get("rss_peak_bytes") is not None:
        print(f"process peak RSS growth per step (what the OS sees): {lower('rss_peak_bytes'):.1f}% lower")
    print(state_text(off))
    for r in (off, on) if off.get("parallel") else ():
        print(f"{'gc on' if r['use_gc'] else 'gc off'}: {parallel_text(r)}")


def print_single(r):
    """The summary of a run with one pass only (--use-gc, --policy off)."""
    note = _time_note(r)
    print(f"\n{r['policy']}: M_act {mb(r['activation_bytes']).strip()} MB, M_peak "
          f"{mb(r['peak_activation_bytes']).strip()} MB, M_floor {mb(r['floor_bytes']).strip()} MB, "
          f"T_step {r['time']:.3f} s{f' ({note})' if note else ''}, loss {r['loss']:.4f}")
    print(state_text(r))
    if r.get("parallel"):
        print(parallel_text(r))


def state_text(r):
    """Parameters, gradients and the optimizer's state, which M_act and M_peak leave out."""
    text = (f"parameters {mb(r.get('param_bytes') or 0).strip()} MB, gradients {mb(r.get('grad_bytes') or 0).strip()}"
            f" MB, {r.get('optimizer', 'adam')} state {mb(r.get('optimizer_bytes') or 0).strip()} MB on the device")
    if r.get("offloaded_bytes"):
        text += f" + {mb(r['offloaded_bytes']).strip()} MB offloaded to host memory"
    return text


def parallel_text(r):
    """--parallel: the memory of every rank (parameters, gradients, optimizer state, activations) and the
    throughput, with the communication (dp, zero) or the pipeline's bubble."""
    n, kind = r["world_size"], r["parallel"]
    lines = [f"--parallel {kind} over {_plural(n, 'rank')}: {r['tokens_per_second']:,.0f} tokens/s (the global batch "
             f"{r['effective_batch_size']} x seq_len {r['seq_len']} per step)"]
    lines.append(f"  {'rank':>4s}{'parameters MB':>15s}{'gradients MB':>14s}{'opt. state MB':>15s}{'M_act MB':>10s}"
                 f"{'M_peak MB':>11s}")
    for m in r.get("per_rank") or []:
        lines.append(f"  {m['rank']:4d}{mb(m['param_bytes']):>15s}{mb(m['grad_bytes']):>14s}"
                     f"{mb(m['optimizer_bytes']):>15s}{mb(m['activation_bytes']):>10s}"
                     f"{mb(m['peak_activation_bytes']):>11s}")
    if r.get("sync"):
        s = r["sync"]
        op = "reduce-scatter" if kind == "zero2" else "all-reduce"
        lines.append(f"  gradients: {_plural(s['buckets'], 'bucket')} of {s['bytes'] / 2**20:.1f} MB in all ({op}), "
                     f"{s['started_before_last_gradient']} started while backward ran; backward waited "
                     f"{s['wait_seconds'] * 1e3:.1f} ms at its end and copied {s['copy_seconds'] * 1e3:.1f} ms")
    if r.get("pipeline"):
        p = r["pipeline"]
        lines.append(f"  GPipe bubble: measured {p['bubble_median']:.1%} of a step (median over the timed steps, mean "
                     f"over ranks), (d - 1)/(m + d - 1) = {p['theory']:.1%}")
    return "\n".join(lines)


def _plural(n, word):
    return f"{n} {word}{'s' * (n != 1)}"


def batch_text(args):
    b, k = args.batch_size, args.accumulation_steps
    return f"batch {b}" if k == 1 else f"batch {b} x {k} = {b * k} (--accumulation-steps {k})"


def main_run(args):
    if args.parallel:
        dist.init()
        if dist.rank() > 0:  # rank 0 prints (every rank's figures) and writes the JSON
            sys.stdout = open(os.devnull, "w")
    source = resolve_data(args.data)
    data, vocab = load_data(source)
    device = pick_device(args.device)
    check_corpus(args, data)
    which = [False, True] if args.use_gc is None else [bool(args.use_gc)]
    if args.policy == "off":
        which = [False]
    if args.budget_mb is not None and True in which:  # before the gc-off pass: an infeasible budget fails now
        per_rank = args.batch_size // (dist.world_size() if args.parallel else 1)  # the graph each rank plans
        check_budget(argparse.Namespace(**{**vars(args), "batch_size": per_rank}), data, vocab, device)
    label = args.policy or "all"
    print(f"gc.py: Transformer LM ({_plural(args.num_layers, 'layer')}, embedding {args.embedding_size}, "
          f"feed-forward {args.hidden_size}, {args.num_head} heads), {batch_text(args)} x seq_len {args.seq_len}, "
          f"device {device}, "
          f"{'lazy' if args.lazy else 'eager'}, {args.head} head; "
          + {(False,): "gc off", (True,): f"gc on ({label})", (False, True): f"gc off vs on ({label})"}[tuple(which)]
          + (f", segment_len {args.segment_len}" if args.segment_len else "")
          + (f", budget {args.budget_mb:g} MB" if args.budget_mb is not None else ""))
    if args.parallel:
        n = dist.world_size()
        print(f"parallel: {PARALLEL_TEXT[args.parallel]}, {_plural(n, 'rank')} "
              + (f"({args.batch_size // n} sequences of each micro-batch per rank)" if args.parallel != "pipeline" else
                 f"({args.accumulation_steps} micro-batches through {_plural(n, 'stage')})"))
    if source == SYNTHETIC:
        why = "--data synthetic" if args.data == SYNTHETIC else "no PTB at data/ptb or ../shared/data/ptb"
        print(f"data: a synthetic Zipf corpus with a PTB-sized vocabulary ({why}), {vocab} words")
    else:
        print(f"data: {source}, {len(data)} training tokens, vocabulary {vocab}")
    init = (f"the output layer's initial weight is scaled by {args.head_init_scale:g} (--head-init-scale 1 keeps "
            f"the course's init, whose large logits start the loss at about twice that)"
            if args.head_init_scale != 1 else "the course's init (--head-init-scale 1) gives logits with a std of "
            "several units, so the loss starts far above that; the default 0.1 starts near it")
    print(f"loss at init: about ln({vocab}) = {math.log(vocab):.2f}, a uniform guess over the vocabulary; {init}")
    print(head_text(args, vocab))
    out_dir = None if args.json else (args.out or "results")
    results = {}
    for use_gc in which:
        print(f"{f'gc on ({label})' if use_gc else 'gc off'}:", flush=True)
        try:
            results[use_gc] = run(args, use_gc, data, vocab, source, out_dir=out_dir, json_path=args.json)
        except MemoryError as err:
            print(f"gc.py: out of memory under --memory-limit-mb {args.memory_limit_mb:g}: {err}", file=sys.stderr)
            sys.exit(OOM_EXIT)
    if len(results) == 2:
        print_table(results[False], results[True])
    else:
        print_single(next(iter(results.values())))
    for r in results.values():
        if r["json"]:
            print(f"wrote {r['json']}")
    if out_dir:
        print(f"plots: python gc.py plot {out_dir}")


def head_text(args, vocab):
    """The header's line on the output layer: what its logits weigh, and what the head holds of them."""
    tokens = args.batch_size * args.seq_len
    logits = (f"output layer: its logits ({tokens} tokens x {vocab} words x 4 bytes) are "
              f"{tokens * vocab * 4 / 2**20:.1f} MB")
    if args.head == "full":
        return f"{logits} a copy, and checkpointing never drops them (--head full: SoftmaxLoss(model(x)))"
    c = chunk_rows(tokens, vocab)
    if c == tokens:
        return (f"{logits}; the fused head (--head fused: model.loss(x, y)) computes them in one chunk inside its op, "
                f"never as a graph value kept for backward")
    return (f"{logits} whole; the fused head (--head fused: model.loss(x, y)) never holds them whole: "
            f"{c} tokens' logits ({c * vocab * 4 / 2**20:.1f} MB) at a time")


def check_corpus(args, data):
    rows = len(data) // (args.batch_size * args.accumulation_steps)
    if rows - 1 < args.seq_len:
        fail(f"the corpus ({len(data)} tokens) is too small for {batch_text(args)} x seq_len {args.seq_len}: "
             f"a step needs {(args.seq_len + 1) * args.batch_size * args.accumulation_steps} tokens")


# ----- sweep and max-batch: each configuration in a fresh process ---------------------------------------------
RUN_FLAGS = ["batch_size", "seq_len", "embedding_size", "hidden_size", "num_layers", "num_head", "dropout",
             "head_init_scale", "head", "precision", "stochastic_rounding", "init_scale", "optimizer", "offload_state",
             "parallel",
             "segment_len", "budget_mb", "device", "epochs", "max_batches", "warmup", "accumulation_steps", "lr",
             "seed", "memory_limit_mb"]


def _child(args, overrides, policy, json_path, timeout=1800):
    """Run one configuration in a fresh process that writes its record to exactly json_path (chosen by the
    parent, so that two sweeps sharing an --out folder never read each other's files).  An override that is not
    one of RUN_FLAGS is passed on as `gc.py run`'s flag of that name (True: the bare flag)."""
    settings = {**vars(args), **overrides}
    cmd = [sys.executable, os.path.abspath(__file__), "run", "--policy", policy, "--use-gc", str(int(policy != "off")),
           "--json", os.path.abspath(json_path), "--data", settings["source"], "--no-progress"]
    for key in RUN_FLAGS + [k for k in overrides if k not in RUN_FLAGS]:
        value = settings.get(key)
        if value is None or value is False or (key == "segment_len" and policy != "all") or \
                (key == "budget_mb" and policy != "budget"):
            continue
        cmd += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    cmd.append("--lazy" if settings["lazy"] else "--no-lazy")
    if settings.get("parallel"):  # a job of its own, as many ranks as this gc.py was started with
        _, ranks = dist.comm.launcher_rank_and_size()
        cmd = [dist.comm.mpiexec_path() or "mpiexec", "-n", str(ranks)] + cmd
    # Under mpiexec a child must not take itself for one of this job's ranks: the launcher's variables go.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dist.comm.child_environment())
    return proc.returncode, proc.stdout + proc.stderr


def _invocation_id():
    """Names this sweep's (or max-batch search's) files apart from any other run's in the same folder."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{os.urandom(3).hex()}"


def _note(line):
    """A progress line on stderr, above the progress bar."""
    tqdm.write(line, file=sys.stderr)


def _say(line):
    """A result line on stdout, above the progress bar."""
    tqdm.write(line, file=sys.stdout)


def _last_line(log):
    lines = [ln for ln in log.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def model_text(args, skip=()):
    parts = [("batch_size", "batch_size" not in skip and batch_text(args)), ("seq_len", f"seq_len {args.seq_len}"),
             ("embedding_size", f"embedding {args.embedding_size}"),
             ("hidden_size", f"feed-forward {args.hidden_size}"), ("num_layers", _plural(args.num_layers, "layer")),
             ("num_head", f"{args.num_head} heads")]
    return ", ".join(text for key, text in parts if key not in skip)


def main_sweep(args):
    args.source = resolve_data(args.data)
    pick_device(args.device)
    data, _ = load_data(args.source)
    for value in args.values:  # every configuration fits the corpus, or the sweep does not start
        check_corpus(argparse.Namespace(**{**vars(args), args.over: value}), data)
    del data
    out_dir = args.out or os.path.join("results", f"sweep_{args.over}")
    os.makedirs(out_dir, exist_ok=True)
    policies = args.policies or (["off", "all", "sqrt", "selective"] if args.over == "num_layers" else ["off", "all"])
    sweep_id = _invocation_id()
    summary = os.path.join(out_dir, f"sweep-{sweep_id}.json")
    total = args.repeats * len(args.values) * len(policies)
    print(f"gc.py sweep {sweep_id}: {args.over} in {args.values}, policies {' '.join(policies)}, {args.repeats} "
          f"repeat{'s' * (args.repeats != 1)} ({total} runs, each a fresh process); {model_text(args, {args.over})}; "
          f"data {args.source}; writing {summary} as it goes", flush=True)
    records, failed, n = [], 0, 0
    bar = tqdm(total=total, desc=f"sweep {args.over}", unit="run", file=sys.stderr,
               disable=not _progress_on(args.progress), dynamic_ncols=True)
    for rep in range(args.repeats):
        for value in args.values:
            for policy in policies:
                n += 1
                config = f"{args.over}={value} policy={policy} rep {rep}"
                _note(f"  [{n}/{total}] start  {config}")
                t0 = time.perf_counter()
                path = os.path.join(out_dir, f"sweep-{sweep_id}_{args.over}{value}_{policy}_rep{rep}.json")
                code, log = _child(args, {args.over: value}, policy, path)
                bar.update()
                if code != 0 or not os.path.exists(path):
                    failed += 1
                    _say(f"  [{n}/{total}] failed {config} (exit {code}): {_last_line(log)}")
                    continue
                r = _read_json(path)  # exactly the file this child was told to write
                r.update({"repeat": rep, "label": policy, "sweep_id": sweep_id, "sweep_over": args.over, "json": path})
                _write_json(path, r)  # the child's file says which sweep it belongs to (plot reads it)
                records.append(r)
                for name in (summary, os.path.join(out_dir, "sweep.json")):  # as it goes; sweep.json: the latest
                    _write_json(name, records)
                unreliable = " (T unreliable)" if not r.get("step_time_reliable", True) else ""
                _say(f"  [{n}/{total}] done   {config}: M_act {mb(r['activation_bytes'])} MB  "
                     f"M_peak {mb(r['peak_activation_bytes'])} MB  T {r['time']:.3f} s{unreliable}  "
                     f"({time.perf_counter() - t0:.0f} s)")
    bar.close()
    if not records:
        print(f"gc.py sweep: all {total} runs failed", file=sys.stderr)
        sys.exit(1)
    pngs = plot_sweep(records, out_dir)
    print(f"wrote {summary} (also as {os.path.join(out_dir, 'sweep.json')}) and {', '.join(pngs)}")
    if failed:
        print(f"gc.py sweep: {failed} of {total} runs failed (see above)", file=sys.stderr)
        sys.exit(1)


def main_max_batch(args):
    args.source = resolve_data(args.data)
    device = pick_device(args.device)
    out_dir = args.out or os.path.join("results", "max_batch")
    os.makedirs(out_dir, exist_ok=True)
    search_id = _invocation_id()
    policies = args.policies or ["off", "all", "sqrt", "selective"]
    data, vocab = load_data(args.source)
    result = {"kind": "max-batch", "max_batch_id": search_id, "policies": policies,
              **config_of(args, args.source, vocab, device), "largest_batch": {}, "tries": []}
    result.update(batch_size=None, effective_batch_size=None, first_batch_size=args.batch_size,
                  max_batches=2)  # the batch is what is searched; each try trains 2 steps
    path = os.path.join(out_dir, "max_batch.json")
    print(f"gc.py max-batch {search_id}: the largest batch that trains under {args.memory_limit_mb:g} MB, per policy "
          f"({' '.join(policies)}), from batch {args.batch_size} (doubled, then bisected; a fresh process per try); "
          f"{model_text(args, {'batch_size'})}; "
          f"data {args.source}", flush=True)
    bar = tqdm(desc="max-batch tries", unit="try", file=sys.stderr, disable=not _progress_on(args.progress),
               dynamic_ncols=True)

    def fits(batch, policy):
        config = f"policy={policy} batch_size={batch}"
        _note(f"  [{len(result['tries']) + 1}] start  {config}")
        t0 = time.perf_counter()
        json_path = os.path.join(out_dir, f"max-batch-{search_id}_{policy}_b{batch}.json")
        code, log = _child(args, {"batch_size": batch, "max_batches": 2}, policy, json_path)
        bar.update()
        if code not in (0, OOM_EXIT):
            bar.close()
            print(f"gc.py max-batch: the run {config} failed (exit {code}): {_last_line(log)}", file=sys.stderr)
            sys.exit(1)
        if os.path.exists(json_path):  # tag it: plot leaves a search's tries out of its run plots
            _write_json(json_path, {**_read_json(json_path), "max_batch_id": search_id})
        result["tries"].append({"policy": policy, "batch_size": batch, "fits": code == 0, "json": json_path})
        _write_json(path, result)
        _note(f"  [{len(result['tries'])}] done   {config}: {'fits' if code == 0 else 'out of memory'} "
              f"({time.perf_counter() - t0:.0f} s)")
        return code == 0

    for policy in policies:
        lo, hi = 0, args.batch_size
        while fits(hi, policy):  # double until a batch does not fit...
            lo, hi = hi, hi * 2
        while hi - lo > max(1, lo // 16):  # ...then bisect to within ~6%
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid, policy) else (lo, mid)
        result["largest_batch"][policy] = lo
        _write_json(path, result)
        _say(f"  {policy:>9s}: largest batch under {args.memory_limit_mb:g} MB = {lo}")
    bar.close()
    best = result["largest_batch"]
    if best.get("off"):
        for policy, b in best.items():
            print(f"  {policy:>9s}: {b / best['off']:.2f}x the batch of gc off")
    png = plot_max_batch(result, out_dir)
    print(f"wrote {path} and {png}")


# ----- ablate: every technique on the same model, the same steps, each in a fresh process --------------------
ACCUMULATE = 4  # the accumulation rows: ACCUMULATE micro-batches of --batch-size / ACCUMULATE per optimizer step
# row -> (what it is, the `gc.py run` flags it trains with).  A flag is named as its dest ("head": "full" is
# --head full; True is a bare flag, and a flag that is not one of RUN_FLAGS is passed on as it is), and
# "accumulate": K trains K micro-batches of --batch-size / K: the same effective batch.  A later technique is one
# more line, e.g. "mixed-bf16": ("bf16 autocast, fp32 master weights", {**BASE, "precision": "mixed-bf16"}).
BASE = {"policy": "off", "head": "full"}  # the course's step: no checkpointing, the logits held whole
ABLATIONS = {
    "baseline": ("gc off, full head: the course's step", BASE),
    "accumulate": (f"gradient accumulation x{ACCUMULATE}: micro-batch = batch/{ACCUMULATE}, the same effective batch",
                   {**BASE, "accumulate": ACCUMULATE}),
    "all": ("checkpointing, policy all: every node inside each layer dropped", {**BASE, "policy": "all"}),
    "sqrt": ("checkpointing, policy sqrt: Chen's schedule per layer", {**BASE, "policy": "sqrt"}),
    "selective": ("checkpointing, policy selective: matmul outputs kept", {**BASE, "policy": "selective"}),
    "budget": ("checkpointing, Budget(b): b midway between the least M_peak and gc off's (--budget-mb to choose)",
               {**BASE, "policy": "budget"}),
    "fused": ("the fused LM head (model.loss: the logits never held whole), gc off", {**BASE, "head": "fused"}),
    "combined": (f"gc all + fused head + gradient accumulation x{ACCUMULATE}",
                 {"policy": "all", "head": "fused", "accumulate": ACCUMULATE}),
    "mixed-bf16": ("ndl.autocast(bfloat16): 16-bit activations, float32 master weights",
                   {**BASE, "precision": "mixed-bf16"}),
    "mixed-fp16": ("ndl.autocast(float16) + GradScaler, float32 master weights",
                   {**BASE, "precision": "mixed-fp16"}),
    "bf16": ("pure bfloat16 weights, activations and Adam state, stochastic rounding",
             {**BASE, "precision": "bf16", "stochastic_rounding": True}),
    "adam8bit": ("Adam8bit: both moments block-wise 8-bit (the embedding's state 32-bit)",
                 {**BASE, "optimizer": "adam8bit"}),
    "adafactor": ("Adafactor: factored second moments, no first moment", {**BASE, "optimizer": "adafactor"}),
    "offload": ("Adam with its state offloaded to host memory", {**BASE, "offload_state": True}),
    "toolbox": (f"gradient accumulation x{ACCUMULATE} + gc all + mixed-bf16 + Adam8bit",
                {"policy": "all", "head": "full", "accumulate": ACCUMULATE, "precision": "mixed-bf16",
                 "optimizer": "adam8bit"}),
    # offered when gc.py ablate runs under mpiexec -n N: the row is `mpiexec -n N python gc.py run --parallel dp`
    "dp": ("data parallel over the mpiexec ranks: batch/N per rank, gradients all-reduced",
           {**BASE, "parallel": "dp"}),
}


def default_rows():
    """Every row; the rows that need several processes (--parallel) only when gc.py runs under mpiexec."""
    ranks = dist.comm.launcher_rank_and_size()[1]
    return [name for name, (_, flags) in ABLATIONS.items() if ranks > 1 or not flags.get("parallel")]


def ablation_budget(args, data, vocab, device):
    """(the budget row's b in bytes, how it was chosen, Budget's least M_peak, its gc-off M_peak), up front.

    Without --budget-mb, b is the midpoint between the least M_peak checkpointing can reach and gc off's M_peak,
    both as Budget's planner predicts them on the first step's graph (lazy: nothing computed; its predictions are
    within about 1% of the allocator's peak), so it is feasible and makes Budget drop some of what "all" drops.
    A given --budget-mb is checked the same way: below the least peak, one line and exit 2 before any row runs."""
    trial = argparse.Namespace(**{**vars(args), "policy": "budget", "head": BASE["head"], "accumulation_steps": 1,
                                  "segment_len": None})
    probe = checkpoint.Budget(2**62)  # above any peak: plans to drop nothing, and measures the least peak
    plan_budget(trial, data, vocab, device, probe)
    least, off = probe.minimum_peak, probe.predicted_peak
    if args.budget_mb is None:
        return (least + off) // 2, "midway between the least M_peak and gc off's (Budget's predictions)", least, off
    check_budget(argparse.Namespace(**{**vars(trial), "budget_mb": args.budget_mb}), data, vocab, device)
    return int(args.budget_mb * 2**20), "--budget-mb", least, off


def _setup_text(args, flags, budget_bytes):
    """A row's setup in a few words: its policy, its head, its batch (micro-batches x accumulation)."""
    policy = flags.get("policy", "off")
    if policy == "budget":
        policy = f"budget {budget_bytes / 2**20:.1f} MB"
    k = flags.get("accumulate", 1)
    batch = f"batch {args.batch_size}" if k == 1 else f"batch {args.batch_size // k} x {k} = {args.batch_size}"
    extra = [f"{key} {value}" for key, value in flags.items() if key not in ("policy", "head", "accumulate",
                                                                            "parallel")]
    if flags.get("parallel"):
        ranks = dist.comm.launcher_rank_and_size()[1]
        extra.append(f"{flags['parallel']} over {ranks} ranks ({args.batch_size // ranks} per rank)")
    return ", ".join([f"gc {policy}", f"{flags.get('head', 'full')} head", batch] + extra)


def main_ablate(args):
    if dist.comm.launcher_rank_and_size()[0] > 0:
        return  # under mpiexec rank 0 runs the rows (the dp row as a job of all the ranks); the others are done
    args.source = resolve_data(args.data)
    args.max_batches = args.steps
    device = pick_device(args.device)
    data, vocab = load_data(args.source)
    check_corpus(args, data)  # the effective batch: every row trains on the same windows
    out_dir = args.out or os.path.join("results", "ablation")
    ablation_id = _invocation_id()
    rows = args.rows or default_rows()
    budget = None
    if "budget" in rows:  # chosen and checked up front: an infeasible budget stops here, before any row runs
        budget = ablation_budget(args, data, vocab, device)
    del data
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "ablation.json")
    result = {"kind": "ablation", "ablation_id": ablation_id, **config_of(args, args.source, vocab, device),
              "head": None, "steps_per_row": args.steps, "row_names": rows,
              "budget_bytes": budget and budget[0], "budget_rule": budget and budget[1],
              "budget_minimum_bytes": budget and budget[2], "budget_off_predicted_bytes": budget and budget[3],
              "rows": []}
    print(f"gc.py ablate {ablation_id}: {len(rows)} rows ({' '.join(rows)}), each a fresh process training "
          f"{_plural(args.steps, 'step')} (warmup {args.warmup}); {model_text(args)}; data {args.source}; "
          f"writing {path} as it goes", flush=True)
    if budget:
        print(f"budget row: b = {budget[0] / 2**20:.1f} MB ({budget[1]}; least M_peak {budget[2] / 2**20:.1f} MB, "
              f"gc off's {budget[3] / 2**20:.1f} MB)", flush=True)
    bar = tqdm(total=len(rows), desc="ablate", unit="row", file=sys.stderr, disable=not _progress_on(args.progress),
               dynamic_ncols=True)
    failed = 0
    for n, name in enumerate(rows, 1):
        what, flags = ABLATIONS[name]
        flags = dict(flags)
        policy, k = flags.pop("policy", "off"), flags.pop("accumulate", 1)
        overrides = {**flags, "batch_size": args.batch_size // k, "accumulation_steps": k, "epochs": 1,
                     "max_batches": args.steps, "budget_mb": budget[0] / 2**20 if policy == "budget" else None}
        setup = _setup_text(args, ABLATIONS[name][1], budget[0] if budget else 0)
        _note(f"  [{n}/{len(rows)}] start  {name}: {setup}")
        t0 = time.perf_counter()
        json_path = os.path.join(out_dir, f"ablation-{ablation_id}_{name}.json")
        code, log = _child(args, overrides, policy, json_path)
        bar.update()
        row = {"row": name, "what": what, "setup": setup, "flags": ABLATIONS[name][1], "json": json_path}
        if code != 0 or not os.path.exists(json_path):
            failed += 1
            row["failed"] = f"exit {code}: {_last_line(log)}"
            _say(f"  [{n}/{len(rows)}] failed {name} ({row['failed']})")
        else:
            r = _read_json(json_path)
            _write_json(json_path, {**r, "ablation_id": ablation_id, "label": name})  # plot: part of this ablation
            row.update({key: r.get(key) for key in ABLATION_KEYS})
            _say(f"  [{n}/{len(rows)}] done   {name}: M_act {mb(r['activation_bytes'])} MB  M_peak "
                 f"{mb(r['peak_activation_bytes'])} MB  T {r['time']:.3f} s  loss {r['loss']:.4f}  "
                 f"({time.perf_counter() - t0:.0f} s)")
        result["rows"].append(row)
        _compare_to_baseline(result["rows"])
        _write_json(path, result)
    bar.close()
    print_ablation(result)
    if not any("failed" not in r for r in result["rows"]):
        print("gc.py ablate: every row failed", file=sys.stderr)
        sys.exit(1)
    png = plot_ablation(result, out_dir)
    print(f"wrote {path} and {png}")
    if failed:
        print(f"gc.py ablate: {failed} of {len(rows)} rows failed (see above)", file=sys.stderr)
        sys.exit(1)


# what each ablation row keeps of its run's record (the run's own JSON, named by "json", has everything)
ABLATION_KEYS = ["policy", "head", "batch_size", "accumulation_steps", "effective_batch_size", "budget_bytes",
                 "activation_bytes", "peak_activation_bytes", "floor_bytes", "rss_peak_bytes", "step_time_seconds",
                 "timed_steps", "step_time_reliable", "loss", "recomputed_nodes", "param_bytes", "grad_bytes",
                 "optimizer_bytes", "offloaded_bytes", "parallel", "world_size", "tokens_per_second", "per_rank"]


def _compare_to_baseline(rows):
    """Each row's change from the baseline row: M_peak and T_step as ratios - 1, the final loss as a difference."""
    base = next((r for r in rows if r["row"] == "baseline" and "failed" not in r), None)
    for r in rows:
        if "failed" in r:
            continue
        ok = base is not None
        r["peak_change"] = r["peak_activation_bytes"] / base["peak_activation_bytes"] - 1 if ok else None
        r["time_change"] = r["step_time_seconds"] / base["step_time_seconds"] - 1 if ok else None
        r["loss_diff"] = r["loss"] - base["loss"] if ok and None not in (r["loss"], base["loss"]) else None


def _mb_or_blank(nbytes):
    return "" if nbytes is None else f"{nbytes / 2**20:.1f}"


def print_ablation(result):
    """The ablation's table: a line per row, its change from the baseline row beside M_peak, T_step and the loss."""
    rows = result["rows"]
    width = max(len(r["setup"]) for r in rows) + 2
    change = lambda r, key: "" if r.get(key) is None or r["row"] == "baseline" else f"{r[key] * 100:+.1f}%"  # noqa
    print(f"\n{'row':11s}{'setup':{width}s}{'M_act MB':>9s}{'M_peak MB':>10s}{'vs base':>9s}{'P+G MB':>8s}"
          f"{'state MB':>9s}{'RSS MB':>8s}{'T_step s':>9s}{'vs base':>9s}{'loss':>8s}{'loss-base':>10s}")
    for r in rows:
        if "failed" in r:
            print(f"{r['row']:11s}{r['setup']:{width}s}failed ({r['failed']})")
            continue
        rss = "" if r.get("rss_peak_bytes") is None else f"{r['rss_peak_bytes'] / 2**20:.1f}"
        loss = "" if r["loss"] is None else f"{r['loss']:.4f}"
        diff = "" if r.get("loss_diff") is None or r["row"] == "baseline" else \
            "0" if r["loss_diff"] == 0 else f"{r['loss_diff']:+.1e}"
        print(f"{r['row']:11s}{r['setup']:{width}s}{r['activation_bytes'] / 2**20:9.1f}"
              f"{r['peak_activation_bytes'] / 2**20:10.1f}{change(r, 'peak_change'):>9s}"
              f"{_mb_or_blank((r.get('param_bytes') or 0) + (r.get('grad_bytes') or 0)):>8s}"
              f"{_mb_or_blank(r.get('optimizer_bytes')):>9s}{rss:>8s}"
              f"{r['step_time_seconds']:9.3f}{change(r, 'time_change'):>9s}{loss:>8s}{diff:>10s}")
    note = _time_note(*[r for r in rows if "failed" not in r]).replace("--max-batches", "--steps")
    b = result["batch_size"]
    accumulation = (f" x {ACCUMULATE}: {ACCUMULATE} micro-batches of {b // ACCUMULATE} per step, their gradients "
                    f"summed." if any(r.get("accumulation_steps", 1) > 1 for r in rows) else "")
    print(textwrap.fill(
        f"M_act, M_peak: exact allocator bytes over forward + backward, parameters and optimizer state left out; "
        f"P+G: parameters and gradients; state: the optimizer's state on the device (moments, master weights); "
        f"RSS: the process's peak resident memory growth in a step; T_step: median step time after the warm-up"
        f"{' (' + note + ')' if note else ''}; loss: the last step's, loss-base: minus the baseline's. Every row "
        f"trains the same {result['steps_per_row']} steps of {b} sequences each.{accumulation}", 110))


# ----- plots --------------------------------------------------------------------------------------------------
NEUTRAL = "0.55"  # gc off: grey, drawn first
COLOURS = {"all": "tab:blue", "sqrt": "tab:orange", "selective": "tab:green", "budget": "tab:red"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(r):
    """A run's curve or bar: its policy, with its segment length or budget where it has one."""
    policy = r.get("label") or r.get("policy") or ("all" if r.get("use_gc") else "off")
    if policy == "all" and r.get("segment_len") and r.get("sweep_over") != "segment_len":
        return f"all, segment_len {r['segment_len']}"
    if policy == "budget" and r.get("budget_bytes"):
        return f"budget {r['budget_bytes'] / 2**20:g} MB"
    return policy


def _order(labels):
    base = lambda label: label.split(",")[0].split(" ")[0]  # noqa: E731
    return sorted(set(labels), key=lambda label: (POLICIES.index(base(label)) if base(label) in POLICIES else 99,
                                                   label))


def _colour(label):
    base = label.split(",")[0].split(" ")[0]
    return NEUTRAL if base == "off" else COLOURS.get(base, "tab:purple")


def _config_text(r, skip=()):
    """The configuration of a record as a plot's subtitle."""
    b, k = r.get("batch_size"), r.get("accumulation_steps") or 1
    parts = [("batch_size", f"batch {b}" if k == 1 else f"batch {b}x{k}"), ("seq_len", f"seq_len {r.get('seq_len')}"),
             ("embedding_size", f"embedding {r.get('embedding_size')}"),
             ("hidden_size", f"feed-forward {r.get('hidden_size')}"),
             ("num_layers", _plural(r.get("num_layers"), "layer")), ("num_head", f"{r.get('num_head')} heads"),
             ("vocab_size", f"vocab {r.get('vocab_size')}"),
             ("data", "synthetic data" if r.get("data") == SYNTHETIC
              else f"data {os.path.basename(str(r.get('data')))}"),
             ("device", f"{r.get('device')}, {_plural(r.get('threads'), 'thread')}"),
             ("lazy", "lazy" if r.get("lazy") else "eager"),
             ("head", r.get("head") and f"{r['head']} head"),
             ("max_batches", f"{r.get('max_batches')} steps, warmup {r.get('warmup')}")]
    return ", ".join(text for key, text in parts if key not in skip and text)


def _spread(values):
    """(median, [below, above]) of repeated measurements: an error bar from their min to their max."""
    med = statistics.median(values)
    return med, [med - min(values), max(values) - med]


PANELS = [("activation_bytes", "M_act (MB): held at backward start", 2**20),
          ("peak_activation_bytes", "M_peak (MB): forward + backward peak", 2**20),
          ("time", "T_step (s): median step time", 1)]


def _unreliable(records):
    return any(not r.get("step_time_reliable", True) for r in records)


def plot_sweep(records, out_dir):
    """One PNG per sweep in `records` (by sweep_id): M_act (with M_floor), M_peak and T_step against the swept
    parameter, a line per policy, error bars over repeats."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    pngs = []
    by_sweep = {}
    for r in records:
        by_sweep.setdefault(r.get("sweep_id", "?"), []).append(r)
    for sweep_id, rs in by_sweep.items():
        over = rs[0].get("sweep_over") or next(k for k in ("batch_size", "hidden_size", "segment_len", "num_layers")
                                               if len({r.get(k) for r in rs}) > 1)
        xs_all = sorted({r[over] for r in rs})
        fig, axes = plt.subplots(1, 3, figsize=(14, 4.4))
        for label in _order(_label(r) for r in rs):
            mine = [r for r in rs if _label(r) == label]
            xs = sorted({r[over] for r in mine})
            for ax, (key, title, unit) in zip(axes, PANELS):
                stats = [_spread([r[key] / unit for r in mine if r[over] == x and r.get(key) is not None]) for x in xs]
                ax.errorbar(xs, [m for m, _ in stats], yerr=np.array([e for _, e in stats]).T, marker="o",
                            capsize=3, color=_colour(label), label=label, zorder=3 if label == "off" else 2)
        floors = [statistics.median(r["floor_bytes"] / 2**20 for r in rs if r[over] == x and r.get("use_gc"))
                  if any(r[over] == x and r.get("use_gc") for r in rs) else None for x in xs_all]
        if any(f is not None for f in floors):
            axes[0].plot([x for x, f in zip(xs_all, floors) if f is not None], [f for f in floors if f is not None],
                         ls="--", color="black", lw=1, label="M_floor")
        for ax, (key, title, _) in zip(axes, PANELS):
            ax.set_title(title + ("\n(some from < 3 timed steps: unreliable)" if key == "time" and _unreliable(rs)
                                  else ""), fontsize=10)
            ax.set_xlabel(over)
            if len(xs_all) <= 12:
                ax.set_xticks(xs_all)  # the swept values themselves: integers
            else:
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        handles, names = axes[0].get_legend_handles_labels()
        order = sorted(range(len(names)), key=lambda i: names[i] == "M_floor")  # the policies first, "off" leading
        axes[0].legend([handles[i] for i in order], [names[i] for i in order], fontsize=8)
        repeats = len({r.get("repeat") for r in rs})
        fig.suptitle(f"gc.py sweep over {over} ({repeats} repeat{'s' * (repeats != 1)}, median, bars: min-max)\n"
                     f"{_config_text(rs[0], {over})}", fontsize=10)
        fig.tight_layout()
        png = os.path.join(out_dir, f"sweep_{over}-{sweep_id}.png")
        fig.savefig(png, dpi=100)
        plt.close(fig)
        pngs.append(png)
    return pngs


RUN_CONFIG_KEYS = ["data", "vocab_size", "batch_size", "accumulation_steps", "seq_len", "embedding_size",
                   "hidden_size", "num_layers", "num_head", "dropout", "head_init_scale", "head", "device", "lazy",
                   "lr", "seed", "max_batches", "epochs", "warmup"]


def plot_runs(records, out_dir):
    """One PNG per model configuration among `records` (`run` JSONs): a bar per policy ("off" first) for M_act
    (M_floor marked), M_peak and T_step, error bars over repeats (runs of the same configuration)."""
    plt = _pyplot()
    groups = {}
    for r in records:
        groups.setdefault(tuple(json.dumps(r.get(k)) for k in RUN_CONFIG_KEYS), []).append(r)
    pngs = []
    for rs in groups.values():
        labels = _order(_label(r) for r in rs)
        n_repeats = max(sum(_label(r) == label for r in rs) for label in labels)
        fig, axes = plt.subplots(1, 3, figsize=(4 + 1.6 * len(labels) * 3, 4.4))
        for ax, (key, title, unit) in zip(axes, PANELS):
            stats = [_spread([r[key] / unit for r in rs if _label(r) == label and r.get(key) is not None] or [0])
                     for label in labels]
            repeated = n_repeats > 1  # error bars only where there are repeats to spread
            bars = ax.bar(range(len(labels)), [m for m, _ in stats], yerr=np.array([e for _, e in stats]).T
                          if repeated else None, capsize=4, color=[_colour(label) for label in labels], zorder=2)
            ax.bar_label(bars, labels=[f"{m:.3f}" if key == "time" or m < 10 else f"{m:.1f}" for m, _ in stats],
                         fontsize=8, padding=2)
            ax.margins(y=0.12)  # room for the labels
            floors = [r["floor_bytes"] / 2**20 for r in rs if r.get("use_gc") and r.get("floor_bytes") is not None]
            if key == "activation_bytes" and floors:  # the floor is a property of the checkpointed graph
                ax.axhline(statistics.median(floors), color="black", ls="--", lw=1, zorder=3,
                           label="M_floor: what no policy can drop")
                ax.legend(fontsize=8)
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels(labels, fontsize=9)
            ax.set_ylim(bottom=0)
            ax.grid(axis="y", alpha=0.3, zorder=0)
            ax.set_title(title + ("\n(from < 3 timed steps: unreliable)" if key == "time" and _unreliable(rs) else ""),
                         fontsize=10)
        spread = ", median, bars: min-max" if n_repeats > 1 else ""
        fig.suptitle(f"gc.py run: gradient checkpointing off vs on ({n_repeats} run{'s' * (n_repeats != 1)} "
                     f"each{spread})\n{_config_text(rs[0])}", fontsize=10)
        fig.tight_layout()
        r = rs[0]
        png = os.path.join(out_dir, f"runs_b{r.get('batch_size')}x{r.get('seq_len')}_e{r.get('embedding_size')}_"
                                    f"h{r.get('hidden_size')}_l{r.get('num_layers')}_v{r.get('vocab_size')}"
                                    f"{'_full' if r.get('head', 'full') == 'full' else ''}.png")
        fig.savefig(png, dpi=100)
        plt.close(fig)
        pngs.append(png)
    return pngs


def plot_max_batch(result, out_dir):
    """The largest batch per policy under the cap, "off" first, with its ratio to gc off's."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    best = result["largest_batch"]
    labels = _order(best)
    fig, ax = plt.subplots(figsize=(max(7.0, 2 + 1.4 * len(labels)), 4.8))
    ax.bar(range(len(labels)), [best[p] for p in labels], color=[_colour(p) for p in labels], zorder=2)
    for i, p in enumerate(labels):
        ratio = f"\n{best[p] / best['off']:.2f}x off" if best.get("off") else ""
        ax.annotate(f"{best[p]}{ratio}", (i, best[p]), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels)
    ax.set_ylabel("largest batch that trains")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, max(list(best.values()) + [1]) * 1.25)
    ax.grid(axis="y", alpha=0.3, zorder=0)
    cap = result.get("memory_limit_bytes")
    cap_text = f"{cap / 2**20:g} MB" if cap else "?"
    config = textwrap.fill(_config_text(result, {"batch_size", "max_batches"}), 90)
    ax.set_title(f"gc.py max-batch: the largest batch that trains under a cap of {cap_text}\n{config}", fontsize=9)
    fig.tight_layout()
    png = os.path.join(out_dir, f"max_batch-{result.get('max_batch_id', 'result')}.png")
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


ROW_COLOURS = {"baseline": NEUTRAL, "accumulate": "tab:brown", "fused": "tab:purple", "combined": "tab:cyan",
               "mixed-bf16": "tab:pink", "mixed-fp16": "tab:pink", "bf16": "tab:pink", "adam8bit": "tab:olive",
               "adafactor": "tab:olive", "offload": "tab:olive", "toolbox": "black",
               **COLOURS}


def plot_ablation(result, out_dir):
    """ablation.png: a bar per row (baseline on top, in grey) of M_peak (M_act inside it), peak RSS growth and
    T_step, each labelled with its change from the baseline; the final loss beside each row's name."""
    plt = _pyplot()
    rows = [r for r in result["rows"] if "failed" not in r]
    names = [f"{r['row']}\nloss {r['loss']:.4f}" if r.get("loss") is not None else r["row"] for r in rows]
    colours = [ROW_COLOURS.get(r["row"], "tab:olive") for r in rows]
    y = np.arange(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(16, 1.6 + 0.62 * len(rows)), sharey=True)
    panels = [("peak_activation_bytes", "M_peak (MB), M_act inside (hatched)", 2**20, "peak_change"),
              ("rss_peak_bytes", "peak RSS growth per step (MB)", 2**20, None),
              ("step_time_seconds", "T_step (s): median step time", 1, "time_change")]
    for ax, (key, title, unit, change) in zip(axes, panels):
        values = [(r.get(key) or 0) / unit for r in rows]
        ax.barh(y, values, color=colours, zorder=2, height=0.7)
        if key == "peak_activation_bytes":
            ax.barh(y, [r["activation_bytes"] / unit for r in rows], color="none", edgecolor="black", hatch="//",
                    height=0.35, lw=0.6, zorder=3)
        for i, (r, v) in enumerate(zip(rows, values)):
            text = f"{v:.3f}" if unit == 1 else f"{v:.1f}"
            if change and r.get(change) is not None and r["row"] != "baseline":
                text += f" ({r[change] * 100:+.0f}%)"
            ax.annotate(text, (v, i), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
        ax.set_xlim(0, max(values + [1e-9]) * 1.35)
        ax.set_title(title + ("\n(from < 3 timed steps: unreliable)" if key == "step_time_seconds"
                              and _unreliable(rows) else ""), fontsize=10)
        ax.grid(axis="x", alpha=0.3, zorder=0)
    axes[0].set_yticks(y)
    axes[0].set_yticklabels(names, fontsize=9)
    axes[0].invert_yaxis()  # the rows in the table's order, baseline first
    config = textwrap.fill(_config_text(result, {"max_batches"}) + f", {result.get('steps_per_row')} steps per row, "
                           f"warmup {result.get('warmup')}", 150)
    fig.suptitle(f"gc.py ablate: each technique trains the same model for the same steps (a fresh process per row)"
                 f"\n{config}", fontsize=10)
    fig.tight_layout()
    png = os.path.join(out_dir, "ablation.png")
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def main_plot(args):
    folder = args.dir
    if not os.path.isdir(folder):
        fail(f"plot: {folder} is not a folder")
    runs, sweeps, searches, ablations, skipped = [], {}, {}, [], []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        try:
            data = _read_json(path)
        except (OSError, ValueError):
            skipped.append(path)
            continue
        if isinstance(data, list) and data and all(isinstance(r, dict) and "sweep_id" in r for r in data):
            for r in data:
                sweeps.setdefault(r["sweep_id"], {})[(r.get("json"), r.get("repeat"), _label(r), r.get(r.get(
                    "sweep_over") or "batch_size"))] = r  # sweep.json repeats a sweep-<id>.json: counted once
        elif isinstance(data, dict) and "largest_batch" in data:
            searches[data.get("max_batch_id", path)] = data
        elif isinstance(data, dict) and data.get("kind") == "ablation":
            ablations.append(data)
        elif isinstance(data, dict) and "steps" in data and "activation_bytes" in data:
            if not {"sweep_id", "max_batch_id", "ablation_id"} & set(data):  # plotted with their sweep/search/ablation
                runs.append(data)
        else:
            skipped.append(path)
    pngs = []
    if runs:
        pngs += plot_runs(runs, folder)
    for rs in sweeps.values():
        pngs += plot_sweep(list(rs.values()), folder)
    for result in searches.values():
        if result.get("largest_batch"):
            pngs.append(plot_max_batch(result, folder))
    for result in ablations:  # ablate writes one ablation.json per folder
        if any("failed" not in r for r in result["rows"]):
            pngs.append(plot_ablation(result, folder))
    if not pngs:
        fail(f"plot: {folder} holds no gc.py run, sweep, max-batch or ablation JSON")
    for path in skipped:
        print(f"skipped {path} (not a gc.py JSON)", file=sys.stderr)
    subfolders = [d for d in sorted(glob.glob(os.path.join(folder, "*", ""))) if glob.glob(os.path.join(d, "*.json"))]
    for d in subfolders:
        print(f"({d} holds JSON too: python gc.py plot {d})", file=sys.stderr)
    print(f"wrote {', '.join(pngs)}")


# ----- the command line ---------------------------------------------------------------------------------------
class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each flag once, in its hyphenated spelling, with its default."""

    def _format_action_invocation(self, action):
        if not action.option_strings:
            return super()._format_action_invocation(action)
        shown = [s for s in action.option_strings if "_" not in s] or action.option_strings
        if action.nargs == 0:
            return ", ".join(shown)
        return f"{', '.join(shown)} {self._format_args(action, self._get_default_metavar_for_optional(action))}"

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if "default" not in text and default is not None and default is not False and default != argparse.SUPPRESS \
                and action.option_strings:
            text += " (default: %(default)s)"
        return text


def _formatter(prog):
    import shutil

    columns = shutil.get_terminal_size((106, 24)).columns  # 104 wide, or the terminal's width
    return HelpFormatter(prog, max_help_position=28, width=max(80, min(104, columns - 2)))


class Parser(argparse.ArgumentParser):
    """argparse, with every error as one line on stderr (exit status 2), naming the flag and the closest one."""

    def error(self, message):
        hint = ""
        if "unrecognized arguments" in message:
            words = message.split(":", 1)[1].split()
            flags = [s for a in self._actions for s in a.option_strings if "_" not in s]
            close = [(w, difflib.get_close_matches(w.split("=")[0].replace("_", "-"), flags, n=1, cutoff=0.6))
                     for w in words if w.startswith("--")]
            hint = "".join(f"; did you mean {m[0]} for {w}?" for w, m in close if m)
            misplaced = [w for w in words if w in SUBCOMMANDS]
            if misplaced:
                hint += f"; the subcommand goes first: python gc.py {misplaced[0]} [flags]"
        print(f"{self.prog}: error: {message}{hint} (see python {self.prog} --help)", file=sys.stderr)
        sys.exit(BAD_INPUT_EXIT)


def _flag(parser, name, **kwargs):
    """--name-with-hyphens, also accepted as --name_with_underscores (the earlier project's spelling)."""
    names = [f"--{name.replace('_', '-')}"] + ([f"--{name}"] if "_" in name else [])
    parser.add_argument(*names, dest=name, **kwargs)


def _add_model_flags(p, command):
    g = p.add_argument_group("model and data")
    _flag(g, "data", default=None, metavar="DIR",
          help=f"PTB folder with train.txt and test.txt, or '{SYNTHETIC}' (default: data/ptb, else ../shared/data/ptb, "
               "else a synthetic Zipf corpus with a PTB-sized vocabulary; an explicit folder must exist)")
    if command == "max-batch":
        _flag(g, "batch_size", type=int, default=8, metavar="N",
              help="the first batch tried: the search doubles it until a batch does not fit, then bisects")
    elif command == "ablate":
        _flag(g, "batch_size", type=int, default=32, metavar="N",
              help=f"sequences per optimizer step in every row; rows with accumulation x{ACCUMULATE} train "
                   f"micro-batches of N/{ACCUMULATE} (N must divide by {ACCUMULATE})")
    else:
        _flag(g, "batch_size", type=int, default=32, metavar="N", help="sequences per micro-batch")
    if command != "ablate":
        _flag(g, "accumulation_steps", type=int, default=1, metavar="K",
              help="micro-batches per optimizer step, their gradients summed: the effective batch is batch-size x "
                   "K, with about 1/K of the activation memory")
    _flag(g, "seq_len", type=int, default=32, metavar="T", help="tokens per sequence (BPTT window)")
    _flag(g, "embedding_size", type=int, default=256, metavar="D", help="model width")
    _flag(g, "hidden_size", type=int, default=256, metavar="H", help="feed-forward width of each Transformer layer")
    _flag(g, "num_layers", type=int, default=4, metavar="L", help="Transformer layers")
    _flag(g, "num_head", type=int, default=4, metavar="N", help="attention heads; must divide --embedding-size")
    _flag(g, "dropout", type=float, default=0.0, metavar="P", help="dropout probability, in [0, 1)")
    _flag(g, "head_init_scale", type=float, default=0.1, metavar="S",
          help="scale of the output layer's initial weight, so the loss starts near ln(vocab); 1 keeps the course's "
               "init (whose logits start with a std of several units)")
    if command != "ablate":
        _flag(g, "precision", default="fp32", choices=PRECISIONS,
              help="fp32; mixed-bf16 / mixed-fp16: ndl.autocast around forward and loss, float32 master weights "
                   "(mixed-fp16 with ndl.amp.GradScaler); bf16: pure bfloat16 weights, activations and Adam state "
                   "(default: fp32)")
        _flag(g, "stochastic_rounding", action="store_true",
              help="with --precision bf16: round each weight update stochastically (else to nearest)")
        _flag(g, "init_scale", type=float, default=2.0**16, metavar="S",
              help="with --precision mixed-fp16: GradScaler's initial loss scale (default: 65536, PyTorch's; steps "
                   "whose gradients overflow at it are skipped while it comes down)")
        _flag(g, "optimizer", default="adam", choices=OPTIMIZERS,
              help="adam (the course's), adam8bit (8-bit block-wise moments), adafactor (factored second moments, "
                   "no first moment, at --lr), sgd (momentum 0.9) (default: adam)")
        _flag(g, "offload_state", action="store_true",
              help="keep the optimizer's state in host memory, outside the device allocator, and bring each "
                   "parameter's state in for its update")
        _flag(g, "head", default="fused", choices=HEADS,
              help="the LM head and loss: fused is model.loss(x, y) (ops.linear_cross_entropy: the logits computed "
                   "a chunk of tokens at a time, never held whole; the same loss and gradients); full is the "
                   "course's SoftmaxLoss(model(x)), logits and their gradient held whole (default: fused)")
    if command == "ablate":
        _add_ablate_flags(p)
        return
    g = p.add_argument_group("checkpointing")
    if command == "run":
        _flag(g, "policy", default=None, choices=POLICIES,
              help="what gc on drops: all (every node inside each layer), sqrt (Chen's schedule), selective (keeps "
                   "matmul outputs), budget (keeps M_peak under --budget-mb); off runs gc off alone (default: all)")
        _flag(g, "use_gc", type=int, choices=[0, 1], default=None,
              help="run only gc off (0) or only gc on (1) (default: both, side by side)")
    else:
        _flag(g, "policies", nargs="+", choices=POLICIES, default=None, metavar="POLICY",
              help="policies to compare, from " + "|".join(POLICIES) + " (default: " +
                   ("off all, or off all sqrt selective over num_layers" if command == "sweep"
                    else "off all sqrt selective") + ")")
    _flag(g, "segment_len", type=int, default=None, metavar="N",
          help="with policy all: keep every N-th node of a region as a checkpoint (default: none kept)")
    _flag(g, "budget_mb", type=float, default=None, metavar="MB",
          help="the M_peak bound of policy budget, in MiB (needs --policy budget)")
    g = p.add_argument_group("training and measurement")
    _flag(g, "lazy", action=argparse.BooleanOptionalAction, default=True,
          help="lazy evaluation: ops record the graph and realization computes it (default: lazy)")
    _flag(g, "device", default=None, choices=["cpu", "cuda", "cpu_numpy"],
          help="array backend (default: cuda when available, else cpu)")
    _flag(g, "epochs", type=int, default=1, metavar="N", help="passes over the --max-batches windows")
    _flag(g, "max_batches", type=int, default=30, metavar="N", help="optimizer steps per epoch (at most)")
    _flag(g, "warmup", type=int, default=2, metavar="N", help="steps left out of the T_step median")
    _flag(g, "lr", type=float, default=1e-3, metavar="LR", help="Adam's learning rate")
    _flag(g, "seed", type=int, default=0, metavar="N", help="NumPy seed for the model's initialization")
    if command == "max-batch":
        _flag(g, "memory_limit_mb", type=float, required=True, metavar="MB",
              help="the cap: past it the allocator raises MemoryError (required)")
    else:
        _flag(g, "memory_limit_mb", type=float, default=None, metavar="MB",
              help="cap the allocator: past it a run stops with MemoryError, exit status 3 (default: no cap)")
    if command == "run":
        g = p.add_argument_group("distributed: mpiexec -n N python gc.py run --parallel ...")
        _flag(g, "parallel", default=None, choices=PARALLEL,
              help="dp: data parallel, --batch-size split over the ranks, gradients all-reduced; zero1 / zero2: ZeRO "
                   "stage 1 / 2 on top (optimizer state / and gradients partitioned); pipeline: GPipe, one stage of "
                   "layers per rank, the --accumulation-steps micro-batches flowing through them (default: none)")
        _flag(g, "bucket_mb", type=float, default=25.0, metavar="MB",
              help="dp, zero: gradients are reduced in buckets of about MB (PyTorch DDP's 25)")
    g = p.add_argument_group("output")
    default_out = {"run": "results", "sweep": "results/sweep_OVER", "max-batch": "results/max_batch"}[command]
    _flag(g, "out", default=None, metavar="DIR", help=f"folder for the JSON (and PNG) files (default: {default_out})")
    if command == "run":
        _flag(g, "json", default=None, metavar="FILE",
              help="write the one run's JSON to exactly FILE instead (needs --use-gc or --policy off; sweep and "
                   "max-batch give each child its own)")
    _flag(g, "progress", action=argparse.BooleanOptionalAction, default=None,
          help="progress bars on stderr (default: when stderr is a terminal or in a notebook)")


def _add_ablate_flags(p):
    g = p.add_argument_group("ablation")
    _flag(g, "rows", nargs="+", default=None, metavar="ROW",
          help="the rows to train, in this order, from " + " ".join(ABLATIONS) + " (default: all of them; dp only "
               "when gc.py ablate runs under mpiexec -n N)")
    _flag(g, "steps", type=int, default=8, metavar="N", help="optimizer steps each row trains")
    _flag(g, "warmup", type=int, default=2, metavar="N", help="steps left out of the T_step median")
    _flag(g, "budget_mb", type=float, default=None, metavar="MB",
          help="the budget row's M_peak bound, in MiB (default: midway between the least M_peak checkpointing can "
               "reach and gc off's, as Budget's planner predicts them; checked before any row runs)")
    g = p.add_argument_group("training and measurement")
    _flag(g, "lazy", action=argparse.BooleanOptionalAction, default=True,
          help="lazy evaluation: ops record the graph and realization computes it (default: lazy)")
    _flag(g, "device", default=None, choices=["cpu", "cuda", "cpu_numpy"],
          help="array backend (default: cuda when available, else cpu)")
    _flag(g, "lr", type=float, default=1e-3, metavar="LR", help="Adam's learning rate")
    _flag(g, "seed", type=int, default=0, metavar="N", help="NumPy seed for the model's initialization")
    g = p.add_argument_group("output")
    _flag(g, "out", default=None, metavar="DIR",
          help="folder for ablation.json, ablation.png and each row's run JSON (default: results/ablation)")
    _flag(g, "progress", action=argparse.BooleanOptionalAction, default=None,
          help="a progress bar on stderr (default: when stderr is a terminal or in a notebook)")
    # what the rows set themselves, or gc.py run's defaults
    p.set_defaults(accumulation_steps=1, epochs=1, max_batches=None, segment_len=None, memory_limit_mb=None,
                   head=None)


SWEEPABLE = ["batch_size", "hidden_size", "embedding_size", "num_layers", "seq_len", "segment_len"]


def build_parser():
    helps = {"run": "gc off vs on for one configuration, side by side (the default)",
             "sweep": "one parameter over several values and policies, a fresh process per run; JSON and plots",
             "max-batch": "the largest batch that trains under --memory-limit-mb, per policy (bisection)",
             "ablate": "every memory technique on the same model and steps, a fresh process per row; one table",
             "plot": "draw, into DIR, the plots of the gc.py JSON files DIR holds (run, sweep, max-batch, ablate)"}
    top = Parser(prog="gc.py", formatter_class=_formatter,
                 usage="python gc.py [run|sweep|max-batch|ablate|plot] [flags]",
                 description=__doc__.split("\n")[0] + "\n\nsubcommands (run is the default):\n"
                             + "".join(f"  {c:11s}{h}\n" for c, h in helps.items()),
                 epilog="python gc.py CMD --help lists CMD's flags and their defaults. Every flag may be spelled with\n"
                        "hyphens or underscores (--batch-size, --batch_size).\n\n" + MEASURES,
                 allow_abbrev=False)
    parsers = {}
    for command in SUBCOMMANDS:
        epilog = MEASURES + "\n\nEvery flag may also be spelled with underscores (--batch_size)."
        p = Parser(prog=f"gc.py {command}", description=f"python gc.py {command}: {helps[command]}.",
                   formatter_class=_formatter, epilog=epilog if command != "plot" else None,
                   usage=f"python gc.py {command} {'DIR' if command == 'plot' else '[flags]'}", allow_abbrev=False)
        if command == "plot":
            p.add_argument("dir", metavar="DIR", help="a folder of gc.py JSON (run, sweep, max-batch or ablate); the "
                                                      "PNGs are written there")
        else:
            _add_model_flags(p, command)
        if command == "sweep":
            g = p.add_argument_group("sweep")
            _flag(g, "over", default="batch_size", type=lambda s: s.replace("-", "_"),
                  choices=SWEEPABLE, help="the parameter to sweep")
            _flag(g, "values", type=int, nargs="+", default=[16, 32, 64, 128], metavar="V",
                  help="its values (positive integers)")
            _flag(g, "repeats", type=int, default=2, metavar="N", help="runs per value and policy (error bars)")
        parsers[command] = p
    return top, parsers


def validate(args, command):
    """Every check that needs no data or model: bad input fails here, before any work."""
    def positive(name, value):
        if value is not None and value < 1:
            fail(f"--{name.replace('_', '-')} must be a positive integer, got {value}")

    if command == "plot":
        return
    if command == "ablate":
        unknown = [r for r in args.rows or [] if r not in ABLATIONS]
        if unknown:
            fail(f"ablate: unknown row{'s' * (len(unknown) > 1)} {' '.join(unknown)} (rows: {' '.join(ABLATIONS)})")
        ranks = dist.comm.launcher_rank_and_size()[1]
        parallel = [r for r in args.rows or default_rows() if ABLATIONS[r][1].get("parallel")]
        if parallel and ranks < 2:
            fail(f"ablate: row {parallel[0]} trains on several processes: run gc.py ablate under mpiexec -n N "
                 f"(N >= 2)")
        if parallel and args.batch_size % ranks:
            fail(f"ablate: row {parallel[0]} splits --batch-size {args.batch_size} over {ranks} ranks: give a "
                 f"multiple of {ranks}")
        if len(set(args.rows or [])) < len(args.rows or []):
            fail(f"ablate: a row is named twice in --rows {' '.join(args.rows)}")
        accumulating = [r for r in args.rows or ABLATIONS if ABLATIONS[r][1].get("accumulate", 1) > 1]
        if accumulating and args.batch_size % ACCUMULATE:
            fail(f"ablate: row {accumulating[0]} trains {ACCUMULATE} micro-batches of --batch-size / {ACCUMULATE}: "
                 f"give a --batch-size that divides by {ACCUMULATE}, not {args.batch_size}")
        if args.budget_mb is not None and "budget" not in (args.rows or ABLATIONS):
            fail("ablate: --budget-mb is the bound of the budget row: add budget to --rows")
    for name in ("batch_size", "seq_len", "embedding_size", "hidden_size", "num_layers", "num_head",
                 "accumulation_steps", "epochs", "max_batches", "segment_len", "repeats", "steps"):
        positive(name, getattr(args, name, None))
    if args.embedding_size % args.num_head:
        fail(f"--num-head {args.num_head} must divide --embedding-size {args.embedding_size}")
    if args.warmup < 0:
        fail(f"--warmup must be 0 or more, got {args.warmup}")
    if not 0 <= args.dropout < 1:
        fail(f"--dropout must be in [0, 1), got {args.dropout:g}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        fail(f"--lr must be a positive number, got {args.lr:g}")
    if not 0 <= args.seed < 2**32:
        fail(f"--seed must be in [0, 2**32), got {args.seed}")
    init_scale = getattr(args, "init_scale", 1.0)
    if not (math.isfinite(init_scale) and init_scale > 0):
        fail(f"--init-scale must be a positive number, got {init_scale:g}")
    if not (math.isfinite(args.head_init_scale) and args.head_init_scale >= 0):
        fail(f"--head-init-scale must be 0 or more, got {args.head_init_scale:g}")
    for name in ("budget_mb", "memory_limit_mb"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            fail(f"--{name.replace('_', '-')} must be a positive number of MiB, got {value:g}")
    if command == "ablate":
        return
    _, ranks = dist.comm.launcher_rank_and_size()  # mpiexec's environment; MPI itself starts later
    if command == "run":
        validate_parallel(args, ranks)
    elif ranks > 1:
        fail(f"gc.py {command} runs in one process, not under mpiexec with {ranks} ranks (gc.py run --parallel and "
             f"gc.py ablate do)")
    if command == "run":
        policies = [args.policy or "all"]
        if args.use_gc == 1 and args.policy == "off":
            fail("--use-gc 1 runs gc on, --policy off runs gc off: give one of them")
        if args.use_gc == 0 and args.policy not in (None, "off"):
            fail(f"--use-gc 0 runs gc off only, so --policy {args.policy} would be ignored: leave one out")
        if args.json and args.use_gc is None and args.policy != "off":
            fail("--json names one run's file; give --use-gc 0 or 1 (or --policy off) with it")
    else:
        policies = args.policies or ["off", "all"]
    if args.budget_mb is not None and "budget" not in policies:
        fail("--budget-mb is the bound of --policy budget: give --policy budget with it" if command == "run" else
             "--budget-mb is the bound of policy budget: add budget to --policies")
    if "budget" in policies and args.budget_mb is None:
        fail("policy budget needs --budget-mb (the M_peak bound, in MiB)")
    if args.segment_len is not None and set(policies) - {"off", "all"}:
        other = sorted(set(policies) - {"off", "all"})[0]
        fail(f"--segment-len sets the checkpoints of policy all; policy {other} chooses its own: give only one")
    if command == "sweep":
        if any(v < 1 for v in args.values):
            fail(f"--values must be positive integers, got {' '.join(map(str, args.values))}")
        if args.over == "segment_len" and set(policies) - {"off", "all"}:
            fail("a sweep over segment_len compares policies off and all only")
        for value in args.values:  # each configuration the sweep will run must be valid too
            trial = argparse.Namespace(**{**vars(args), args.over: value})
            if trial.embedding_size % trial.num_head:
                fail(f"--num-head {trial.num_head} must divide --embedding-size {trial.embedding_size} "
                     f"(the sweep's value {value})")


def validate_parallel(args, ranks):
    """--parallel's checks, the same on every rank (each prints the line and exits 2: no rank is left waiting)."""
    if args.parallel is None:
        if ranks > 1:
            fail(f"gc.py run is under mpiexec with {ranks} ranks: give --parallel dp|zero1|zero2|pipeline (without "
                 f"it every rank would train the same model alone)")
        return
    if not (math.isfinite(args.bucket_mb) and args.bucket_mb > 0):
        fail(f"--bucket-mb must be a positive number of MiB, got {args.bucket_mb:g}")
    if args.parallel != "pipeline" and args.batch_size % ranks:
        fail(f"--parallel {args.parallel}: --batch-size {args.batch_size} does not split over {ranks} ranks: give a "
             f"multiple of {ranks}")
    if args.parallel == "pipeline" and args.precision in ("mixed-bf16", "mixed-fp16"):
        fail(f"--parallel pipeline with --precision {args.precision} is not supported (autocast would have to wrap "
             f"each stage's forward apart from its backward); use fp32 or bf16")
    if args.parallel == "pipeline" and args.policy == "budget":
        fail("--parallel pipeline with --policy budget is not supported: each stage would need its own budget")
    if args.parallel in ("zero2", "pipeline") and args.precision == "mixed-fp16":
        fail(f"--parallel {args.parallel} with --precision mixed-fp16 is not supported: GradScaler's overflow check "
             f"needs every gradient on every rank")


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    top, parsers = build_parser()
    if argv and argv[0] in ("-h", "--help"):
        top.print_help()
        sys.exit(0)
    if argv and argv[0] in SUBCOMMANDS:
        command, rest = argv[0], argv[1:]
    elif argv and not argv[0].startswith("-"):
        close = difflib.get_close_matches(argv[0], SUBCOMMANDS, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        print(f"gc.py: error: {argv[0]!r} is not a subcommand ({', '.join(SUBCOMMANDS)}){hint} "
              f"(see python gc.py --help)", file=sys.stderr)
        sys.exit(BAD_INPUT_EXIT)
    else:
        command, rest = "run", argv
    args = parsers[command].parse_args(rest)
    args.command = command
    validate(args, command)
    return args


def main(argv=None):
    args = parse_args(argv)
    {"run": main_run, "sweep": main_sweep, "max-batch": main_max_batch, "ablate": main_ablate,
     "plot": main_plot}[args.command](args)


if __name__ == "__main__":
    main()
