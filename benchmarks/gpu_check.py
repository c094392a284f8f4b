"""The CUDA backend on a GPU, in one go (issue 51; docs/gpu.md): `make gpu-check OUT=DIR`.

A GPU is lent to this project now and then, for about a quarter of an hour, with nothing reachable from it but the
working tree; so everything is prepared here and runs as one command there, within a deadline (8 minutes by
default), each step in a subprocess with its own time limit, a failure collected rather than fatal:

    1. build    make lib NEEDLE_CUDA=ON CUDA_ARCHS=native (that machine's python3; nothing downloaded)
    2. tests    the CUDA test cases (pytest -k "cuda or gpu" over tests/backend, tests/toolbox, tests/integration)
    3. sanitize compute-sanitizer --tool memcheck over a selection that reaches every kernel
    4. measure  the tables: memory (gc.py ablate's rows on cuda, beside the same rows on cpu) and speed (matmul
                fp32 and bf16 against torch.matmul, attention against scaled_dot_product_attention, the LM step
                against PyTorch CUDA); not yet: the allocator's reserved bytes (docs/gpu.md lists what is missing)

and writes into DIR at most 8 files: summary.json, summary.md (what passed, what failed, the first lines of each
error), a log per step and the CUDA tests' junit XML.

    python benchmarks/gpu_check.py --out DIR      # on a machine with a GPU
    python benchmarks/gpu_check.py --dry-run      # anywhere: its parts import; one line saying no GPU was found

Without a GPU `make gpu-check` runs `make cuda` (the CUDA module compiled for one virtual architecture: make test's
compile check) and then the dry run.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))  # needle from this checkout (the GPU machine installs nothing)
DEADLINE_SECONDS = 480
# Each step's own limit (seconds); a step also stops at the deadline. The build is the longest on 2 cores.
LIMITS = {"build": 240, "tests": 150, "sanitize": 60, "measure": 120}
# Tests that between them launch every kernel (element-wise, strided, matmul, reductions, the fused loss, attention,
# layer norm, dtypes, quantize/compress, the optimizer kernels, dropout, host copies, the allocator).
SANITIZE_SELECTION = ["tests/backend/test_ndarray_ops.py", "tests/backend/test_dtypes.py",
                      "tests/backend/test_adam_step.py", "tests/backend/test_add_matmul.py",
                      "tests/backend/test_memory.py", "tests/toolbox/test_adam8bit_step.py"]
MATMUL_SIZES = (1024, 2048, 4096, 8192)
CUDA_CASES = "cuda or gpu"  # pytest -k: cases parametrized on cuda, and tests marked gpu (cuda alone)


def run_step(name, command, log_path, limit, deadline):
    """Run `command`, its output appended to log_path; the step's record (a failure is recorded, not raised)."""
    limit = max(1, min(limit, int(deadline - time.monotonic())))
    started = time.monotonic()
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(command)}  (limit {limit} s)\n")
        log.flush()
        try:
            rc = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        except OSError as e:  # the command is missing (compute-sanitizer outside the CUDA toolkit's PATH, say)
            log.write(f"{type(e).__name__}: {e}\n")
            rc = "not run"
    with open(log_path) as log:
        tail = log.read().splitlines()[-8:]
    return {"step": name, "rc": rc, "ok": rc == 0, "seconds": round(time.monotonic() - started, 1),
            "log": os.path.basename(log_path), "tail": tail}


def junit_counts(path):
    """passed / failed / skipped of a junit XML, and the first lines of each failure (test id: message)."""
    if not os.path.exists(path):
        return {"passed": 0, "failed": 0, "skipped": 0, "failures": ["no junit report: the tests did not run"]}
    counts, failures = {"passed": 0, "failed": 0, "skipped": 0}, []
    for case in ET.parse(path).getroot().iter("testcase"):
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            counts["failed"] += 1
            first = (problem.get("message") or problem.text or "").strip().splitlines()[:3]
            failures.append(f"{case.get('classname')}::{case.get('name')}: {' | '.join(first)}")
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures}


def sanitizer_errors(text):
    """The errors compute-sanitizer reported: the sum of its "ERROR SUMMARY: N errors" lines (None if none seen)."""
    found = [int(n) for n in re.findall(r"^=+ ERROR SUMMARY: (\d+) error", text, flags=re.MULTILINE)]
    return sum(found) if found else None


