"""The experiment package behind gc.py (apps/experiment/), by its parts: the parsers, the RunConfig, a child's
command line, the model set-up, the measurements and the JSON writer; and its layout (what a reader can rely on).
gc.py as a user runs it (argv in, JSON out) is test_gc_script.py's."""
import argparse
import ast
import json
import math
import os
import stat
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

import needle as ndl
from needle import checkpoint
from needle.toolbox import compress
from needle.checkpoint_budget import InfeasibleBudget
from needle.data import batchify

from conftest import GC_DEVICE, GC_ROOT, GC_TINY, strict_json, tiny_ptb
from experiment import ablations, children, cli, data, footprint, outputs, parser, records, setup
from experiment.measure import PeakRSS

EXPERIMENT = os.path.join(GC_ROOT, "apps", "experiment")


# ----- the command line --------------------------------------------------------------------------------------------
@pytest.mark.smoke
def test_every_flag_has_help_and_both_spellings():
    _, parsers = parser.build_parser()
    assert list(parsers) == parser.SUBCOMMANDS
    for command, p in parsers.items():
        for action in p.flags():
            assert action.help, (command, action.dest)
            names = set(action.option_strings)
            for name in names:
                if "_" in name:
                    assert name.replace("_", "-") in names, (command, name)
                if name.startswith("--") and "-" in name[2:] and not name.startswith("--no-"):
                    assert name.replace("-", "_").replace("__", "--", 1) in names, (command, name)


@pytest.mark.smoke
def test_run_is_the_default_subcommand_and_both_spellings_parse_alike():
    assert cli.parse_args(["--batch-size", "32"]).command == "run"
    hyphens = cli.parse_args(["--batch-size", "5", "--seq-len", "7", "--max-batches", "2", "--budget-mb", "9",
                              "--policy", "budget", "--no-lazy"])
    underscores = cli.parse_args(["run", "--batch_size", "5", "--seq_len", "7", "--max_batches", "2",
                                  "--budget_mb", "9", "--policy", "budget", "--no-lazy"])
    assert replace(hyphens, argv=()) == replace(underscores, argv=())
    assert hyphens.batch_size == 5 and hyphens.lazy is False and hyphens.budget_mb == 9


@pytest.mark.smoke
def test_the_config_is_frozen_and_every_flag_has_a_field():
    config = cli.parse_args(["sweep", "--values", "4", "8"])
    with pytest.raises(AttributeError):
        config.batch_size = 3  # frozen: the Namespace is converted once, then only read
    for argv in (["run"], ["sweep"], ["max-batch", "--memory-limit-mb", "1"], ["ablate"], ["plot", "DIR"]):
        assert cli.parse_args(argv).command == argv[0]  # every flag's dest is a field (else a TypeError here)
    with pytest.raises(TypeError, match="no field for the flag"):
        setup.RunConfig.from_args(argparse.Namespace(command="run", batch_size=4, bogus=1))


def test_a_childs_command_line_comes_from_the_run_parser(tmp_path):
    """What a sweep's child is told is what the parent was told, with the sweep's value: parsed back, equal."""
    parent = cli.parse_args(["sweep", "--values", "4", "6", "--precision", "bf16", "--stochastic-rounding",
                             "--optimizer", "sgd", "--offload-state", "--no-lazy", "--memory-limit-mb", "300",
                             "--head", "full"] + GC_TINY)
    argv = children.child_argv(parent, "synthetic", {"batch_size": 6}, "all", tmp_path / "child.json")
    child = cli.parse_args(argv)
    assert (child.command, child.policy, child.use_gc, child.data, child.progress) == ("run", "all", 1,
                                                                                       "synthetic", False)
    assert child.json == str(tmp_path / "child.json")
    expected = replace(parent, batch_size=6)
    for action in parser.subcommand_parser("run").flags():
        if action.dest not in children.SET_BY_CHILD and getattr(expected, action.dest) is not None:
            assert getattr(child, action.dest) == getattr(expected, action.dest), action.dest
    assert child.lazy is False
    with pytest.raises(ValueError, match="rows is not a flag of gc.py run"):
        children.child_argv(parent, "synthetic", {"rows": ["all"]}, "all", tmp_path / "x.json")


