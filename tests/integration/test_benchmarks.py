"""The benchmarks behind the figures still run: each at a toy size, its table printed (the figures' own runs take
minutes; a benchmark that no test runs broke unseen once: bench_offload_overhead read a stats key that only a step
with a store in use has)."""
import subprocess
import sys
from pathlib import Path

import pytest

import needle as ndl

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not ndl.cpu().enabled(), reason="the compiled CPU backend is not built")

TOY = ["--layers", "4", "--embedding", "32", "--vocab", "100", "--batch", "4", "--seq_len", "8"]


def bench(*argv):
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_offload_overhead.py"), *argv],
                          capture_output=True, text=True, timeout=300, cwd=REPO)


def test_bench_offload_overhead_prints_its_table_at_a_toy_size():
    done = bench(*TOY, "--budgets", "2", "--rounds", "2", "--markdown")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "MB" in line]
    assert len(rows) == 2, done.stdout  # one row per budget, gc off's line above the table
    assert all(line.count("|") == 9 for line in rows)


def test_bench_offload_overhead_refuses_a_single_round_with_one_line():
    done = bench(*TOY, "--rounds", "1", "--markdown")
    assert done.returncode == 2 and "--rounds must be at least 2" in done.stderr and "Traceback" not in done.stderr
