"""How long README's two Quick-start commands take on a fresh clone, in a fresh virtual environment.

    python benchmarks/fresh_clone.py               # make demo fresh; make test, then make demo twice (~7 min)
    python benchmarks/fresh_clone.py --skip-test   # the demos only

Clones the committed HEAD of this repository into a temporary folder, with ../shared (the reduced PTB) copied beside
it as the Quick start expects, makes a virtual environment there (`python -m venv`, no system site packages; pip's
download cache is used as it would be), and times, as a new user would run them from the clone's root: `make demo`
in a clone and environment of its own (it installs its part, builds, runs); then, in a second one, `make test`
(installs, builds, lints, runs the suite), `make demo` (installed and built: the run alone), and `make demo` again
while one other process spins on a core (`python -c "while True: pass"`). Prints a Markdown table on stdout (the
commands' own output goes to a log in the temporary folder; its last lines are shown on stderr if one fails), each
against the goal of issue 27 on a 2-core machine. A command that fails is a row that says so (with `make test`'s
last line, pytest's summary), not a missing table.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

from md_table import markdown_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOALS = {"test": 8 * 60, "demo": 60, "demo, busy": 2 * 60}  # seconds


def find_shared(explicit):
    """../shared next to this checkout, or the folder that data/ptb links into (its ../..), or `explicit`."""
    candidates = [explicit] if explicit else [
        os.path.join(ROOT, "..", "shared"),
        os.path.dirname(os.path.dirname(os.path.realpath(os.path.join(ROOT, "data", "ptb"))))]
    for path in candidates:
        if os.path.isfile(os.path.join(path, "data", "ptb", "train.txt")):
            return os.path.abspath(path)
    raise SystemExit(f"fresh_clone: no shared folder with data/ptb/train.txt among {candidates} (--shared DIR)")


def clean_env(venv):
    """The environment of a new user who activated the virtual environment (no PYTHONPATH, no other venv)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["VIRTUAL_ENV"] = venv
    env["PATH"] = os.path.join(venv, "bin") + os.pathsep + env["PATH"]
    return env


def timed(argv, cwd, env, log):
    """(seconds, exit status, the output's last non-empty line) of one command, its output appended to `log`."""
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(argv)}\n")
        f.flush()
        start = time.time()
        code = subprocess.run(argv, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
        seconds = time.time() - start
    with open(log) as f:
        lines = [line.strip() for line in f if line.strip()]
    if code != 0:
        print("\n".join(lines[-40:]), file=sys.stderr)
    return seconds, code, lines[-1] if lines else ""


def fresh_clone(top, name, commit):
    """(the clone, its environment, its python): `commit` cloned into top/name, beside top/shared, with a new
    virtual environment top/name-venv."""
    clone, venv = os.path.join(top, name), os.path.join(top, f"{name}-venv")
    subprocess.run(["git", "clone", "-q", "--no-checkout", ROOT, clone], check=True)
    subprocess.run(["git", "-C", clone, "checkout", "-q", commit], check=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    return clone, clean_env(venv), os.path.join(venv, "bin", "python")


def minutes(seconds):
    return f"{int(seconds // 60)} min {seconds % 60:.0f} s" if seconds >= 60 else f"{seconds:.0f} s"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--skip-test", action="store_true", help="time the two demos only")
    p.add_argument("--shared", default=None, help="the folder copied beside the clone as ../shared")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (its path goes to stderr)")
    args = p.parse_args()
    shared = find_shared(args.shared)
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    top = tempfile.mkdtemp(prefix="fresh_clone_")
    log = os.path.join(top, "make.log")
    print(f"fresh_clone: {commit[:12]} into {top}, ../shared from {shared}; log {log}", file=sys.stderr)
    shutil.copytree(shared, os.path.join(top, "shared"), symlinks=True)
    clone, env, python = fresh_clone(top, "demo", commit)
    runs = [("make demo", "fresh clone and environment: install its part, build, run", "demo",
             timed(["make", "demo", f"PYTHON={python}"], clone, env, log))]
    clone, env, python = fresh_clone(top, "needle", commit)
    if not args.skip_test:
        runs.append(("make test", "fresh clone and environment: install, build, lint, the suite", "test",
                     timed(["make", "test", f"PYTHON={python}"], clone, env, log)))
    quiet = "after make test: nothing else started" if len(runs) > 1 else "fresh again: nothing else started"
    runs.append(("make demo", quiet, "demo", timed(["make", "demo", f"PYTHON={python}"], clone, env, log)))
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        runs.append(("make demo", "and one other busy process", "demo, busy",
                     timed(["make", "demo", f"PYTHON={python}"], clone, env, log)))
    finally:
        busy.kill()
        busy.wait()
    if not args.keep:
        shutil.rmtree(top, ignore_errors=True)
    rows = [[f"`{command}`", condition, minutes(seconds), f"≤ {minutes(GOALS[goal])}",
             ("met" if seconds <= GOALS[goal] else "missed") if code == 0 else f"failed (exit {code})",
             last if command == "make test" else ""]
            for command, condition, goal, (seconds, code, last) in runs]
    print(markdown_table(["command", "condition", "wall time", "goal", "", "last line"], rows, right=(2,)))


if __name__ == "__main__":
    main()
