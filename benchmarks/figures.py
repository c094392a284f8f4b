"""Every table of measured figures in README.md and docs/, generated: the registry, and the command that writes them.

    python benchmarks/figures.py                     # every figure (long: about an hour on 2 cores); `make figures`
    python benchmarks/figures.py --stale             # list the figures whose measured code changed since their
                                                     # stamp, and what changed (runs nothing)
    python benchmarks/figures.py --run-stale         # regenerate exactly those
    python benchmarks/figures.py --only demo rss     # these
    python benchmarks/figures.py --list              # every figure: name, page, fresh or stale

A figure is one entry of FIGURES: the command that measures it (a benchmark or gc.py that prints the Markdown
table on stdout), the page it goes to, and `measures`, the repository paths whose content the numbers depend on.
Its table lives in the page between two markers, under a stamp that says how it was made:

    <!-- figure: NAME -->
    *`python benchmarks/figures.py --only NAME` ran `COMMAND` at commit 0123456789ab on 2026-01-31 12:00 UTC, on
    CPU, N cores, load average L at the start; S s.*

    | the table |
    <!-- /figure: NAME -->

A figure is stale when any of its `measures` paths differs between the stamp's commit and the working tree
(`git diff <commit> -- PATHS`, or an untracked file there) in what runs: a Python file whose code is the same once
docstrings are set aside (comments and layout are not in its syntax tree) measures the same, so rewording a
docstring leaves the figures fresh. `quickstart-times` is the exception: the fresh clone's `make test` lints the
text and runs the tests, so any change to it counts. A stale figure is information, not an error: its stamp still
says truthfully which commit it measured, `--stale` lists it, and regenerating it is a separate, deliberate step
(`--run-stale`, `--only NAME` or `make figures`). tests/integration/test_figures.py fails only on what is wrong
whatever the code: a measured table outside a figure block, a block without a well-formed stamp, a figure the
registry does not know, a stamp whose command is not the registry's, or one stamped "dirty". So that a stamp never
names a commit that does not hold the code it ran, this script refuses to stamp a figure while its `measures` have
uncommitted changes (`--allow-dirty` stamps "dirty", which the test rejects).
"""
import argparse
import ast
import datetime
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What the numbers depend on, by layer.  The CPU backend: the kernels, their bindings, the build flags, NDArray.
BACKEND = ("src/cpu/", "src/ndarray_backend_cpu.cc", "CMakeLists.txt", "python/needle/backend_ndarray/",
           "python/needle/backend_selection.py")
# A training step of the Transformer LM: the graph, backward, checkpointing, every op and layer, the optimizers,
# the data, the package's set-up (the thread policy) and the model itself.
STEP = BACKEND + ("python/needle/__init__.py", "python/needle/autograd.py", "python/needle/backward.py",
                  "python/needle/checkpoint.py", "python/needle/checkpoint_budget.py", "python/needle/store.py",
                  "python/needle/ledger.py", "python/needle/regions.py", "python/needle/costs.py",
                  "python/needle/memory_hook.py", "python/needle/ops/", "python/needle/nn/", "python/needle/init/",
                  "python/needle/optim/", "python/needle/data/", "python/needle/toolbox/", "apps/models.py")
# gc.py's runs: the step, and the experiment that drives and measures it.
GC = STEP + ("gc.py", "apps/experiment/")
# A fresh clone's `make test` and `make demo`: everything they install, build and run.
CLONE = ("Makefile", "pyproject.toml", "CMakeLists.txt", "src/", "python/", "apps/", "tests/", "gc.py", ".ci/",
         "benchmarks/fresh_clone.py")


@dataclass(frozen=True)
class Figure:
    """One measured table: `command` runs with this repository as the working directory ("python" is this
    interpreter), `env` is added to the environment (and shown in the stamp)."""
    name: str
    page: str
    command: tuple
    measures: tuple
    env: dict = field(default_factory=dict)
    text_matters: bool = False  # any change to `measures` counts, not only one to what runs (see above)

    def shown(self):
        """The command as a shell line, as the stamp shows it."""
        return " ".join([f"{k}={v}" for k, v in self.env.items()] + [shlex.quote(a) for a in self.command])


def bench(script, *flags):
    return ("python", f"benchmarks/{script}", *flags)