def render_markdown(summary):
    """summary.md: the GPU, each step's outcome, the tables, and the first lines of every failure."""
    lines = [f"# gpu-check on {summary['gpu']}", "", f"commit {summary['commit']}, {summary['started']}", "",
             "| step | result | seconds |", "| --- | --- | ---: |"]
    lines += [f"| {s['step']} | {'ok' if s['ok'] else s['rc']} | {s['seconds']} |" for s in summary["steps"]]
    t = summary.get("tests")
    if t:
        lines += ["", f"CUDA test cases: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped"]
    if "sanitizer_errors" in summary:
        lines += [f"compute-sanitizer memcheck: {summary['sanitizer_errors']} errors reported"]
    for title, rows in summary.get("tables", {}).items():
        if rows:
            keys = list(rows[0])
            lines += ["", f"## {title}", "", "| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
            lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    problems = (t or {}).get("failures", []) + [f"{s['step']}: {' | '.join(s['tail'][-3:])}"
                                               for s in summary["steps"] if not s["ok"]]
    if problems:
        lines += ["", "## Failures (first lines)", ""] + [f"- {p}" for p in problems]
    return "\n".join(lines) + "\n"


# ----- measurements (step 4, in its own process: `--measure DIR`) ------------------------------------------------
def timed(fn, sync, repeats=5):
    """Median seconds of fn() over `repeats` calls after one warm-up, `sync` waiting for the device each time."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def matmul_rows():
    """fp32 (TF32 off) and bf16 matmul: needle's cuda() against torch.matmul, TFLOP/s and the ratio."""
    import numpy as np
    import torch

    from needle import backend_ndarray as nd

    torch.backends.cuda.matmul.allow_tf32 = False
    device, rows = nd.cuda(), []
    for n in MATMUL_SIZES:
        for dtype in ("float32", "bfloat16"):
            host = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
            a = nd.array(host, device=device).astype(dtype)
            ta = torch.tensor(host, device="cuda").to(getattr(torch, dtype))
            ours = timed(lambda: a @ a, needle_sync, repeats=3)
            theirs = timed(lambda: ta @ ta, torch.cuda.synchronize, repeats=3)
            flops = 2.0 * n**3
            rows.append({"n": n, "dtype": dtype, "needle TFLOP/s": round(flops / ours / 1e12, 2),
                         "torch TFLOP/s": round(flops / theirs / 1e12, 2), "needle / torch": round(theirs / ours, 2)})
    return rows


def attention_rows():
    """Fused causal attention forward, (8, 8, 1024, 64): needle's cuda() against scaled_dot_product_attention."""
    import numpy as np
    import torch

    from needle import backend_ndarray as nd

    shape, rows = (8, 8, 1024, 64), []
    for dtype in ("float32", "bfloat16"):
        host = [np.random.default_rng(i).standard_normal(shape).astype(np.float32) for i in range(3)]
        q, k, v = (nd.array(h, device=nd.cuda()).astype(dtype) for h in host)
        tq, tk, tv = (torch.tensor(h, device="cuda").to(getattr(torch, dtype)) for h in host)
        ours = timed(lambda: nd.attention_forward(q, k, v, shape[-1] ** -0.5, causal=True), needle_sync)
        theirs = timed(lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True),
                       torch.cuda.synchronize)
        rows.append({"shape": "x".join(map(str, shape)), "dtype": dtype, "needle ms": round(ours * 1e3, 3),
                     "torch ms": round(theirs * 1e3, 3), "needle / torch": round(ours / theirs, 2)})
    return rows


def lm_rows():
    """bench_step's benchmark model, one training step: needle on cuda() (gc off, "all") against PyTorch CUDA."""
    import torch

    import needle as ndl

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    sys.path.insert(0, os.path.join(ROOT, "apps"))
    import bench_step

    args = argparse.Namespace(batch_size=128, seq_len=32, embedding_size=256, hidden_size=256, num_layers=4,
                              num_head=4, vocab=10000)
    theirs = timed(bench_step.torch_step_fn(args, device="cuda"), torch.cuda.synchronize)
    rows = [{"step": "pytorch", "ms": round(theirs * 1e3, 2), "x pytorch": 1.0}]
    for name, gc in (("needle, gc off", False), ("needle, gc all", True)):
        ours = timed(bench_step.needle_step_fn(args, gc, device=ndl.cuda()), needle_sync)
        rows.append({"step": name, "ms": round(ours * 1e3, 2), "x pytorch": round(ours / theirs, 2)})
    return rows


def needle_sync():
    """Wait for cuda()'s queue: a one-element result copied to the host comes after everything launched before."""
    import numpy as np

    from needle import backend_ndarray as nd

    (nd.array(np.zeros(1, np.float32), device=nd.cuda()) + 1).numpy()


def memory_rows():
    """gc.py ablate's memory rows on cuda beside the same rows on cpu (whose allocator the ledger predicts)."""
    rows, scratch = {}, tempfile.mkdtemp(prefix="gpu-check-")  # ablate's files stay out of DIR
    for device in ("cuda", "cpu"):
        folder = os.path.join(scratch, f"ablate-{device}")
        subprocess.run([sys.executable, "gc.py", "ablate", "--device", device, "--steps", "4", "--rows", "baseline",
                        "all", "sqrt", "selective", "budget", "--out", folder, "--no-progress"], cwd=ROOT,
                       check=True, capture_output=True, timeout=LIMITS["measure"])
        with open(os.path.join(folder, "ablation.json")) as f:
            data = json.load(f)
        for r in data["rows"] if isinstance(data, dict) else data:
            rows.setdefault(r["row"], {})[device] = r
    table = []
    for name, by_device in rows.items():
        gpu, cpu = by_device.get("cuda", {}), by_device.get("cpu", {})
        with open(gpu["json"]) as f:  # GPUtil's reading; None where GPUtil is not installed
            readings = [s["gpu_memory_bytes"] for s in json.load(f)["steps"] if s.get("gpu_memory_bytes") is not None]
        driver = max(readings, default=None)
        table.append({"row": name, "M_act MB": mb(gpu.get("activation_bytes")),
                      "M_peak MB": mb(gpu.get("peak_activation_bytes")), "step peak MB": mb(gpu.get("peak_bytes")),
                      "driver MB (GPUtil)": mb(driver), "cpu M_peak MB": mb(cpu.get("peak_activation_bytes")),
                      "loss cuda": gpu.get("loss"), "loss cpu": cpu.get("loss")})
    return table