def test_only_a_budget_child_is_told_the_budget_offload_and_bandwidth(tmp_path):
    """gc.py sweep --over budget_mb and ablate's offload rows: the Budget flags reach the children with policy
    budget (budget-offload is --policy budget --offload), never a policy that would refuse them."""
    parent = cli.parse_args(["sweep", "--over", "budget_mb", "--values", "0.5", "--host-bandwidth", "16"] + GC_TINY)
    both = cli.parse_args(children.child_argv(parent, "synthetic", {"budget_mb": 0.5, "offload": True}, "budget",
                                              tmp_path / "a.json"))
    assert (both.policy, both.budget_mb, both.offload, both.host_bandwidth) == ("budget", 0.5, True, 16.0)
    alone = cli.parse_args(children.child_argv(parent, "synthetic", {"budget_mb": 0.5, "offload": False}, "offload",
                                               tmp_path / "b.json"))
    assert (alone.policy, alone.budget_mb, alone.offload, alone.host_bandwidth) == ("offload", None, False, None)
    assert setup.BUDGET_CURVES["budget-offload"] == ("budget", True)
    assert ablations.ABLATIONS["offload-all"][1]["policy"] == "offload"
    assert {"policy": "budget", "offload": True}.items() <= ablations.ABLATIONS["budget-offload"][1].items()


def test_compress_bits_reaches_gc_on_children_and_ablates_compress_rows_only(tmp_path):
    """--compress-bits wraps gc on's policy: a sweep's gc-off child stays exact; ablate passes its bits only to the
    rows that compress (their gc-off policy then runs gc on: compression alone)."""
    parent = cli.parse_args(["sweep", "--over", "batch_size", "--values", "4", "--compress-bits", "4"] + GC_TINY)
    on = cli.parse_args(children.child_argv(parent, "synthetic", {}, "selective", tmp_path / "a.json"))
    off = cli.parse_args(children.child_argv(parent, "synthetic", {}, "off", tmp_path / "b.json"))
    assert (on.compress_bits, on.use_gc) == (4, 1) and (off.compress_bits, off.use_gc) == (None, 0)
    row = cli.parse_args(children.child_argv(parent, "synthetic", {"compress_bits": 8}, "off", tmp_path / "c.json"))
    assert (row.policy, row.compress_bits, row.use_gc) == ("off", 8, 1)
    assert ablations.ABLATIONS["compress"][1].get("compress") and ablations.ABLATIONS["compress"][1]["policy"] == "off"
    policy = setup.make_policy(replace(on, policy="selective"))
    assert isinstance(policy, compress.Compress) and policy.bits == 4 and policy.policy is not None
    assert setup.make_policy(replace(on, policy="off")).policy is None  # keep everything, compressed


def test_the_whole_step_row_pulls_the_levers_of_the_step_peak_and_its_child_gets_them(tmp_path):
    """ablate's whole-step row (issue 47): checkpointing, the fused head, a lean optimizer that updates each
    parameter inside backward, 16-bit storage; its child gc.py run is told every one of them."""
    flags = ablations.ABLATIONS["whole-step"][1]
    assert flags["policy"] in ("all", "sqrt") and flags["head"] == "fused" and flags["optimizer_in_backward"] is True
    assert flags["optimizer"] in ("adam8bit", "adafactor") and flags["precision"] in ("bf16", "mixed-bf16")
    assert "whole-step" in ablations.default_rows()
    parent = cli.parse_args(["ablate", "--rows", "baseline", "whole-step"])
    overrides = {key: value for key, value in flags.items() if key != "policy"}
    child = cli.parse_args(children.child_argv(parent, "synthetic", overrides, flags["policy"], tmp_path / "w.json"))
    assert (child.policy, child.use_gc) == (flags["policy"], 1)
    for key, value in overrides.items():
        assert getattr(child, key) == value, key
    # in backward, each gradient is freed by its own update: the footprint's lower bound counts the largest only
    shapes = footprint.parameter_shapes(child, 100)
    held = footprint.model_bytes(child, 100)["gradients"]
    assert held == max(math.prod(s) for s in shapes) * (2 if child.precision == "bf16" else 4)
    assert held < footprint.model_bytes(replace(child, optimizer_in_backward=False), 100)["gradients"]


# ----- set-up --------------------------------------------------------------------------------------------------------
def test_the_output_layer_starts_near_a_uniform_guess_without_changing_the_rest(tmp_path):
    corpus, vocab = data.load_data(tiny_ptb(tmp_path))
    device = ndl.cpu() if GC_DEVICE == "cpu" else ndl.cpu_numpy()
    losses, weights = {}, {}
    for scale in ("1", "0.1"):
        config = cli.parse_args(GC_TINY + ["--head-init-scale", scale])
        model = setup.build_model(config, vocab, device, "off")
        X, y = data.micro_batches(batchify(corpus, 4, device, "float32"), 0, config, device)[0]
        losses[scale] = float(ndl.nn.SoftmaxLoss()(model(X)[0], y).numpy())
        weights[scale] = [p.numpy() for p in model.parameters()]
    assert abs(losses["0.1"] - math.log(vocab)) < 0.3  # a uniform guess: ln(vocab)
    assert losses["1"] > math.log(vocab) + 1  # the course's init: far above it
    assert cli.parse_args([]).head_init_scale == 0.1  # gc.py's default
    scaled = [i for i, (a, b) in enumerate(zip(weights["1"], weights["0.1"])) if not np.array_equal(a, b)]
    assert len(scaled) == 1 and np.allclose(weights["1"][scaled[0]] * 0.1, weights["0.1"][scaled[0]])