ONE_THREAD = {"OMP_NUM_THREADS": "1"}
FIGURES = [
    Figure("demo", "docs/experiment.md", bench("gc_tables.py", "demo"), GC + ("benchmarks/gc_tables.py",)),
    Figure("writeup", "README.md", bench("gc_tables.py", "writeup"), GC + ("benchmarks/gc_tables.py",)),
    Figure("quickstart-times", "docs/benchmarks.md", bench("fresh_clone.py"), CLONE, text_matters=True),
    Figure("perplexity", "docs/experiment.md", bench("bench_perplexity.py", "--markdown"),
           STEP + ("benchmarks/bench_perplexity.py", "benchmarks/torch_lm.py")),
    Figure("ndarray-1-thread", "docs/benchmarks.md", bench("bench_ndarray.py", "--markdown"),
           BACKEND + ("benchmarks/bench_ndarray.py",), ONE_THREAD),
    Figure("ndarray-2-threads", "docs/benchmarks.md", bench("bench_ndarray.py", "--markdown"),
           BACKEND + ("benchmarks/bench_ndarray.py",), {"OMP_NUM_THREADS": "2"}),
    Figure("step", "docs/benchmarks.md", bench("bench_step.py", "--repeats", "5", "--rounds", "3", "--markdown"),
           STEP + ("benchmarks/bench_step.py",), {"OMP_NUM_THREADS": "2"}),
    Figure("gc-policies", "docs/experiment.md", bench("bench_gc.py", "--skip_max_batch", "--markdown"),
           GC + ("benchmarks/bench_gc.py",), ONE_THREAD),
    Figure("ablate", "docs/experiment.md", bench("gc_tables.py", "ablate"), GC + ("benchmarks/gc_tables.py",),
           ONE_THREAD),
    Figure("fused-head", "docs/fused-ops.md", bench("gc_tables.py", "heads"), GC + ("benchmarks/gc_tables.py",),
           ONE_THREAD),
    Figure("attention", "docs/fused-ops.md", bench("bench_attention.py", "--lm_repeats", "1", "--markdown"),
           STEP + ("benchmarks/bench_attention.py",), ONE_THREAD),
    Figure("rss", "docs/memory.md", bench("bench_rss.py", "--markdown"),
           STEP + ("benchmarks/bench_rss.py", "benchmarks/bench_step.py"), ONE_THREAD),
    Figure("optim-state", "docs/optimizers.md", bench("bench_optim.py", "--markdown"),
           STEP + ("benchmarks/bench_optim.py",), ONE_THREAD),
    Figure("optim-quality", "docs/optimizers.md",
           bench("bench_optim.py", "--skip-bytes", "--quality", "--seeds", "1", "--steps", "100", "--markdown"),
           GC + ("benchmarks/bench_optim.py",), ONE_THREAD),
    Figure("precision-memory", "docs/precision.md", bench("bench_precision.py", "--batches", "2", "--markdown"),
           GC + ("benchmarks/bench_precision.py",), ONE_THREAD),
    Figure("distributed-memory", "docs/distributed.md", bench("gc_tables.py", "parallel"),
           GC + ("python/needle/toolbox/distributed/", "benchmarks/gc_tables.py"), ONE_THREAD),
    Figure("distributed-tp", "docs/distributed.md", bench("bench_distributed.py", "--parts", "tp"),
           STEP + ("python/needle/toolbox/distributed/", "benchmarks/bench_distributed.py"), ONE_THREAD),
    Figure("timeline", "README.md", bench("readme_pictures.py", "timeline"),
           GC + ("python/needle/toolbox/memory/", "benchmarks/readme_pictures.py")),
    Figure("budget-sweep", "docs/offloading.md", bench("readme_pictures.py", "budget-sweep"),
           GC + ("python/needle/toolbox/checkpoint_optimal.py", "benchmarks/readme_pictures.py")),
    Figure("predict", "docs/predict.md", bench("bench_predict.py", "--markdown"),
           GC + ("python/needle/toolbox/memory/", "benchmarks/bench_predict.py"), ONE_THREAD),
    Figure("capture", "docs/capture.md", bench("bench_capture.py", "--markdown"),
           STEP + ("python/needle/toolbox/jit/", "benchmarks/bench_capture.py", "benchmarks/bench_step.py"),
           ONE_THREAD),
    Figure("capture-plan", "docs/capture.md", bench("readme_pictures.py", "capture-plan"),
           STEP + ("python/needle/toolbox/jit/", "benchmarks/readme_pictures.py", "benchmarks/bench_capture.py"),
           ONE_THREAD),
    Figure("memory-record", "docs/timeline.md", bench("bench_memory_record.py", "--markdown"),
           STEP + ("python/needle/toolbox/memory/", "benchmarks/bench_memory_record.py",
                   "benchmarks/bench_step.py")),
    Figure("offload", "docs/offloading.md", bench("bench_offload.py", "--markdown"),
           STEP + ("benchmarks/bench_offload.py",)),
    Figure("offload-overhead", "docs/offloading.md", bench("bench_offload_overhead.py", "--markdown"),
           STEP + ("benchmarks/bench_offload_overhead.py",)),
    Figure("fewbit", "docs/fewbit.md", bench("bench_fewbit.py", "--markdown"),
           GC + ("python/needle/toolbox/fewbit.py", "benchmarks/bench_fewbit.py"), ONE_THREAD),
    Figure("fewbit-readme", "docs/fewbit.md", bench("bench_fewbit.py", "--readme", "--steps", "50", "--markdown"),
           GC + ("python/needle/toolbox/fewbit.py", "benchmarks/bench_fewbit.py"), ONE_THREAD),
    Figure("cost-model", "docs/offloading.md",
           bench("bench_cost_model.py", "--num_layers", "16", "--head", "fused", "--recalibrate", "--markdown"),
           STEP + ("benchmarks/bench_cost_model.py", "benchmarks/bench_step.py")),
    Figure("budget-optimal", "docs/offloading.md", bench("bench_budget.py", "--markdown"),
           STEP + ("python/needle/toolbox/checkpoint_optimal.py", "benchmarks/bench_budget.py")),
    Figure("depth", "docs/checkpointing.md", bench("bench_depth.py", "--markdown"),
           STEP + ("benchmarks/bench_depth.py", "apps/experiment/growth.py")),
    Figure("budget-depth", "docs/checkpointing.md", bench("bench_budget.py", "--models", "--points", "5", "--markdown"),
           STEP + ("benchmarks/bench_budget.py",)),
    Figure("precision-quality", "docs/precision.md",
           bench("bench_precision.py", "--skip-memory", "--quality", "--steps", "100", "--markdown"),
           GC + ("benchmarks/bench_precision.py",), ONE_THREAD),
]
BY_NAME = {f.name: f for f in FIGURES}