def mb(n):
    return None if n is None else round(n / 2**20, 1)


def measure(out):
    """Every table that can be measured, each one's error recorded instead of stopping the others."""
    tables, errors = {}, {}
    for title, fn in (("memory on the GPU (gc.py ablate, 4 steps)", memory_rows), ("matmul", matmul_rows),
                      ("attention", attention_rows), ("the LM step", lm_rows)):
        try:
            tables[title] = fn()
        except Exception as e:  # noqa: BLE001 (a table that fails is reported, the others still measured)
            errors[title] = f"{type(e).__name__}: {e}"[:500]
    with open(os.path.join(out, "tables.json"), "w") as f:
        json.dump({"tables": tables, "errors": errors}, f, indent=1)


# ----- the check --------------------------------------------------------------------------------------------------
def gpu_name():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
        return out.stdout.strip() or "an NVIDIA GPU"
    except (OSError, subprocess.SubprocessError):
        return "an NVIDIA GPU (nvidia-smi not found)"


def steps_for(out):
    """(name, command) of the check's four steps, in order."""
    python, junit = sys.executable, os.path.join(out, "cuda-tests.xml")
    return [("build", ["make", "lib", "NEEDLE_CUDA=ON", "CUDA_ARCHS=native", f"PYTHON={python}",
                       f"JOBS={os.cpu_count() or 2}"]),
            ("tests", [python, "-m", "pytest", "-q", "-k", CUDA_CASES, f"--junitxml={junit}", "-p",
                       "no:cacheprovider", "tests/backend", "tests/toolbox", "tests/integration"]),
            ("sanitize", ["compute-sanitizer", "--tool", "memcheck", python, "-m", "pytest", "-q", "-x", "-k",
                          CUDA_CASES, "-p", "no:cacheprovider", *SANITIZE_SELECTION]),
            ("measure", [python, os.path.abspath(__file__), "--measure", out])]


def check(out, deadline_seconds, steps=None):
    """Run the steps (steps_for(out) unless given) within the deadline; write summary.json and summary.md."""
    os.makedirs(out, exist_ok=True)
    deadline = time.monotonic() + deadline_seconds
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    summary = {"gpu": gpu_name(), "commit": commit.stdout.strip() or "unknown",
               "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "steps": []}
    junit = os.path.join(out, "cuda-tests.xml")
    for name, command in steps or steps_for(out):
        if time.monotonic() >= deadline:
            summary["steps"].append({"step": name, "rc": "deadline", "ok": False, "seconds": 0, "tail": []})
            continue
        limit = LIMITS.get(name, deadline_seconds)
        summary["steps"].append(run_step(name, command, os.path.join(out, f"{name}.log"), limit, deadline))
    summary["tests"] = junit_counts(junit)
    if os.path.exists(os.path.join(out, "sanitize.log")):
        with open(os.path.join(out, "sanitize.log")) as f:
            summary["sanitizer_errors"] = sanitizer_errors(f.read())
    if os.path.exists(os.path.join(out, "tables.json")):
        with open(os.path.join(out, "tables.json")) as f:
            measured = json.load(f)
        summary["tables"], summary["table_errors"] = measured["tables"], measured["errors"]
        os.remove(os.path.join(out, "tables.json"))  # folded into summary.json: the folder keeps at most 8 files
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(render_markdown(summary))
    print(render_markdown(summary))
    return summary


def dry_run():
    """Without a GPU: the parts this script imports on the GPU machine import here, and one line says so."""
    import needle  # noqa: F401
    from needle import backend_ndarray as nd

    sys.path[:0] = [os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "apps")]
    import bench_step  # noqa: F401  (the LM step's table builds both models with it)

    found = nd.cuda().enabled()
    print("gpu-check: no GPU found (cuda() is not enabled here): nothing run or measured (`make gpu-check` compiles "
          "the CUDA module first, as make test does)" if not found else
          "gpu-check: a GPU is here: run `make gpu-check OUT=DIR` for the whole check")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="gpu-check", help="the folder for the summary and logs (at most 8 files)")
    p.add_argument("--dry-run", action="store_true", help="no GPU: check this script's parts import, print one line")
    p.add_argument("--deadline", type=int, default=DEADLINE_SECONDS, help="seconds for the whole check")
    p.add_argument("--measure", metavar="DIR", help=argparse.SUPPRESS)  # step 4, in its own process
    args = p.parse_args()
    if args.dry_run:
        dry_run()
    elif args.measure:
        measure(args.measure)
    else:
        check(args.out, args.deadline)


if __name__ == "__main__":
    main()