def test_the_readme_budget_example_is_feasible_at_the_size_it_shows():
    with open(os.path.join(GC_ROOT, "docs", "experiment.md")) as f:  # gc.py's page, moved from README
        lines = [ln for ln in f if ln.strip().startswith("python gc.py --policy budget")]
    assert lines
    corpus, vocab = data.synthetic_corpus()  # vocabulary 10,000: the largest head of the data gc.py runs on
    for line in lines:  # recompute only, and with offloading
        argv = line.split("#")[0].split()[2:]  # after "python gc.py"
        config = cli.parse_args(argv)
        setup.check_budget(config, corpus, vocab, setup.pick_device(None))  # no SystemExit: feasible
        off = cli.parse_args(argv + ["--budget-mb", "1"])
        with pytest.raises(SystemExit):
            setup.check_budget(off, corpus, vocab, setup.pick_device(None))


def test_an_infeasible_budget_raises_its_own_type_naming_the_least_peak():
    """gc.py tells an infeasible budget by its type, InfeasibleBudget (a ValueError), not by its message."""
    config = cli.parse_args(GC_TINY)
    corpus, vocab = data.synthetic_corpus(num_tokens=2000)
    budget = checkpoint.Budget(1)
    with pytest.raises(InfeasibleBudget, match=r"infeasible: the least peak activation memory .* is \d+ bytes"):
        setup.plan_budget(config, corpus, vocab, setup.pick_device(GC_DEVICE), budget)
    assert issubclass(InfeasibleBudget, ValueError) and budget.minimum_peak > 1


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_footprint_from_the_flags_is_the_built_models_parameters_gradients_and_state(tmp_path, precision):
    """footprint.py counts, from the flags alone, what a built model holds after a step: its parameters' shapes and
    bytes and their gradients' exactly, the optimizer's state exactly or (Adam8bit: its absmax blocks) from below."""
    corpus, vocab = data.load_data(tiny_ptb(tmp_path))
    device = setup.pick_device(GC_DEVICE)
    shapes = ["--embedding-size", "64", "--num-head", "4", "--hidden-size", "72", "--num-layers", "2"]  # 8-bit: 64 x 72
    for optimizer in setup.OPTIMIZERS:
        config = cli.parse_args(GC_TINY + shapes + ["--optimizer", optimizer, "--precision", precision])
        model = setup.build_model(config, vocab, device, "off")
        params = model.parameters()
        opt = setup.make_optimizer(config, params, model)
        X, y = data.micro_batches(batchify(corpus, 4, device, "float32"), 0, config, device)[0]
        setup.make_loss(model, config.head)(X, y).backward()
        opt.step()
        estimate = footprint.model_bytes(config, vocab)
        assert footprint.parameter_shapes(config, vocab) == [tuple(p.shape) for p in params]
        assert estimate["parameters"] == sum(p.realize_cached_data().nbytes for p in params)
        assert estimate["gradients"] == sum(p.grad.realize_cached_data().nbytes for p in params)
        state = opt.state_bytes()
        assert estimate["optimizer_state"] == state if optimizer != "adam8bit" else \
            0.9 * state < estimate["optimizer_state"] <= state, (optimizer, estimate, state)


# ----- measurement and records ---------------------------------------------------------------------------------------
def test_peak_rss_measures_the_peak_inside_an_interval():
    if not os.path.exists("/proc/self/status"):
        assert PeakRSS().growth() is None
        return
    rss = PeakRSS()
    block = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB, touched
    del block  # freed before the reading: only the high-water mark still sees it
    growth = rss.growth()
    if rss.exact:
        assert growth >= 60 << 20
    else:
        assert growth >= 0


