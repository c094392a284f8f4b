"""Compare a benchmark between this working tree and an earlier revision, interleaved, on the same machine.

    python benchmarks/compare_revisions.py --base HEAD~1 --repeats 5
    python benchmarks/compare_revisions.py --base main -- benchmarks/bench_gc.py --policies off all

Checks out `--base` into a temporary git worktree that uses this tree's compiled modules (so only the Python
side differs; pass `--build` when the C++ changed too, to build the base in its own folder), then runs the
benchmark command alternately in the base and in this tree, `--repeats` times each. Every line of the
benchmark's output that ends in numbers is collected per label, and the medians are printed side by side with
their ratio. Both sides run this tree's benchmarks/ scripts (one harness, two libraries). Alternating runs on
a shared machine spreads its noise over both sides.
"""
import argparse
import glob
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = os.path.join("python", "needle", "backend_ndarray")
ROW = re.compile(r"^(?P<label>\S.*?)\s+(?P<value>-?\d+\.\d+)(\s+.*)?$")


# An editable install redirects `import needle` to its own checkout whatever sys.path says; the benchmark in each
# tree must import that tree's package, so the redirecting finder is taken out before the script runs.
LAUNCH = ("import runpy, sys; sys.meta_path[:] = [f for f in sys.meta_path if 'Redirect' not in type(f).__name__]; "
          "sys.path.insert(0, 'python'); script = sys.argv[1]; sys.argv = sys.argv[1:]; "
          "runpy.run_path(script, run_name='__main__')")


def run(tree, command):
    out = subprocess.run([sys.executable, "-c", LAUNCH, *command], cwd=tree, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"compare_revisions: {' '.join(command)} failed in {tree}:\n{out.stderr[-2000:]}")
    rows = {}
    for line in out.stdout.splitlines():
        m = ROW.match(line.strip())
        if m:
            rows[m.group("label")] = float(m.group("value"))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", default="HEAD", help="the revision to compare against (default HEAD)")
    p.add_argument("--repeats", type=int, default=5, help="runs of the benchmark in each tree (default 5)")
    p.add_argument("--build", action="store_true", help="build the base's own compiled modules")
    p.add_argument("command", nargs="*", help="benchmark and its arguments (default: bench_step, needle only)")
    args = p.parse_args()
    command = args.command or ["benchmarks/bench_step.py", "--no-torch", "--rounds", "1", "--repeats", "3"]
    base = tempfile.mkdtemp(prefix="needle-base-")
    subprocess.run(["git", "worktree", "add", "--detach", base, args.base], cwd=ROOT, check=True,
                   capture_output=True)
    try:
        for script in glob.glob(os.path.join(ROOT, "benchmarks", "*.py")):  # one harness, two libraries
            shutil.copy(script, os.path.join(base, "benchmarks"))
        if args.build:
            subprocess.run(["make", "lib", "BUILD_DIR=build-base", "NEEDLE_CUDA=OFF"], cwd=base, check=True)
        else:
            for module in glob.glob(os.path.join(ROOT, MODULES, "*.so")):
                shutil.copy(module, os.path.join(base, MODULES))
        results = {"base": {}, "this": {}}
        for i in range(args.repeats):
            for side, tree in (("base", base), ("this", ROOT)):
                for label, value in run(tree, command).items():
                    results[side].setdefault(label, []).append(value)
            print(f"compare_revisions: round {i + 1}/{args.repeats} done", file=sys.stderr)
        print(f"{args.base} vs this tree, {args.repeats} interleaved runs of: {' '.join(command)}")
        print(f"{'':28s}{'base':>10s}{'this':>10s}{'this/base':>11s}")
        for label, values in results["base"].items():
            if label in results["this"]:
                b, t = statistics.median(values), statistics.median(results["this"][label])
                print(f"{label[:28]:28s}{b:10.3f}{t:10.3f}{t / b if b else float('nan'):11.3f}")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", base], cwd=ROOT, capture_output=True)


if __name__ == "__main__":
    main()
