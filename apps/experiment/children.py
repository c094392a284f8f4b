"""sweep, max-batch and ablate run each configuration as a child `gc.py run` process: a fresh interpreter, so no
run's memory (the allocator's cache, Python's heap) counts in the next one's.  A child's command line is derived
from the `run` parser's own flags, so a flag added there reaches the children with no second list to update."""
import os
import subprocess
import sys
import time
from dataclasses import replace

from needle import distributed as dist

from . import ENTRY_POINT
from .parser import subcommand_parser

# The `gc.py run` flags a child gets from run_child itself rather than from the parent's configuration.
SET_BY_CHILD = {"help", "data", "policy", "use_gc", "json", "out", "progress", "lazy"}
BUDGET_FLAGS = {"budget_mb", "offload", "host_bandwidth"}  # what only a child with policy budget reads


def child_argv(config, source, overrides, policy, json_path):
    """`gc.py run`'s arguments for one configuration: the parent's config with `overrides` (dests of run's flags),
    gc off or on with `policy`, writing its record to exactly json_path, with no progress bar."""
    flags = [action for action in subcommand_parser("run").flags() if action.dest not in SET_BY_CHILD]
    unknown = sorted(set(overrides) - {action.dest for action in flags})
    if unknown:
        raise ValueError(f"run_child: {', '.join(unknown)} is not a flag of gc.py run")
    settings = vars(replace(config, **overrides))
    # gc off stays exact: --compress-bits reaches a gc-off child only where the overrides ask (ablate's compress row)
    compress = settings["compress_bits"] if policy != "off" or "compress_bits" in overrides else None
    argv = ["run", "--policy", policy, "--use-gc", str(int(policy != "off" or compress is not None)), "--json",
            os.path.abspath(json_path), "--data", source, "--no-progress"]
    for action in flags:
        value = compress if action.dest == "compress_bits" else settings[action.dest]
        if value is None or value is False or (action.dest == "segment_len" and policy != "all") or \
                (action.dest in BUDGET_FLAGS and policy != "budget"):
            continue
        argv += [action.option_strings[0]] + ([] if action.nargs == 0 else [str(value)])
    argv.append("--lazy" if settings["lazy"] else "--no-lazy")
    return argv


def run_child(config, source, overrides, policy, json_path, timeout=1800):
    """Run one configuration in a fresh process that writes its record to exactly json_path (chosen by the
    parent, so that two sweeps sharing an --out folder never read each other's files); (exit status, its output)."""
    cmd = [sys.executable, ENTRY_POINT] + child_argv(config, source, overrides, policy, json_path)
    if overrides.get("parallel", config.parallel):  # a job of its own, as many ranks as this gc.py was started with
        _, ranks = dist.comm.launcher_rank_and_size()
        cmd = [dist.comm.mpiexec_path() or "mpiexec", "-n", str(ranks)] + cmd
    # Under mpiexec a child must not take itself for one of this job's ranks: the launcher's variables go.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dist.comm.child_environment())
    return proc.returncode, proc.stdout + proc.stderr


def invocation_id():
    """Names this sweep's (or max-batch search's, or ablation's) files apart from any other run's in the folder."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{os.urandom(3).hex()}"


def last_line(log):
    lines = [ln for ln in log.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"