@pytest.mark.smoke
def test_json_writer_writes_null_for_values_that_are_not_finite(tmp_path):
    path = str(tmp_path / "r.json")
    records.write_json(path, {"loss": float("nan"), "time": 0.5, "x": [1.0, float("inf"), -float("inf")],
                              "steps": [{"loss": np.float32("nan"), "n": np.int64(3), "ok": np.float64(2.5)}],
                              "pair": (float("nan"), 1)})
    with open(path) as f:
        text = f.read()
    assert "NaN" not in text and "Infinity" not in text
    assert strict_json(path) == {"loss": None, "time": 0.5, "x": [1.0, None, None],
                                 "steps": [{"loss": None, "n": 3, "ok": 2.5}], "pair": [None, 1]}
    assert json.loads(text)["x"] == [1.0, None, None]


def test_a_json_write_that_fails_is_one_line_and_leaves_nothing_beside_the_path(tmp_path, monkeypatch, capsys):
    taken = tmp_path / "taken.json"
    taken.mkdir()  # a folder where the file should go
    with pytest.raises(SystemExit) as exit_:
        records.write_json(str(taken), {"loss": 1.0})
    assert exit_.value.code == 2 and f"cannot write {taken}" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["taken.json"]

    def interrupted(*args, **kwargs):  # Ctrl-C half-way through writing
        raise KeyboardInterrupt

    monkeypatch.setattr(records.json, "dump", interrupted)
    with pytest.raises(KeyboardInterrupt):
        records.write_json(str(tmp_path / "r.json"), {"loss": 1.0})
    assert os.listdir(tmp_path) == ["taken.json"]


def test_the_ablation_table_keeps_long_row_names_in_their_column(capsys, monkeypatch):
    # "budget-offload" and "compress-selective" used to run into the setup column (the names had 11 characters)
    from experiment import report

    monkeypatch.setattr(report, "busy_load", lambda: None)
    row = {"activation_bytes": 2**20, "peak_activation_bytes": 2**21, "step_time_seconds": 0.5, "timed_steps": 0,
           "step_time_reliable": False, "loss": 1.0}
    rows = [{**row, "row": "baseline", "setup": "gc off"}, {**row, "row": "compress-selective", "setup": "sel"},
            {"row": "budget-offload", "setup": "Budget", "failed": "exit 2"}]
    report.print_ablation({"rows": rows, "batch_size": 4, "steps_per_row": 2})
    lines = capsys.readouterr().out.splitlines()[1:5]
    column = lines[0].index("setup")
    assert [line[column - 2:column] for line in lines] == ["  "] * 4, lines
    assert [line[column:].split()[0] for line in lines] == ["setup", "gc", "sel", "Budget"]
    assert "n/a" in lines[1].split() and "0.500" not in lines[1]  # T_step from 0 timed steps: not a number


def test_every_configuration_field_sets_repeats_apart_but_the_seed_and_the_start():
    # plot groups runs as repeats of one configuration by records.CONFIG_KEYS: a field config_of writes that it
    # left out would merge different runs into one bar.
    config = cli.parse_args(GC_TINY)
    written = records.config_of(config, "synthetic", 31, ndl.cpu())
    assert sorted(written) == sorted(records.CONFIG_KEYS + records.REPEAT_KEYS)


def test_the_compress_policy_is_found_inside_a_data_parallel_wrapper():
    # --parallel dp wraps the model: its checkpoint_policy is the wrapper's own (None), so --save-checkpoint
    # used to save no compress state and a resumed run drew other rounding noise.
    from experiment import resume
    from needle import distributed as dist

    model = ndl.nn.Sequential(ndl.nn.Linear(4, 4), ndl.nn.ReLU())
    policy = compress.compress(8)
    model.enable_gc(policy=policy)
    assert resume.compression_policy(model) is policy
    assert resume.compression_policy(dist.DataParallel(model)) is policy


def test_a_json_write_refuses_a_name_that_is_not_a_regular_file_and_writes_through_a_link(tmp_path, monkeypatch,
                                                                                         capsys):
    # The atomic rename replaced whatever node was there: a FIFO, a device (as root, /dev/null), a symbolic link.
    fifo, target, link = tmp_path / "fifo", tmp_path / "target.json", tmp_path / "link.json"
    os.mkfifo(fifo)
    with pytest.raises(SystemExit) as exit_:
        records.write_json(str(fifo), {"loss": 1.0})
    assert exit_.value.code == 2 and f"cannot write {fifo}: it is not a regular file" in capsys.readouterr().err
    assert fifo.is_fifo() and sorted(os.listdir(tmp_path)) == ["fifo"]
    target.write_text("{}")
    link.symlink_to(target)
    records.write_json(str(link), {"loss": 1.0})
    assert link.is_symlink() and strict_json(target) == {"loss": 1.0}
    assert sorted(os.listdir(tmp_path)) == ["fifo", "link.json", "target.json"]
    if not os.path.exists("/dev/null") or not stat.S_ISCHR(os.stat("/dev/null").st_mode):
        return
    with pytest.raises(ValueError, match="is a device"):
        outputs.regular_file_target("/dev/null")

    def touched(*args, **kwargs):  # /dev/null is only looked at: never opened beside, never renamed over
        raise AssertionError(f"write_json touched /dev/null: {args}")

    monkeypatch.setattr(records, "open", touched, raising=False)
    monkeypatch.setattr(records.os, "replace", touched)
    with pytest.raises(SystemExit):
        records.write_json("/dev/null", {"loss": 1.0})
    assert "cannot write /dev/null: it is a device" in capsys.readouterr().err
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


