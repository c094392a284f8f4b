"""The JSON a run writes: its whole configuration, a record per step, and their summary; strict JSON (no NaN),
written whole or not at all.  Memory in bytes, times in seconds, everywhere."""
import functools
import json
import math
import os
import statistics
import subprocess
import time

import numpy as np

from needle import distributed as dist

from . import ROOT
from .console import fail
from .measure import threads
from .outputs import regular_file_target

# The earlier project's keys, kept next to the canonical ones (docs/experiment.md).
ALIASES = {"time": "step_time_seconds", "time_per_batch_median": "step_time_seconds", "peak memory": "peak_bytes",
           "use_gc": "policy != 'off'"}
MIN_TIMED_STEPS = 3  # a median of fewer step times is flagged as unreliable


@functools.cache
def needle_commit():
    """`git rev-parse HEAD` of this checkout, or None where that is unavailable (no git, not a repository)."""
    try:
        proc = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None


def config_of(config, source, vocab, device):
    """The whole configuration of a run, as the JSON records it (memory in bytes, like every figure)."""
    mb_to_bytes = lambda mb: None if mb is None else int(mb * 2**20)  # noqa: E731
    batch = config.batch_size  # max-batch searches it
    return {
        "data": source, "vocab_size": int(vocab), "batch_size": batch,
        "accumulation_steps": config.accumulation_steps,
        "effective_batch_size": None if batch is None else batch * config.accumulation_steps,
        "seq_len": config.seq_len, "embedding_size": config.embedding_size, "hidden_size": config.hidden_size,
        "num_layers": config.num_layers, "seq_model": config.seq_model, "num_head": config.num_head,
        "dropout": config.dropout,
        "activation": config.activation, "activation_bits": config.activation_bits,
        "compress_bits": config.compress_bits,
        "head_init_scale": config.head_init_scale, "head": config.head, "precision": config.precision,
        "stochastic_rounding": bool(config.stochastic_rounding),
        "init_scale": config.init_scale if config.precision == "mixed-fp16" else None,
        "segment_len": config.segment_len, "budget_bytes": mb_to_bytes(config.budget_mb),
        "budget_offload": bool(config.offload),
        "host_bandwidth_bytes_per_second": None if config.host_bandwidth is None else config.host_bandwidth * 1e9,
        "lazy": config.lazy,
        "device": str(device), "threads": threads(), "epochs": config.epochs, "max_batches": config.max_batches,
        "warmup": config.warmup, "lr": config.lr, "optimizer": config.optimizer,
        "optimizer_in_backward": bool(config.optimizer_in_backward),
        "offload_state": bool(config.offload_state), "seed": config.seed, "parallel": config.parallel,
        "bucket_bytes": mb_to_bytes(config.bucket_mb) if config.parallel else None,
        "world_size": dist.world_size() if config.parallel else 1,
        "memory_limit_bytes": mb_to_bytes(config.memory_limit_mb), "needle_commit": needle_commit(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": ["gc.py", *config.argv],
    }


# The keys config_of writes that say what a run is. Runs equal in all of them are repeats of one configuration,
# drawn as one bar with its spread (plot.py); the seed, and when and by what command line a run started, are not
# among them: repeats differ there.
CONFIG_KEYS = ("data", "vocab_size", "batch_size", "accumulation_steps", "effective_batch_size", "seq_len",
               "embedding_size", "hidden_size", "num_layers", "seq_model", "num_head", "dropout", "activation",
               "activation_bits", "compress_bits", "head_init_scale", "head", "precision", "stochastic_rounding",
               "init_scale", "segment_len", "budget_bytes", "budget_offload", "host_bandwidth_bytes_per_second", "lazy",
               "device", "threads", "epochs", "max_batches", "warmup", "lr", "optimizer", "optimizer_in_backward",
               "offload_state", "parallel",
               "bucket_bytes", "world_size", "memory_limit_bytes")
REPEAT_KEYS = ("seed", "needle_commit", "started_at", "argv")


def summarize(record, warmup):
    """The record's summary of its steps so far: medians and maxima over the timed steps (after `warmup`)."""
    steps = [s for s in record["steps"] if not s.get("traced")]
    after = steps[warmup:]
    timed = [s for s in after if not s.get("recorded")]  # the recorded step paid for its recording: not timed
    steps = after or steps or record["steps"]  # too few steps: the warm-up ones, flagged below
    clocked = timed or [s for s in steps if not s.get("recorded")] or steps
    t_step = statistics.median(s["time_seconds"] for s in clocked)
    peak = max(s["peak_bytes"] for s in steps)
    recorded = next((s for s in reversed(record["steps"]) if s.get("recorded")), {})
    record.update({
        "step_time_seconds": t_step, "timed_steps": len(timed), "step_time_reliable": len(timed) >= MIN_TIMED_STEPS,
        "time": t_step, "time_per_batch_median": t_step,  # the earlier project's names (ALIASES)
        "peak_bytes": peak, "peak memory": peak,
        # the step's peak of all live bytes by category, as the recorded step (the last) had it: its values sum
        # to that step's peak_bytes (measure.peak_split); None until it is recorded, and under --parallel
        "peak_by_category": recorded.get("peak_by_category"), "peak_phase": recorded.get("peak_phase"),
        "peak_split_step": recorded.get("step"),
        "peak_activation_bytes": max(s["peak_activation_bytes"] for s in steps),
        "step_peak_bytes": max(s["step_peak_bytes"] for s in steps),
        "activation_bytes": max(s["activation_bytes"] for s in steps),
        "floor_bytes": min((s["floor_bytes"] for s in steps if s["floor_bytes"] is not None), default=None),
        "loss": record["steps"][-1]["loss"],
        "recomputed_nodes": record["steps"][-1]["recomputed_nodes"],
        "skipped_steps": sum(bool(s.get("skipped_step")) for s in record["steps"]),  # GradScaler's overflows
        "loss_scale": record["steps"][-1].get("loss_scale"),
        **{key: record["steps"][-1].get(key) for key in ("param_bytes", "grad_bytes", "optimizer_bytes",
                                                         "offloaded_bytes")},
        "rss_peak_bytes": max((s["rss_peak_bytes"] for s in steps if s.get("rss_peak_bytes") is not None),
                              default=None),
        "tokens_per_second": record["effective_batch_size"] * record["seq_len"] / t_step if t_step else None,
    })
    record.update(offload_summary(record["steps"][-1], steps))
    last = record["steps"][-1]
    if "ranks" in last:  # --parallel: every rank's memory, the last step's communication or pipeline figures
        record["per_rank"] = last["ranks"]
    if "sync" in last:
        record["sync"] = last["sync"]
    if "tensor_parallel" in last:  # the tensor-parallel collectives of the last step (comm.traffic)
        record["tensor_parallel"] = last["tensor_parallel"]
    if "pipeline" in last:
        record["pipeline"] = {**last["pipeline"], "bubble_median": statistics.median(
            s["pipeline"]["bubble_mean"] for s in steps)}


def offload_summary(last, steps):
    """Offloading's figures over the timed `steps`: the most host memory held (M_host), the median exposed copy
    seconds and hidden share; the bytes copied each way, as the `last` step copied them."""
    def median(key):
        values = [s[key] for s in steps if s.get(key) is not None]
        return statistics.median(values) if values else None

    return {"host_peak_bytes": max((s.get("host_peak_bytes") or 0 for s in steps), default=0),
            "copy_seconds_exposed": median("copy_seconds_exposed"),
            "copy_hidden_fraction": median("copy_hidden_fraction"),
            **{key: last.get(key) for key in ("activation_offloaded_bytes", "activation_fetched_bytes",
                                              "fetched_nodes")}}


def json_safe(x):
    """x with every float that is not finite (NaN, +-Infinity) replaced by None, recursively; NumPy scalars as
    Python numbers.  JSON has no NaN: json.dump would write a bare NaN that strict parsers reject."""
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_json(path, record):
    """record as strict JSON at path, whole or not at all, even with another process writing the same name.  The
    paths were checked before any work (outputs.py); should writing fail all the same (the disk full, the folder
    made read-only, a folder put at `path` meanwhile), that is one line and exit status 2, and the temporary file
    is removed: a failed write leaves `path` as it was and nothing beside it.  A symbolic link is written through;
    a name that is not a regular file (a device, a FIFO) is refused, never replaced (outputs.regular_file_target)."""
    try:
        path = regular_file_target(path)
    except ValueError as why:
        fail(f"cannot write {path}: it {why}")
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(json_safe(record), f, indent=1, allow_nan=False)
        os.replace(tmp, path)
    except OSError as err:
        remove_quietly(tmp)
        fail(f"cannot write {path}: {err.strerror or err}")
    except BaseException:  # also Ctrl-C half-way through the dump
        remove_quietly(tmp)
        raise


def remove_quietly(path):
    try:
        os.remove(path)
    except OSError:
        pass


def read_json(path):
    with open(path) as f:
        return json.load(f)