BLOCK = re.compile(r"<!-- figure: (?P<name>[\w.-]+) -->\n(?P<body>.*?)<!-- /figure: (?P=name) -->", re.S)
# The whole stamp, as generate() writes it: the figure, the command, the commit, the date, the machine, the seconds.
STAMP = re.compile(r"^\*`python benchmarks/figures.py --only (?P<name>[\w.-]+)` ran `(?P<command>.+?)` at commit "
                   r"(?P<commit>[0-9a-f]{12})(?P<dirty> \(dirty\))? on (?P<date>\d{4}-\d\d-\d\d \d\d:\d\d UTC), "
                   r"on (?P<machine>[^;\n]+); (?P<seconds>\d+) s\.\*$", re.M)


# ----- git: the stamp's commit against the code ---------------------------------------------------------------
def git(repo, *args, check=True):
    return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, check=check)


def changed_since(repo, commit, paths):
    """The `paths` (files or folders) whose content in the working tree of `repo` differs from `commit`'s:
    committed since, changed and not committed, or untracked. Empty: a table stamped with `commit` is current."""
    if git(repo, "cat-file", "-e", f"{commit}^{{commit}}", check=False).returncode != 0:
        raise ValueError(f"commit {commit} is not in the repository at {repo} (a shallow clone, or a stamp "
                         f"from a branch never merged)")
    diff = git(repo, "diff", "--name-only", commit, "--", *paths).stdout.split()
    untracked = git(repo, "ls-files", "--others", "--exclude-standard", "--", *paths).stdout.split()
    return diff + untracked


def runs_differently(repo, commit, path):
    """Whether `path` in the working tree differs from `commit`'s in what runs: for a Python file present in both,
    its syntax tree without docstrings; for anything else, any difference (it was listed as changed)."""
    full = os.path.join(repo, path)
    old = git(repo, "show", f"{commit}:{path}", check=False)
    if not path.endswith(".py") or old.returncode != 0 or not os.path.isfile(full):
        return True
    with open(full) as f:
        new = f.read()
    try:
        return code_of(old.stdout) != code_of(new)
    except SyntaxError:
        return True