# ----- the layout: what a reader of apps/experiment can rely on ------------------------------------------------------
def _modules():
    """{dotted name: (path, its ast)} of every module of the experiment package."""
    found = {}
    for folder, _, files in os.walk(EXPERIMENT):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, os.path.dirname(EXPERIMENT))[:-3].replace(os.sep, ".")
                with open(path) as f:
                    found[dotted.removesuffix(".__init__")] = (path, ast.parse(f.read()))
    return found


def _imports(dotted, path, tree, modules):
    """The package's modules `dotted` imports, and the names it imports from them."""
    package = dotted if path.endswith("__init__.py") else dotted.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[:len(package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                yield (f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target), alias.name


@pytest.mark.smoke
def test_the_experiment_reads_in_small_parts_without_cycles():
    modules = _modules()
    optional = {"matplotlib", "tqdm", "GPUtil", "mpi4py", "scipy", "torch"}
    graph = {}
    for dotted, (path, tree) in modules.items():
        with open(path) as f:
            assert len(f.read().splitlines()) <= 400, path
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno < 60, f"{path}: {node.name} is over 60 lines"
                for inner in ast.walk(node):  # only optional dependencies are imported inside functions
                    if isinstance(inner, ast.Import):
                        assert {a.name.split(".")[0] for a in inner.names} <= optional, (path, node.name)
                    if isinstance(inner, ast.ImportFrom):
                        assert inner.module.split(".")[0] in optional, (path, node.name)
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if any(n.split(".")[0] == "matplotlib" for n in names):
                    assert dotted == "experiment.commands.plot", path  # the only module that draws
        imports = list(_imports(dotted, path, tree, modules))
        assert not [name for _, name in imports if name.startswith("_")], path  # no private names across modules
        graph[dotted] = {target for target, _ in imports if target in modules and target != dotted}
    done, on_path = set(), []

    def visit(module):  # a depth-first walk; the package is a few levels deep
        assert module not in on_path, f"import cycle: {' -> '.join(on_path + [module])}"
        if module in done:
            return
        on_path.append(module)
        for target in sorted(graph[module]):
            visit(target)
        on_path.pop()
        done.add(module)

    for module in graph:
        visit(module)
    with open(os.path.join(GC_ROOT, "gc.py")) as f:
        assert len(f.read().splitlines()) <= 40


def test_a_run_loads_no_matplotlib(tmp_path):
    """Drawing is the only reason to import matplotlib: the CLI and a run never do."""
    argv = GC_TINY + ["--max_batches", "1", "--use-gc", "1", "--json", str(tmp_path / "r.json"), "--data", "synthetic"]
    code = f"import sys; from experiment import cli; cli.main({argv!r}); sys.exit('matplotlib' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=GC_ROOT,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(GC_ROOT, "python"),
                                                                            os.path.join(GC_ROOT, "apps")])})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert strict_json(tmp_path / "r.json")["policy"] == "all"


def test_enable_gc_policy_off_is_no_checkpointing_as_gc_py_policy_off():
    np.random.seed(0)
    model = ndl.nn.Sequential(ndl.nn.Linear(4, 4), ndl.nn.ReLU(), ndl.nn.Linear(4, 4))
    model.enable_gc(policy="all").enable_gc(policy="off")  # accepted, and it turns checkpointing off
    assert all(m.checkpoint_policy is None for m in [model] + model._children())
    assert checkpoint.resolve_policy("off") is None
    x = ndl.Tensor(np.random.randn(3, 4).astype("float32"))
    h = ndl.ops.relu(x @ model.modules[0].weight)
    y = h @ model.modules[2].weight
    checkpoint.annotate(y, [x], policy="off")  # nothing dropped
    assert not h.drop and checkpoint.keep_reason(h) == "not annotated"
    assert setup.POLICIES[0] == "off"  # the name gc.py's --policy takes