def code_of(source):
    """A Python source's syntax tree as text, without its docstrings (the first string of a module, class or
    function body)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def measured_changes(figure, commit, repo=ROOT):
    """The paths `figure` measures that changed since `commit` in a way that counts for it (see above)."""
    return [path for path in changed_since(repo, commit, figure.measures)
            if figure.text_matters or runs_differently(repo, commit, path)]


def uncommitted(repo, paths):
    """The `paths` with changes HEAD does not hold (stamping HEAD on them would be a lie)."""
    return changed_since(repo, "HEAD", paths)


# ----- pages: blocks and stamps -------------------------------------------------------------------------------
def blocks(text):
    """{figure name: the text between its markers} of a page."""
    return {m["name"]: m["body"] for m in BLOCK.finditer(text)}


def stamp_of(body):
    """The stamp's match in a block's text (its groups: name, command, commit, dirty, date, machine, seconds), or
    None when the block has no well-formed stamp."""
    return STAMP.search(body)


def status(figure, repo=ROOT):
    """"fresh", "stale (what changed)", "not generated" or "no block in PAGE" for a figure."""
    with open(os.path.join(repo, figure.page)) as f:
        body = blocks(f.read()).get(figure.name)
    if body is None:
        return f"no block in {figure.page}"
    stamp = stamp_of(body)
    if stamp is None:
        return "not generated"
    if stamp["dirty"]:
        return "stale (stamped dirty)"
    try:
        changed = measured_changes(figure, stamp["commit"], repo)
    except ValueError as e:
        return f"unknown ({e})"
    if not changed:
        return "fresh"
    more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
    return f"stale since {stamp['commit']} ({len(changed)} measured files changed: {', '.join(changed[:3])}{more})"


def stale(figures, repo=ROOT):
    """[(figure, its status)] of the `figures` that are not fresh, in their order: what `--stale` lists and
    `--run-stale` regenerates."""
    return [(f, s) for f, s in ((f, status(f, repo)) for f in figures) if s != "fresh"]


def machine():
    """CPU model, core count and the load average now, for the stamp."""
    model = "unknown CPU"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{model}, {os.cpu_count()} cores, load average {load:.2f} at the start"


def write_block(page_path, name, body):
    with open(page_path) as f:
        text = f.read()
    if name not in blocks(text):
        raise SystemExit(f"figures.py: {page_path} has no block for {name}: put `<!-- figure: {name} -->` and "
                         f"`<!-- /figure: {name} -->` (each on its own line) where the table goes")
    text = BLOCK.sub(lambda m: m.group(0) if m["name"] != name else
                     f"<!-- figure: {name} -->\n{body}<!-- /figure: {name} -->", text)
    with open(page_path, "w") as f:
        f.write(text)


def generate(figure, allow_dirty=False):
    """Run the figure's command and write its stamped table into its page."""
    dirty = uncommitted(ROOT, figure.measures)
    if dirty and not allow_dirty:
        raise SystemExit(f"figures.py: {figure.name} measures files with uncommitted changes ({', '.join(dirty)}); "
                         f"commit them first, so the stamp's commit holds the code that ran (or --allow-dirty)")
    commit = git(ROOT, "rev-parse", "--short=12", "HEAD").stdout.strip()
    where, date = machine(), datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    argv = [sys.executable if a == "python" else a for a in figure.command]
    print(f"figures.py: {figure.name}: {figure.shown()}", file=sys.stderr, flush=True)
    start = time.time()
    proc = subprocess.run(argv, cwd=ROOT, env={**os.environ, **figure.env}, stdout=subprocess.PIPE, text=True)
    seconds = time.time() - start
    table = proc.stdout.strip()
    if proc.returncode != 0 or not any(line.startswith("|") for line in table.splitlines()):
        raise SystemExit(f"figures.py: {figure.name}: `{figure.shown()}` exited {proc.returncode} and printed no "
                         f"Markdown table on stdout:\n{proc.stdout[-2000:]}")
    stamp = (f"*`python benchmarks/figures.py --only {figure.name}` ran `{figure.shown()}` at commit {commit}"
             f"{' (dirty)' if dirty else ''} on {date}, on {where}; {seconds:.0f} s.*")
    write_block(os.path.join(ROOT, figure.page), figure.name, f"{stamp}\n\n{table}\n")
    print(f"figures.py: {figure.name}: written into {figure.page} ({seconds:.0f} s)", file=sys.stderr, flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog="With none of --stale, --run-stale, --list: regenerate the chosen figures "
                                       "(all of them without --only).")
    p.add_argument("--only", nargs="+", metavar="NAME", help="these figures (see --list)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--stale", action="store_true",
                      help="list the figures that are not fresh (name, page, what changed) and exit; runs nothing")
    what.add_argument("--run-stale", action="store_true", help="regenerate only the figures that are not fresh")
    what.add_argument("--list", action="store_true", help="print each figure's name, page and status, and exit")
    p.add_argument("--allow-dirty", action="store_true",
                   help="stamp even when measured files have uncommitted changes (the stamp says dirty)")
    args = p.parse_args()
    unknown = sorted(set(args.only or ()) - set(BY_NAME))
    if unknown:
        p.error(f"no figure named {', '.join(unknown)}; the figures: {', '.join(BY_NAME)}")
    chosen = [BY_NAME[n] for n in args.only] if args.only else FIGURES
    if args.list or args.stale:
        listed = [(f, status(f)) for f in chosen] if args.list else stale(chosen)
        for f, s in listed:
            print(f"{f.name:20s}{f.page:22s}{s}")
        if args.stale:
            print(f"figures.py: {len(listed)} of {len(chosen)} figures not fresh"
                  + (" (python benchmarks/figures.py --run-stale regenerates them)" if listed else ""),
                  file=sys.stderr)
        return
    if args.run_stale:
        chosen = [f for f, _ in stale(chosen)]
    for f in chosen:
        generate(f, args.allow_dirty)


if __name__ == "__main__":
    main()
