"""gc.py, the experiment a user runs, tested through its command line only (argv in; its JSON, text and exit
status out): it runs, writes what it measured, keeps it when interrupted, and turns bad input into one line.
Most tests run gc.py's main in this process (run_gc, gc_in_process); those of the process boundary itself (exit
status and streams as a shell sees them, Ctrl-C, a checkout of its own, children that are processes) run gc.py
as a fresh process (gc_process). The experiment package's own parts (apps/experiment/) are tested in
test_experiment.py."""
import json
import math
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import needle as ndl
import simple_ml
from models import LanguageModel
from needle.data import download

from conftest import GC_DEVICE as DEVICE
from conftest import GC_ROOT as ROOT
from conftest import GC_TINY as TINY
from conftest import gc_in_process as _gc_here
from conftest import gc_process as _gc
from conftest import run_gc, strict_json, tiny_ptb
from experiment import cli, setup
from experiment.commands import run as run_command

SUBCOMMANDS = ["run", "sweep", "max-batch", "ablate", "timeline", "plot"]


def _read(path):
    with open(path) as f:
        return json.load(f)


def _write(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)


@pytest.mark.smoke
def test_gc_script_runs_and_writes_the_measurements(tmp_path, capsys):
    out = tmp_path / "out"
    run_gc(TINY + ["--data", tiny_ptb(tmp_path), "--out", str(out)])
    printed = capsys.readouterr().out
    assert "M_act (MB)" in printed and "M_peak (MB)" in printed and "T_step (s)" in printed
    records = [_read(out / f) for f in sorted(os.listdir(out))]
    assert len(records) == 2
    off, on = sorted(records, key=lambda r: r["use_gc"])
    for r in (off, on):
        for key in ("time", "batch_size", "peak memory", "use_gc", "segment_len", "time_per_batch_median",
                    "peak_bytes", "peak_activation_bytes", "policy", "device", "loss", "recomputed_nodes"):
            assert key in r
        assert r["head"] == "fused" and r["head_init_scale"] == 0.1  # gc.py's defaults (TINY sets neither)
    assert off["loss"] == on["loss"]  # checkpointing is exact
    assert on["activation_bytes"] < off["activation_bytes"]
    assert on["recomputed_nodes"] > 0 and off["recomputed_nodes"] == 0


@pytest.fixture(scope="module")
def bare_checkout_run(tmp_path_factory):
    """gc.py run in a checkout of its own: gc.py copied, python/ and apps/ linked, beside no data/ptb (nor
    ../shared/data/ptb) and outside any git repository; (its stdout, its one JSON record)."""
    root = tmp_path_factory.mktemp("bare") / "checkout"
    root.mkdir()
    shutil.copy(os.path.join(ROOT, "gc.py"), root)
    for name in ("python", "apps"):
        os.symlink(os.path.join(ROOT, name), root / name)
    out = root / "out"
    code, printed, err = _gc(*TINY, "--use_gc", "1", "--max_batches", "1", "--out", out,
                             script=str(root / "gc.py"), cwd=str(root))
    assert code == 0, err
    (name,) = os.listdir(out)
    return printed, strict_json(out / name)


def test_gc_script_synthetic_corpus_when_data_is_absent(bare_checkout_run):
    # Only the default path falls back to the synthetic corpus (an explicit --data must exist: see the CLI tests).
    printed, record = bare_checkout_run
    assert "synthetic" in printed
    assert record["data"] == "synthetic"


def test_interrupted_run_keeps_the_results_written(tmp_path, monkeypatch):
    out = tmp_path / "out"
    real_step, calls = ndl.optim.Adam.step, []

    def interrupted(self):  # Ctrl-C in the third step's optimizer update
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(ndl.optim.Adam, "step", interrupted)
    with pytest.raises(SystemExit) as stopped:  # Ctrl-C ends the run with exit status 130
        run_gc(TINY + ["--data", tiny_ptb(tmp_path), "--out", str(out), "--use_gc", "1"])
    assert stopped.value.code == 130
    (name,) = os.listdir(out)
    record = strict_json(out / name)
    assert len(record["steps"]) == 2  # both finished steps are on disk
    assert record["complete"] is False


def max_batch_search(folder):
    """gc.py max-batch as a user runs it (its tries child processes), in `folder`: (exit status, its output, the
    largest batches it wrote). An early job (conftest): its ~25 s of children run beside the tests before it."""
    data = tiny_ptb(pathlib.Path(folder), num_lines=2000)
    out = os.path.join(folder, "mb")
    code, printed, err = _gc("max-batch", "--memory_limit_mb", "0.5", "--policies", "off", "all", "--data", data,
                             "--out", out, *TINY, timeout=600)
    path = os.path.join(out, "max_batch.json")
    return code, printed + err, _read(path)["largest_batch"] if os.path.exists(path) else None


@pytest.mark.early(start=max_batch_search)
def test_max_batch_finds_a_larger_batch_with_checkpointing(early_result):
    code, log, result = early_result
    assert code == 0, log
    assert result["all"] >= result["off"] > 0


# ----- statistics that cannot lie: strict JSON, one file per child, the OS's view of memory ---------------------



def test_run_with_a_nan_loss_writes_strict_json(tmp_path, capsys):
    out = tmp_path / "out"
    run_gc(TINY + ["--data", tiny_ptb(tmp_path), "--out", str(out), "--use_gc", "0", "--lr", "1e30"])
    assert "loss nan" in capsys.readouterr().out  # the huge learning rate did make the loss NaN
    (name,) = os.listdir(out)
    record = strict_json(out / name)
    assert record["loss"] is None and None in [s["loss"] for s in record["steps"]]


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="RSS is read from /proc/self/status")
def test_rss_peak_growth_is_reported_per_step_and_printed(tmp_path, capsys):
    out = tmp_path / "out"
    run_gc(TINY + ["--data", tiny_ptb(tmp_path), "--out", str(out)])
    assert "RSS_peak (MB)" in capsys.readouterr().out
    for name in os.listdir(out):
        record = strict_json(out / name)
        assert all(isinstance(s["rss_peak_bytes"], int) and s["rss_peak_bytes"] >= 0 for s in record["steps"])
        assert all(s["rss_start_bytes"] > 0 for s in record["steps"])
        assert record["rss_peak_bytes"] == max(s["rss_peak_bytes"] for s in record["steps"][1:])  # warmup 1


def test_a_sweep_reads_back_only_its_own_childrens_files(tmp_path, monkeypatch):
    # Another sweep (or any run) writing into the same --out while this one's child runs: its file must not be
    # taken for this child's result.
    out = tmp_path / "out"
    real_run = subprocess.run

    def with_a_neighbour(cmd, *args, **kwargs):
        if "--json" in cmd:  # a child `gc.py run`: a neighbour writes into the folder meanwhile
            out.mkdir(exist_ok=True)
            foreign = {"batch_size": 999, "activation_bytes": 1, "peak_activation_bytes": 1, "time": 1.0,
                       "hidden_size": 999}
            _write(out / f"aaa_neighbour_{len(os.listdir(out))}.json", foreign)
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", with_a_neighbour)
    run_gc(["sweep", "--values", "4", "6", "--repeats", "1", "--policies", "off", "--out", str(out),
            "--data", tiny_ptb(tmp_path)] + TINY)
    assert len([f for f in os.listdir(out) if f.startswith("aaa_neighbour")]) == 2  # both children had one
    records = strict_json(out / "sweep.json")
    assert sorted(r["batch_size"] for r in records) == [4, 6]
    assert {r["hidden_size"] for r in records} == {8}
    (summary,) = [f for f in os.listdir(out) if f.startswith("sweep-") and "_" not in f]  # sweep-<id>.json
    assert strict_json(out / summary) == records
    for r in records:  # each record is the file its child was told to write, inside --out
        assert os.path.dirname(r["json"]) == str(out) and strict_json(r["json"])["batch_size"] == r["batch_size"]


def two_concurrent_sweeps(folder):
    """Two gc.py sweeps started at once into one --out folder, models apart (hidden 8 and 12): [(hidden, exit
    status, output)]. An early job (conftest): its ~14 s of processes run beside the tests before it."""
    folder = pathlib.Path(folder)
    out, data = folder / "out", tiny_ptb(folder)
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "gc.py"), "sweep", "--values", "4", "6", "8",
                               "--repeats", "1", "--policies", "off", "--out", str(out), "--data", data]
                              + TINY + ["--hidden_size", str(hidden)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for hidden in (8, 12)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    return [(hidden, proc.returncode, log) for hidden, proc, log in zip((8, 12), procs, logs)]


@pytest.mark.early(start=two_concurrent_sweeps)
def test_two_concurrent_sweeps_into_one_out_folder_do_not_mix(early_result):
    for hidden, code, log in early_result:
        assert code == 0, log
        (line,) = [ln for ln in log.splitlines() if ln.startswith("wrote ")]
        records = strict_json(line.split()[1])  # this sweep's own summary
        assert sorted(r["batch_size"] for r in records) == [4, 6, 8]
        assert {r["hidden_size"] for r in records} == {hidden}, log
        assert len({r["sweep_id"] for r in records}) == 1


# ----- the command line: subcommands, help, spellings, one-line errors ---------------------------------------------


def _one_line_error(code, out, err):
    """A bad input: exit status 2, exactly one line on stderr, no traceback, nothing on stdout; the line."""
    assert code == 2, (code, out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert out == "", out
    return err.strip()


def test_every_subcommand_has_help_with_defaults_and_the_definitions(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # help 80 columns wide (as pytest's captured run has it), with or without -s
    results = {"top": _gc("--help")}  # a fresh process: --help exits 0 with nothing on stderr, as a shell sees it
    results.update({command: _gc_here(command, "--help") for command in SUBCOMMANDS})
    for name, (code, out, err) in results.items():
        assert code == 0 and err == "", (name, err)
    top = results["top"][1]
    for command in SUBCOMMANDS:
        assert f"  {command} " in top
    for name in ("top", "run", "sweep", "max-batch", "ablate"):  # the definitions, in the epilog
        for measure in ("M_act", "M_peak", "M_floor", "T_step", "RSS_peak"):
            assert measure in results[name][1], (name, measure)
    run_help = results["run"][1]
    assert "--batch-size N" in run_help and "(default: 32)" in run_help
    assert "--accumulation-steps K" in run_help and "effective batch" in run_help
    assert "--policy {off,all,sqrt,selective,budget,offload}" in run_help and \
        "None" not in run_help.split("--policy")[1][:48]
    assert "--head {full,fused}" in run_help and "(default: fused)" in run_help.split("--head {full,fused}")[1]
    assert "--rows ROW" in results["ablate"][1] and "--steps N" in results["ablate"][1]
    assert "--memory-limit-mb MB" in results["max-batch"][1] and "(required)" in results["max-batch"][1]
    assert "DIR" in results["plot"][1]
    # that every flag has a help line and both spellings: test_experiment.py, on the parsers themselves


def test_run_is_the_default_subcommand_and_both_spellings_parse_alike(tmp_path):
    data, records = tiny_ptb(tmp_path), []
    hyphens = TINY + ["--batch-size", "5", "--seq-len", "7", "--max-batches", "2", "--budget-mb", "9",
                      "--policy", "budget", "--no-lazy"]
    underscores = ["run"] + TINY + ["--batch_size", "5", "--seq_len", "7", "--max_batches", "2", "--budget_mb", "9",
                                    "--policy", "budget", "--no-lazy"]
    for name, argv in (("hyphens", hyphens), ("underscores", underscores)):
        path = tmp_path / f"{name}.json"
        run_gc(argv + ["--use-gc", "1", "--data", data, "--json", str(path)])  # the last of a flag's values wins
        records.append(strict_json(path))
    varies = {"argv", "started_at", "steps", "time", "time_per_batch_median", "step_time_seconds",
              "tokens_per_second", "rss_peak_bytes"}
    h, u = [{k: v for k, v in r.items() if k not in varies} for r in records]
    assert h == u and h["kind"] == "run" and h["policy"] == "budget"  # run is the default subcommand
    assert h["batch_size"] == 5 and h["seq_len"] == 7 and h["max_batches"] == 2 and h["lazy"] is False
    assert h["budget_bytes"] == 9 * 2**20


def test_a_stray_or_misspelt_flag_is_named_in_one_line():
    cases = {
        ("--batchsize", "32"): "unrecognized arguments: --batchsize 32; did you mean --batch-size",
        ("--batch-size", "32", "64"): "unrecognized arguments: 64",
        ("32",): "'32' is not a subcommand",
        ("swep",): "did you mean sweep?",
        ("--data", "x", "sweep"): "the subcommand goes first",
        ("--policy", "None"): "invalid choice: 'None'",
        ("--batch-size", "many"): "invalid int value: 'many'",
    }
    for argv, expected in cases.items():
        assert expected in _one_line_error(*_gc_here(*argv)), argv


def test_bad_input_is_one_line_and_exit_2_before_any_work(tmp_path):
    data, out = tiny_ptb(tmp_path), tmp_path / "out"
    tiny = TINY + ["--data", data, "--out", str(out)]
    cases = [
        (["--batch-size", "0"], "--batch-size must be a positive integer, got 0"),
        (["--seq-len", "-3"], "--seq-len must be a positive integer"),
        (["--num-head", "3"], "--num-head 3 must divide --embedding-size 8"),
        (["--num-head", "0"], "--num-head must be a positive integer"),
        (["--accumulation-steps", "0"], "--accumulation-steps must be a positive integer"),
        (["--epochs", "0"], "--epochs must be a positive integer"),
        (["--max-batches", "0"], "--max-batches must be a positive integer"),
        (["--dropout", "1"], "--dropout must be in [0, 1)"),
        (["--dropout", "-0.1"], "--dropout must be in [0, 1)"),
        (["--activation-bits", "3"], "--activation-bits with --activation relu is 1"),
        (["--precision", "mixed-fp16", "--init-scale", "0"], "--init-scale must be a positive number, got 0"),
        (["--budget_mb", "5"], "--budget-mb is the bound of --policy budget"),
        (["--policy", "budget"], "policy budget needs --budget-mb"),
        (["--use-gc", "1", "--policy", "off"], "give one of them"),
        (["--policy", "sqrt", "--segment-len", "2"], "--segment-len sets the checkpoints of policy all"),
        (["--data", str(tmp_path / "missing")], "does not exist"),
        (["--data", str(tmp_path)], "has no train.txt and test.txt"),
        (["--batch-size", "100000"], "too small"),
        (["--policy", "budget", "--budget-mb", "0.001"], "is infeasible: the least M_peak"),
        (["--policy", "budget", "--budget-mb", "0.001", "--no-lazy"], "is infeasible: the least M_peak"),
    ]
    commands = [tiny + argv for argv, _ in cases] + [
        ["sweep", "--values", "4", "0"] + tiny,
        ["sweep", "--over", "segment_len", "--policies", "off", "sqrt", "--values", "2"] + tiny,
        ["sweep", "--budget-mb", "5"] + tiny,
        ["max-batch"] + tiny,
        ["plot", str(tmp_path / "missing")],
        ["plot", str(tmp_path)],  # a folder without gc.py JSON
        ["ablate", "--batch-size", "6", "--rows", "baseline", "accumulate"],
        ["ablate", "--rows", "baseline", "--budget-mb", "5"],
    ]
    expected = [e for _, e in cases] + ["--values must be positive integers", "compares policies off and all only",
                                        "add budget to --policies", "required: --memory-limit-mb",
                                        "is not a folder", "holds no gc.py run, sweep, max-batch or ablation JSON",
                                        "give a --batch-size that divides by 4, not 6", "add budget to --rows"]
    results = [_gc_here(*argv) for argv in commands]
    for argv, text, result in zip(commands, expected, results):
        line = _one_line_error(*result)
        assert text in line, (argv, line)
    infeasible = [line for line in (r[2] for r in results) if "infeasible" in line][0]
    minimum = int(infeasible.split(" bytes)")[0].split("(")[-1])
    assert minimum > 0 and "or more" in infeasible  # the one line names the minimum
    assert not out.exists()  # no pass ran: neither gc off nor gc on wrote a JSON


def test_policy_off_runs_gc_off_alone(tmp_path, capsys):
    out = tmp_path / "out"
    run_gc(TINY + ["--data", tiny_ptb(tmp_path), "--out", str(out), "--policy", "off"])
    printed = capsys.readouterr().out
    assert "gc off\n" in printed and "gc on" not in printed
    (name,) = os.listdir(out)
    record = strict_json(out / name)
    assert record["policy"] == "off" and record["use_gc"] is False and record["recomputed_nodes"] == 0


def test_the_header_shows_the_effective_batch_of_accumulation(tmp_path, capsys):
    out = tmp_path / "out"
    run_gc(TINY + ["--data", tiny_ptb(tmp_path), "--out", str(out), "--use-gc", "0", "--batch-size", "2",
                           "--accumulation-steps", "3", "--max-batches", "1"])
    assert "batch 2 x 3 = 6" in capsys.readouterr().out
    (name,) = os.listdir(out)
    record = strict_json(out / name)
    assert record["accumulation_steps"] == 3 and record["effective_batch_size"] == 6


# ----- progress on stderr, tables on stdout --------------------------------------------------------------------------
@pytest.fixture
def bar_names(monkeypatch):
    """The `desc` of every tqdm.auto bar made while the test runs, in order."""
    import tqdm.auto

    made = []

    class Recorded(tqdm.auto.tqdm):
        def __init__(self, *args, **kwargs):
            made.append(kwargs.get("desc"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorded)
    return made


def test_progress_bars_go_to_stderr_and_tables_stay_on_stdout(tmp_path, bar_names):
    made = bar_names
    data = tiny_ptb(tmp_path)
    run_gc(TINY + ["--data", data, "--out", str(tmp_path / "bars"), "--max-batches", "1"])
    assert made == ["gc off", "gc on, all"]  # tqdm.auto's bars: a widget in a notebook, a text bar in a terminal
    argv = TINY + ["--data", data, "--out", str(tmp_path / "out")]
    with ThreadPoolExecutor(2) as pool:
        (code, out, err), (code_quiet, _, err_quiet) = pool.map(lambda a: _gc(*a), [argv + ["--progress"], argv])
    assert code == 0 and code_quiet == 0
    assert "gc off:" in err and "gc on, all:" in err and "step/s" in err or "s/step" in err  # bars: rate and ETA
    assert "\r" not in out and "M_act (MB)" in out and "step   0  loss" in out
    assert err_quiet == ""  # stderr is not a terminal: no bars unless asked


def test_sweep_prints_a_line_per_run_as_it_starts_and_ends(tmp_path, capsys):
    run_gc(["sweep", "--values", "4", "--repeats", "1", "--policies", "off", "--out", str(tmp_path / "out"),
                    "--data", tiny_ptb(tmp_path)] + TINY)
    captured = capsys.readouterr()
    assert "[1/1] start  batch_size=4 policy=off rep 0" in captured.err
    assert "[1/1] done   batch_size=4 policy=off rep 0: M_act" in captured.out
    assert "seq_len 5, embedding 8" in captured.out  # the rest of the configuration, once


def test_train_and_evaluate_ptb_end_with_a_line_of_loss_and_perplexity(capsys, bar_names):
    made = bar_names
    device = ndl.cpu() if DEVICE == "cpu" else ndl.cpu_numpy()
    data = ndl.data.batchify(list(np.random.RandomState(0).randint(0, 20, size=400)), 4, device, "float32")
    model = LanguageModel(8, 20, 8, num_layers=1, seq_model="rnn", device=device)
    simple_ml.train_ptb(model, data, seq_len=5, device=device, progress=True)
    simple_ml.evaluate_ptb(model, data, seq_len=5, device=device, progress=True)
    err = capsys.readouterr().err
    assert made == ["epoch 1/1", "eval"]  # tqdm.auto's bar
    for desc in ("epoch 1/1", "eval"):
        final = [seg for seg in err.replace("\r", "\n").splitlines() if seg.startswith(desc)][-1]
        assert "100%" in final and "loss=" in final and "ppl=" in final, final


# ----- JSON: by default, self-describing, written as it goes -------------------------------------------------------
def test_json_is_written_by_default_and_describes_itself(tmp_path, capsys, monkeypatch):
    data = tiny_ptb(tmp_path)
    monkeypatch.chdir(tmp_path)
    argv = TINY + ["--data", data, "--seed", "3", "--lr", "0.002"]
    run_gc(argv)
    printed = capsys.readouterr().out
    files = sorted(os.listdir(tmp_path / "results"))
    assert len(files) == 2 and f"wrote results{os.sep}" in printed
    for name in files:
        r = strict_json(tmp_path / "results" / name)
        assert r["data"] == data and r["vocab_size"] == 31 and r["seed"] == 3 and r["lr"] == 0.002  # 30 words + eos
        assert r["device"] and r["threads"] >= 1 and r["started_at"] and r["argv"] == ["gc.py"] + argv
        assert r["needle_commit"] is None or len(r["needle_commit"]) == 40
        for key in ("batch_size", "seq_len", "embedding_size", "hidden_size", "num_layers", "num_head", "dropout",
                    "accumulation_steps", "epochs", "max_batches", "warmup", "lazy", "policy", "head_init_scale"):
            assert key in r, key
        # one unit per kind: bytes and seconds, no MB anywhere; the earlier project's keys are documented aliases
        assert not [k for k in r if k.endswith("_mb")] and not [k for s in r["steps"] for k in s if k.endswith("_mb")]
        assert r["aliases"] == {"time": "step_time_seconds", "time_per_batch_median": "step_time_seconds",
                                "peak memory": "peak_bytes", "use_gc": "policy != 'off'"}
        assert r["time"] == r["time_per_batch_median"] == r["step_time_seconds"]
        assert r["peak memory"] == r["peak_bytes"] and r["use_gc"] == (r["policy"] != "off")
        for key in ("peak_activation_bytes", "activation_bytes", "floor_bytes", "step_peak_bytes", "peak_bytes"):
            assert isinstance(r[key], int)


def test_needle_commit_is_none_outside_a_repository(bare_checkout_run):
    _, record = bare_checkout_run
    assert "needle_commit" in record and record["needle_commit"] is None


def test_sweep_json_is_written_as_the_sweep_goes(tmp_path, monkeypatch):
    out = tmp_path / "out"
    real_run, seen = subprocess.run, []

    def watched(cmd, *args, **kwargs):
        if "--json" in cmd:  # a child `gc.py run`: the runs before this one are on disk
            path = out / "sweep.json"
            seen.append(len(strict_json(path)) if path.exists() else 0)
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", watched)
    run_gc(["sweep", "--values", "4", "6", "--repeats", "1", "--policies", "off", "all", "--out", str(out),
            "--data", tiny_ptb(tmp_path)] + TINY)
    assert seen == [0, 1, 2, 3]


def test_t_step_from_fewer_than_3_timed_steps_is_flagged(tmp_path, capsys):
    out = tmp_path / "out"
    run_gc(TINY + ["--data", tiny_ptb(tmp_path), "--out", str(out), "--max-batches", "3", "--warmup", "1"])
    printed = capsys.readouterr().out
    assert "unreliable: from 2 timed steps (< 3)" in printed and "time overhead" in printed
    for name in os.listdir(out):
        r = strict_json(out / name)
        assert r["timed_steps"] == 2 and r["step_time_reliable"] is False


# ----- plots ---------------------------------------------------------------------------------------------------------
def _figures(monkeypatch):
    """The figures gc.py's plot functions draw, kept for inspection instead of closed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kept = []
    monkeypatch.setattr(plt, "close", kept.append)
    return kept


def test_plot_draws_every_kind_of_json_a_folder_holds(tmp_path, capsys, monkeypatch):
    from matplotlib.colors import to_rgba

    out = tmp_path / "out"
    run_gc(TINY + ["--data", tiny_ptb(tmp_path), "--out", str(out)])  # 3 steps, warmup 1: T unreliable
    off, on = sorted((_read(out / f) for f in os.listdir(out)), key=lambda r: r["use_gc"])
    # A sweep and a max-batch search, written from these records as gc.py writes them (without running them)
    sweep = []
    for rep in range(2):
        for b in (4, 8):
            for r in (on, off):
                sweep.append({**r, "batch_size": b, "activation_bytes": r["activation_bytes"] * b // 4,
                              "time": r["time"] * (1 + rep / 10), "repeat": rep, "label": r["policy"],
                              "sweep_id": "s1", "sweep_over": "batch_size"})
    _write(out / "sweep-s1.json", sweep)
    _write(out / "sweep.json", sweep)  # the same sweep again: drawn once
    _write(out / "sweep-s1_batch_size4_all_rep0.json", sweep[0])  # a child's: not a run of its own
    _write(out / "max_batch.json", {**off, "kind": "max-batch", "max_batch_id": "m1", "steps": None,
                                    "largest_batch": {"all": 24, "off": 10}, "tries": []})
    figures = _figures(monkeypatch)
    capsys.readouterr()
    run_gc(["plot", str(out)])
    pngs = sorted(f for f in os.listdir(out) if f.endswith(".png"))
    assert len(pngs) == 3 and pngs[0] == "max_batch-m1.png" and pngs[2] == "sweep_batch_size-s1.png", pngs
    assert pngs[1].startswith("runs_b4x5_e8_h8_l1_v31_3steps-"), pngs
    for name in pngs:
        with open(out / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    runs, sweep_fig, max_fig = figures  # drawn in this order
    for fig in figures:
        titles = (fig._suptitle.get_text() if fig._suptitle else "") + fig.axes[0].get_title()
        assert "embedding 8, feed-forward 8, 1 layer," in titles  # the configuration, as a subtitle
        for ax in fig.axes:
            assert ax.get_ylim()[0] == 0  # y from 0
    assert "M_act" in runs.axes[0].get_title() and "M_act" in sweep_fig.axes[0].get_title()
    assert [t.get_text() for t in runs.axes[0].get_xticklabels()] == ["off", "all"]  # off first ...
    red, green, blue, _ = to_rgba(runs.axes[0].patches[0].get_facecolor())
    assert red == green == blue and 0 < red < 1  # ... in grey
    assert [t.get_text() for t in sweep_fig.axes[0].get_legend().get_texts()][:2] == ["off", "all"]
    assert list(sweep_fig.axes[0].get_xticks()) == [4, 8]  # integer ticks: the swept values
    assert any(type(c).__name__ == "ErrorbarContainer" for c in sweep_fig.axes[2].containers)  # over repeats
    assert all(float(t).is_integer() for t in max_fig.axes[0].get_yticks())
    assert [t.get_text() for t in max_fig.axes[0].get_xticklabels()] == ["off", "all"]
    assert "T_step" in runs.axes[2].get_title() and "unreliable" in runs.axes[2].get_title()


# ----- the demo tells the truth --------------------------------------------------------------------------------------



def test_the_demo_model_halves_the_step_peak_and_says_where_the_loss_starts(tmp_path, capsys):
    # The defaults are the demo (`make demo` runs `python gc.py`): one step each, on the synthetic corpus.
    run_gc(["--max-batches", "1", "--warmup", "0", "--data", "synthetic", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "loss at init: about ln(10000) = 9.21, a uniform guess" in printed
    assert "output layer: its logits (1024 tokens x 10000 words x 4 bytes)" in printed
    off, on = sorted((_read(tmp_path / f) for f in os.listdir(tmp_path)), key=lambda r: r["use_gc"])
    assert 1 - on["peak_activation_bytes"] / off["peak_activation_bytes"] >= 0.5  # README: >= 50% lower
    assert abs(off["steps"][0]["loss"] - math.log(10000)) < 0.5


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_installs_only_the_runtime_and_make_test_the_extras(tmp_path):
    def dry_run(target, build):
        proc = subprocess.run(["make", "-n", target, f"BUILD_DIR={build}"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return [ln for ln in proc.stdout.splitlines() if "pip install -e" in ln]

    fresh = tmp_path / "fresh"
    (demo_install,) = dry_run("demo", fresh)
    assert demo_install.rstrip().endswith('pip install -e ".[experiment]"') and "test" not in demo_install
    assert ".[test,torch,distributed,experiment]" in dry_run("test", tmp_path / "fresh2")[0]
    full = tmp_path / "full"  # after `make test`'s install, the demo installs nothing
    full.mkdir()
    (full / ".deps-installed").touch()
    assert dry_run("demo", full) == []
    demo_only = tmp_path / "demo_only"  # after the demo's install, `make test` still installs the extras
    demo_only.mkdir()
    (demo_only / ".deps-demo-installed").touch()
    assert dry_run("demo", demo_only) == [] and ".[test,torch,distributed,experiment]" in dry_run("test", demo_only)[0]


def test_download_without_a_network_says_so_and_which_files_go_where(tmp_path, monkeypatch, capsys):
    def offline(url, path):
        raise urllib.error.URLError(socket.gaierror(-2, "Name or service not known"))

    monkeypatch.setattr(download, "fetch", offline)
    assert download.main(["ptb", "--dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "no network" in err
    for remote in download.DATASETS["ptb"]:
        assert remote.url in err and os.path.join(str(tmp_path), remote.path) in err


# ----- the LM head (--head full|fused) and gc.py ablate ---------------------------------------------------------------
@pytest.mark.parametrize("policy, k", [("off", 1), ("all", 2)])
def test_the_fused_and_the_full_head_give_the_same_first_step_loss(tmp_path, capsys, policy, k):
    data, records = tiny_ptb(tmp_path), {}
    for head in ("full", "fused"):
        path = tmp_path / f"{head}.json"
        run_gc(TINY + ["--data", data, "--json", str(path), "--policy", policy, "--head", head,
                               "--use-gc", str(int(policy != "off")),
                               "--batch-size", str(4 // k), "--accumulation-steps", str(k), "--max-batches", "2"])
        assert f"{head} head" in capsys.readouterr().out  # in the header
        records[head] = strict_json(path)
        assert records[head]["head"] == head and records[head]["policy"] == policy
    full, fused = records["full"], records["fused"]
    assert abs(full["steps"][0]["loss"] - fused["steps"][0]["loss"]) < 1e-5  # the fused head is exact
    assert abs(full["loss"] - fused["loss"]) < 1e-4  # and trains alike
    # the default head, fused: asserted on a run without --head (test_gc_script_runs_and_writes_the_measurements)


ABLATE_TINY = ["--batch-size", "4", "--seq-len", "5", "--embedding-size", "8", "--hidden-size", "8",
               "--num-layers", "1", "--num-head", "2", "--warmup", "1", "--device", DEVICE]


def test_ablate_prints_one_table_and_writes_its_json_and_png(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    run_gc(["ablate", "--steps", "2", "--rows", "baseline", "fused", "--data", tiny_ptb(tmp_path), "--out", str(out),
            *ABLATE_TINY])  # each row a child process, as always
    printed = capsys.readouterr().out
    table = printed.split("\nrow ")[1]  # the table, after the lines each row printed as it ended
    assert "M_act MB" in table and "M_peak MB" in table and "T_step s" in table and "loss-base" in table
    lines = [ln.split()[0] for ln in table.splitlines()[1:3]]
    assert lines == ["baseline", "fused"]
    result = strict_json(out / "ablation.json")
    assert result["kind"] == "ablation" and result["steps_per_row"] == 2 and result["batch_size"] == 4
    assert [r["row"] for r in result["rows"]] == ["baseline", "fused"]
    for r in result["rows"]:
        for key in ("setup", "policy", "head", "activation_bytes", "peak_activation_bytes", "rss_peak_bytes",
                    "step_time_seconds", "loss", "loss_diff", "peak_change", "time_change", "json"):
            assert key in r, key
        assert strict_json(r["json"])["ablation_id"] == result["ablation_id"]  # each row's own run JSON
    base, fused = result["rows"]
    assert (base["policy"], base["head"], fused["policy"], fused["head"]) == ("off", "full", "off", "fused")
    assert base["loss_diff"] == 0 and abs(fused["loss_diff"]) < 1e-4
    with open(out / "ablation.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # plot redraws the ablation, and draws no run plot of the rows' own JSON
    os.remove(out / "ablation.png")
    _figures(monkeypatch)
    run_gc(["plot", str(out)])
    assert sorted(f for f in os.listdir(out) if f.endswith(".png")) == ["ablation.png"]


def test_ablate_names_an_unknown_row_in_one_line():
    # a fresh process: a bad input is exit status 2 and one line on stderr as a shell sees them (the other bad-input
    # tests run gc.py's main in this process)
    line = _one_line_error(*_gc("ablate", "--rows", "baseline", "mixed-fp64", "fused"))
    assert "unknown row mixed-fp64" in line and "baseline accumulate all sqrt selective budget fused combined" in line


# ----- the front door (issue 26, item 10): what a run writes, and what it can hold, checked before any work --------
def test_output_paths_are_checked_before_any_work_and_nothing_is_left_behind(tmp_path):
    data = tiny_ptb(tmp_path)
    folder, a_file = tmp_path / "folder", tmp_path / "a_file"
    (folder / "x.npz").mkdir(parents=True)  # --save-checkpoint folder/x writes folder/x.npz: a folder here
    a_file.write_text("not a folder\n")
    tiny = TINY + ["--data", data]
    cases = [
        (tiny + ["--use-gc", "1", "--json", folder], f"--json {folder} is a folder; give a file name"),
        (tiny + ["--use-gc", "1", "--json", a_file / "run.json"], f"{a_file} is a file, so nothing can be created"),
        (tiny + ["--out", a_file], f"--out {a_file} is a file; give a folder"),
        (tiny + ["--out", a_file / "sub"], f"{a_file} is a file, so nothing can be created under it"),
        (tiny + ["--out", "/sys/gc-results"], "cannot write in /sys"),  # sysfs creates no files, not even for root
        (tiny + ["--use-gc", "1", "--save-checkpoint", folder / "x"],
         f"--save-checkpoint {folder / 'x.npz'} is a folder"),
        (["sweep"] + tiny + ["--out", a_file], f"--out {a_file} is a file"),
        (["max-batch"] + tiny + ["--memory-limit-mb", "9", "--out", a_file], f"--out {a_file} is a file"),
        (["ablate", "--rows", "baseline", "--data", data, "--out", a_file], f"--out {a_file} is a file"),
    ]
    for argv, expected in cases:
        assert expected in _one_line_error(*_gc_here(*argv)), argv
    left = sorted(os.path.relpath(os.path.join(d, f), tmp_path) for d, _, fs in os.walk(tmp_path) for f in fs)
    assert left == ["a_file", "ptb/test.txt", "ptb/train.txt"]  # no JSON, no .tmp, no checkpoint
    assert sorted(os.listdir(folder)) == ["x.npz"]


def test_a_write_that_fails_later_is_one_line_and_leaves_no_temporary_file(tmp_path, monkeypatch, capsys):
    path = tmp_path / "out" / "run.json"
    real_say = run_command.say

    def folder_appears(line):  # after the first step's JSON: the path turns into a folder
        real_say(line)
        if path.is_file():
            path.unlink()
            path.mkdir()

    monkeypatch.setattr(run_command, "say", folder_appears)
    with pytest.raises(SystemExit) as exit_:
        run_gc(TINY + ["--data", tiny_ptb(tmp_path), "--use-gc", "1", "--json", str(path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"gc.py: cannot write {path}: Is a directory" in err and "Traceback" not in err
    assert os.listdir(tmp_path / "out") == ["run.json"] and path.is_dir()  # no .tmp beside it
    ckpt = tmp_path / "ckpt.npz"  # the same for a checkpoint: saved after step 1, a folder by step 2's save

    def checkpoint_folder_appears(line):
        if ckpt.is_file():
            ckpt.unlink()
            ckpt.mkdir()

    monkeypatch.setattr(run_command, "say", checkpoint_folder_appears)
    with pytest.raises(SystemExit) as exit_:
        run_gc(TINY + ["--data", str(tmp_path / "ptb"), "--use-gc", "1", "--json", str(tmp_path / "r.json"),
                       "--save-checkpoint", str(ckpt), "--save-every", "1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"gc.py: --save-checkpoint: cannot write {ckpt}" in err and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == ["ckpt.npz", "out", "ptb", "r.json"]  # no .tmp


def test_stochastic_rounding_outside_pure_bf16_is_refused(tmp_path):
    data = tiny_ptb(tmp_path)
    for precision in ("fp32", "mixed-bf16"):
        line = _one_line_error(*_gc_here(*TINY, "--data", data, "--precision", precision, "--stochastic-rounding"))
        assert "--stochastic-rounding is for pure bf16 training (--precision bf16)" in line
        assert f"--precision {precision} keeps float32 weights" in line
    line = _one_line_error(*_gc_here("sweep", *TINY, "--data", data, "--stochastic-rounding"))
    assert "--stochastic-rounding" in line


def test_a_model_that_cannot_fit_is_refused_before_it_is_built(tmp_path):
    data = tiny_ptb(tmp_path)
    line = _one_line_error(*_gc_here(*TINY, "--data", data, "--embedding-size", "100000000"))
    assert "the model would not fit" in line and "--embedding-size 100000000" in line
    # the estimate (4 bytes per weight: 4 x 1e8^2 of attention projections alone) and what the machine has
    assert "GiB of parameters" in line and ("the machine's memory gives" in line or "memory limit" in line)
    need = float(line.split("need at least ")[1].split(" GiB")[0].replace(",", ""))
    assert need >= 0.99 * 4 * 4 * 4e16 / 2**30  # 4e16 attention weights, 4 bytes, 4 copies (+ grads, 2 moments)
    line = _one_line_error(*_gc_here(*TINY, "--data", data, "--embedding-size", "512", "--memory-limit-mb", "1"))
    assert "the model would not fit" in line and "--memory-limit-mb 1 gives 1.0 MiB" in line
    out = tmp_path / "out"  # sweep and max-batch check every configuration before their first child
    for argv in (["sweep", "--over", "embedding-size", "--values", "8", "100000000"],
                 ["max-batch", "--embedding-size", "512", "--memory-limit-mb", "1"]):
        line = _one_line_error(*_gc_here(argv[0], *TINY, *argv[1:], "--data", data, "--out", out))
        assert "the model would not fit" in line, argv
    assert not out.exists()


def test_a_corpus_that_is_not_utf8_is_one_line_naming_the_file(tmp_path):
    data = tiny_ptb(tmp_path)
    with open(os.path.join(data, "train.txt"), "ab") as f:
        f.write(b"caf\xe9 latin-1\n")
    line = _one_line_error(*_gc_here(*TINY, "--data", data))
    assert os.path.join(data, "train.txt") in line and "not UTF-8" in line


# ----- saving and resuming (issue 26, item 6): --save-checkpoint, --resume ---------------------------------------
def _losses_and_digest(path):
    record = strict_json(path)
    return [s["loss"] for s in record["steps"]], record["parameters_sha256"], [s["step"] for s in record["steps"]]


@pytest.mark.parametrize("flags", [
    ["--dropout", "0.2"],  # dropout: the resumed run must draw the masks the uninterrupted one did
    ["--precision", "mixed-fp16", "--init-scale", "1e6", "--policy", "selective"],  # the scale backs off at step 1
    ["--precision", "bf16", "--stochastic-rounding", "--no-lazy", "--optimizer", "sgd"],
    ["--optimizer", "adam8bit", "--accumulation-steps", "2", "--policy", "sqrt"],
    # compression's rounding noise: the resumed run must go on counting the values compressed, not restart
    ["--activation", "gelu", "--policy", "selective", "--compress-bits", "8"],
], ids=["adam-dropout", "mixed-fp16", "bf16-sgd-eager", "adam8bit-accumulate", "compress8"])
def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(tmp_path, capsys, flags):
    data, ckpt = tiny_ptb(tmp_path), str(tmp_path / "ckpt")
    run = TINY + ["--data", data, "--use-gc", "1"] + flags
    run_gc(run + ["--max-batches", "5", "--json", str(tmp_path / "whole.json")])
    run_gc(run + ["--max-batches", "2", "--json", str(tmp_path / "first.json"), "--save-checkpoint", ckpt])
    run_gc(run + ["--max-batches", "5", "--json", str(tmp_path / "rest.json"), "--resume", ckpt])
    whole, first, rest = (_losses_and_digest(tmp_path / f"{name}.json") for name in ("whole", "first", "rest"))
    assert first[2] == [0, 1] and rest[2] == [2, 3, 4] and strict_json(tmp_path / "rest.json")["first_step"] == 2
    assert first[0] + rest[0] == whole[0]  # every step's loss, to the bit
    assert rest[1] == whole[1] != first[1]  # the final parameters, to the byte
    saved = ndl.load(ckpt)
    assert saved["step"] == 2 and set(saved) == {"step", "config", "model", "optimizer", "scaler", "rng", "compress"}
    assert (saved["compress"] is None) == ("--compress-bits" not in flags)


def test_a_run_interrupted_after_a_periodic_save_resumes_where_it_was(tmp_path, monkeypatch, capsys):
    data, ckpt = tiny_ptb(tmp_path), str(tmp_path / "ckpt")
    run = TINY + ["--data", data, "--use-gc", "1", "--dropout", "0.1", "--max-batches", "6"]
    run_gc(run + ["--json", str(tmp_path / "whole.json")])
    real_step, calls = ndl.optim.Adam.step, []

    def interrupted(self):  # Ctrl-C in the fourth step's optimizer update, after the save at step 2
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(ndl.optim.Adam, "step", interrupted)
    with pytest.raises(SystemExit) as stopped:  # Ctrl-C: exit status 130
        run_gc(run + ["--json", str(tmp_path / "first.json"), "--save-checkpoint", ckpt, "--save-every", "2"])
    assert stopped.value.code == 130
    monkeypatch.undo()
    assert ndl.load(ckpt)["step"] == 2
    run_gc(run + ["--json", str(tmp_path / "rest.json"), "--resume", ckpt, "--save-checkpoint", ckpt])
    (whole, whole_digest, _), (rest, rest_digest, _) = (_losses_and_digest(tmp_path / f"{name}.json")
                                                        for name in ("whole", "rest"))
    first = [s["loss"] for s in strict_json(tmp_path / "first.json")["steps"]]  # 3 steps ended, then Ctrl-C
    assert len(first) == 3 and first[:2] + rest == whole and rest_digest == whole_digest
    assert ndl.load(ckpt)["step"] == 6  # saved again when the resumed run ended


def test_the_activation_flags_build_the_mlp_with_them_and_the_json_says_which(tmp_path, capsys):
    data = tiny_ptb(tmp_path)
    runs = {"relu": [], "silu": ["--activation", "silu"], "silu-2": ["--activation", "silu", "--activation-bits", "2"]}
    for name, flags in runs.items():
        run_gc(TINY + ["--data", data, "--use-gc", "1", "--max-batches", "2", "--json", str(tmp_path / f"{name}.json")]
               + flags)
    relu, silu, few = (strict_json(tmp_path / f"{name}.json") for name in runs)
    assert (relu["activation"], silu["activation"], few["activation"]) == ("relu", "silu", "silu")
    assert (silu["activation_bits"], few["activation_bits"]) == (None, 2)
    assert relu["loss"] != silu["loss"] != few["loss"]  # other models: the flags reached them


def test_compress_bits_wraps_gc_ons_policy_and_the_json_says_so(tmp_path, capsys):
    data = tiny_ptb(tmp_path)
    base = TINY + ["--data", data, "--max-batches", "2", "--activation", "gelu", "--no-lazy"]
    run_gc(base + ["--use-gc", "0", "--json", str(tmp_path / "off.json")])
    run_gc(base + ["--policy", "off", "--use-gc", "1", "--compress-bits", "8", "--json", str(tmp_path / "c.json")])
    run_gc(base + ["--policy", "selective", "--use-gc", "1", "--compress-bits", "4", "--json",
                   str(tmp_path / "s.json")])
    off, alone, selective = (strict_json(tmp_path / f"{name}.json") for name in ("off", "c", "s"))
    assert (alone["policy"], alone["compress_bits"]) == ("off+compress8", 8)
    assert (selective["policy"], selective["compress_bits"]) == ("selective+compress4", 4)
    assert off["compress_bits"] is None
    assert alone["activation_bytes"] < off["activation_bytes"]  # compression alone: the codes, not the values
    assert abs(alone["loss"] - off["loss"]) < 1e-2 * abs(off["loss"])


def test_a_resume_that_does_not_match_the_run_is_one_line_naming_the_flag(tmp_path, capsys):
    data, ckpt = tiny_ptb(tmp_path), str(tmp_path / "ckpt")
    run = TINY + ["--data", data, "--use-gc", "1", "--json", str(tmp_path / "r.json")]
    run_gc(run + ["--max-batches", "2", "--save-checkpoint", ckpt])
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    cases = [
        (["--embedding-size", "16"], "was saved by a run with --embedding-size 8, this run has 16"),
        (["--optimizer", "sgd"], "was saved by a run with --optimizer adam, this run has sgd"),
        (["--activation", "gelu"], "was saved by a run with --activation relu, this run has gelu"),
        (["--compress-bits", "8"], "was saved by a run with --compress-bits None, this run has 8"),
        (["--precision", "bf16"], "--precision fp32, this run has bf16"),
        (["--max-batches", "2"], "is at step 2, and this run's schedule (--max-batches x --epochs) ends at step 2"),
        (["--resume", str(tmp_path / "missing")], f"there is no file {tmp_path / 'missing.npz'}"),
        (["--resume", str(tmp_path / "junk.npz")], "is not an .npz archive"),
        (["--save-every", "2"], "--save-every N saves to --save-checkpoint FILE"),
        (["--save-every", "0", "--save-checkpoint", ckpt], "--save-every must be a positive integer"),
    ]
    for argv, expected in cases:
        line = _one_line_error(*_gc_here(*run, "--max-batches", "4", "--resume", ckpt, *argv))
        assert expected in line, (argv, line)
    both = _one_line_error(*_gc_here(*TINY, "--data", data, "--save-checkpoint", ckpt))
    assert "--save-checkpoint carries one pass's training; give --use-gc 0 or 1" in both


# ----- the front door, round 3 (issue 27): gc.py's own items ---------------------------------------------------------
def test_ctrl_c_is_one_line_exit_130_and_the_json_says_incomplete(tmp_path):
    out = tmp_path / "out"
    args = [*TINY, "--max_batches", "100000", "--data", tiny_ptb(tmp_path, num_lines=4000), "--out", str(out),
            "--use_gc", "1"]
    # gc.py with Python's own SIGINT handler installed, as in a terminal: a test runner started in the background
    # has SIGINT ignored, and a child inherits that (Python then installs no KeyboardInterrupt handler)
    code = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            f"sys.argv = ['gc.py', *{args!r}]; runpy.run_path({os.path.join(ROOT, 'gc.py')!r}, run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1200):  # until two steps are on disk (or the run ended: the asserts below say how)
            names = [n for n in os.listdir(out) if n.endswith(".json")] if out.exists() else []
            if proc.poll() is not None or names and len(_read_quietly(out / names[0]).get("steps", [])) >= 2:
                break
            time.sleep(0.1)
        for _ in range(20):  # as a user presses Ctrl-C again if the first did not end it (once seen under load)
            if proc.poll() is not None:
                break
            proc.send_signal(signal.SIGINT)
            time.sleep(0.5)
        printed, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (printed, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    (name,) = os.listdir(out)
    assert "interrupted at step " in err and f"results so far in {out / name}" in err, err
    record = strict_json(out / name)
    assert record["complete"] is False and len(record["steps"]) >= 2


def _read_quietly(path):
    """A JSON being rewritten as we read it: {} until it parses."""
    try:
        return _read(path)
    except (OSError, ValueError):
        return {}


def test_a_finished_run_is_complete_and_plot_marks_an_interrupted_one(tmp_path, monkeypatch):
    out = tmp_path / "out"
    run_gc(TINY + ["--data", tiny_ptb(tmp_path), "--out", str(out), "--use_gc", "0"])
    (name,) = os.listdir(out)
    record = _read(out / name)
    assert record["complete"] is True
    _write(out / "stopped.json", {**record, "policy": "all", "use_gc": True, "complete": False,
                                  "steps": record["steps"][:2]})
    figures = _figures(monkeypatch)
    run_gc(["plot", str(out)])
    ticks = [t.get_text() for t in figures[0].axes[0].get_xticklabels()]
    assert ticks == ["off", "all\n(incomplete: 2 steps)"], ticks


def test_plot_draws_each_run_set_into_its_own_png(tmp_path, capsys):
    out, data = tmp_path / "out", tiny_ptb(tmp_path)
    run_gc(TINY + ["--data", data, "--out", str(out)])
    run_gc(TINY + ["--data", data, "--out", str(out), "--max_batches", "2", "--policy", "sqrt"])  # same model size
    run_gc(["plot", str(out)])
    pngs = sorted(f for f in os.listdir(out) if f.endswith(".png"))
    assert len(pngs) == 2 and "2steps" in pngs[0] and "3steps" in pngs[1], pngs
    printed = capsys.readouterr().out
    assert all(name in printed for name in pngs)


def test_a_budget_above_gc_offs_peak_says_nothing_to_drop(tmp_path, capsys):
    data = tiny_ptb(tmp_path)
    run_gc(TINY + ["--data", data, "--policy", "budget", "--budget-mb", "1000", "--use-gc", "1",
                   "--json", str(tmp_path / "slack.json")])
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if "nothing to drop" in ln]
    assert line.startswith("--budget-mb 1000 is above gc off's peak of ") and " MB: nothing to drop" in line
    record = strict_json(tmp_path / "slack.json")
    assert record["recomputed_nodes"] == 0  # slack indeed
    tight = record["budget_minimum_bytes"] / 2**20 * 1.01  # just above the least M_peak: Budget drops something
    run_gc(TINY + ["--data", data, "--policy", "budget", "--budget-mb", f"{tight:.4f}", "--use-gc", "1",
                   "--json", str(tmp_path / "tight.json")])
    assert "nothing to drop" not in capsys.readouterr().out


@pytest.mark.parametrize("precision", ["fp32", "mixed-fp16"])
def test_the_header_names_the_precision_the_loss_scale_and_the_skipped_steps(tmp_path, capsys, precision):
    run_gc(TINY + ["--data", tiny_ptb(tmp_path), "--precision", precision, "--init-scale", "1e30", "--out",
                   str(tmp_path / "out")])
    printed = capsys.readouterr().out
    header = printed.split("gc off:")[0]
    assert f"precision: {precision} " in header
    if precision == "mixed-fp16":
        assert "loss scale 1e+30" in header  # an absurd scale: float16 overflows, steps are skipped
        for which in ("gc off", "gc on"):
            (line,) = [ln for ln in printed.splitlines() if ln.startswith(f"{which}: loss scale")]
            assert "skipped step" in line and not line.endswith(" 0 skipped steps (gradients overflowed in float16)")
    else:
        assert "loss scale" not in printed


@pytest.mark.parametrize("load", [0.0, 5.0])
def test_the_header_names_the_threads_and_notes_a_busy_machine(tmp_path, capsys, monkeypatch, load):
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    run_gc(TINY + ["--data", tiny_ptb(tmp_path), "--out", str(tmp_path / "out"), "--use-gc", "0"])
    header = capsys.readouterr().out.split("gc off:")[0]
    assert f"threads: {ndl.cpu().num_threads()} " in header and "waiting passively" in header
    assert ("note: the machine is busy (load average 5.0" in header) == (load > 0)


def test_every_row_of_the_table_is_defined_in_help(tmp_path, capsys):
    run_gc(TINY + ["--data", tiny_ptb(tmp_path), "--out", str(tmp_path / "out")])
    table = capsys.readouterr().out.split("gc off       gc on")[1].split("\n\n")[0]
    rows = [line[:18].strip() for line in table.splitlines()[1:] if line.strip()]
    assert "peak bytes (MB)" in rows and "recomputed nodes" in rows, rows
    code, help_text, _ = _gc_here("run", "--help")
    assert code == 0
    for row in rows:
        assert row.split(" (")[0] in help_text, row


def test_the_ablation_plot_says_per_rank_on_data_parallel_rows(tmp_path, monkeypatch):
    from experiment.commands.plot import plot_ablation

    row = {"setup": "s", "loss": 5.0, "activation_bytes": 2**20, "peak_activation_bytes": 2**21,
           "rss_peak_bytes": 2**22, "step_time_seconds": 0.1, "peak_change": 0.0, "time_change": 0.0}
    result = {"rows": [{**row, "row": "baseline"}, {**row, "row": "dp", "parallel": "dp", "peak_change": -0.5}],
              "steps_per_row": 2, "warmup": 1, "batch_size": 4}
    figures = _figures(monkeypatch)
    plot_ablation(result, str(tmp_path))
    names = [t.get_text() for t in figures[0].axes[0].get_yticklabels()]
    assert "per rank" not in names[0] and "per rank" in names[1], names
    texts = [t.get_text() for t in figures[0].axes[0].texts]
    assert texts[1].endswith(" per rank") and "%" not in texts[1], texts


# ----- gc.py timeline ----------------------------------------------------------------------------------------------
def test_timeline_writes_both_snapshots_a_png_and_a_page(tmp_path, capsys):
    out = tmp_path / "out"
    data = tiny_ptb(tmp_path)
    run_gc(["timeline"] + TINY + ["--data", data, "--out", str(out)])
    printed = capsys.readouterr().out
    files = sorted(os.listdir(out))
    stems = {name.rsplit(".", 1)[0] for name in files}
    (stem,) = [s for s in stems if not s.endswith(("_off", "_all"))]
    assert files == sorted([f"{stem}.html", f"{stem}.png", f"{stem}_all.json", f"{stem}_off.json"])
    off, on = (ndl.memory.load(out / f"{stem}_{which}.json") for which in ("off", "all"))
    assert not any(b["category"] == "activation_recomputed" for b in off.blocks)
    assert any(b["category"] == "activation_recomputed" for b in on.blocks)
    for snap in (off, on):
        assert {p["phase"] for p in snap.phases} >= {"forward", "backward", "optimizer"}
        assert f"peak {snap.peak['bytes'] / 2**20:.1f} MB (the allocator's {snap.peak['bytes'] / 2**20:.1f} MB)" \
            in printed
    assert (out / f"{stem}.png").read_bytes()[:4] == b"\x89PNG"
    page = (out / f"{stem}.html").read_text()
    assert "needle-memory-snapshot" in page and "gc off" in page and "gc on (all)" in page
    # another configuration writes files of its own, never over these
    run_gc(["timeline"] + TINY + ["--data", data, "--out", str(out), "--seq-len", "4"])
    assert set(files) < set(os.listdir(out))


# ----- offloading (issue #29): --policy offload, --offload, --host-bandwidth, the budget sweep -----------------------
def test_offloading_flags_are_checked_in_one_line_before_any_work(tmp_path):
    data, out = tiny_ptb(tmp_path), tmp_path / "out"
    tiny = TINY + ["--data", data, "--out", str(out)]
    cases = [
        (["--offload"], "--offload lets Budget park values in host memory: give --policy budget"),
        (["--policy", "offload", "--offload"], "--offload lets Budget park values in host memory"),
        (["--policy", "budget", "--budget-mb", "5", "--host-bandwidth", "0"],
         "--host-bandwidth must be a positive number of GB/s, got 0"),
        (["--policy", "budget", "--budget-mb", "5", "--host-bandwidth", "-16"], "must be a positive number of GB/s"),
        (["--policy", "budget", "--budget-mb", "5", "--host-bandwidth", "nan"], "must be a positive number of GB/s"),
        (["--policy", "budget", "--budget-mb", "5", "--host-bandwidth", "fast"], "invalid float value: 'fast'"),
        (["--policy", "offload", "--host-bandwidth", "16"], "--host-bandwidth is the bandwidth Budget plans"),
        (["--policy", "budget", "--offload", "--budget-mb", "0.001"], "is infeasible: the least M_peak"),
        (["sweep", "--over", "budget_mb", "--values", "0.02", "0"], "--values must be positive numbers of MiB"),
        (["sweep", "--over", "budget_mb", "--values", "0.02", "--policies", "budget", "all"],
         "policy all has no budget"),
        (["sweep", "--over", "budget_mb", "--values", "0.02", "--budget-mb", "5"], "leave --budget-mb out"),
        (["sweep", "--over", "budget_mb", "--values", "0.000001"], "--values 1e-06 is infeasible"),
        (["sweep", "--values", "4.5"], "--values must be positive integers"),
        (["sweep", "--policies", "off", "budget-offload"], "is a curve of gc.py sweep --over budget_mb"),
        (["sweep", "--policies", "off", "--host-bandwidth", "16"], "add budget to --policies"),
        (["ablate", "--rows", "offload-all", "--budget-mb", "5"], "add budget to --rows"),
    ]
    commands = [argv[:1] + tiny + argv[1:] if argv[0] in ("sweep", "ablate") else tiny + argv for argv, _ in cases]
    commands[-1] = ["ablate", "--rows", "offload-all", "--budget-mb", "5"]  # ablate has no --max-batches
    for (argv, text), command in zip(cases, commands):
        assert text in _one_line_error(*_gc_here(*command)), argv
    assert not out.exists()


def test_policy_offload_writes_host_bytes_and_trains_exactly_as_gc_off(tmp_path, capsys):
    out = tmp_path / "out"
    run_gc(TINY + ["--data", tiny_ptb(tmp_path), "--out", str(out), "--policy", "offload", "--seed", "3"])
    printed = capsys.readouterr().out
    off, on = sorted((strict_json(out / f) for f in os.listdir(out)), key=lambda r: r["use_gc"])
    assert on["policy"] == "offload"
    assert on["host_peak_bytes"] > 0 and on["activation_offloaded_bytes"] >= on["host_peak_bytes"]
    assert on["activation_fetched_bytes"] > 0 and on["fetched_nodes"] > 0
    assert on["copy_seconds_exposed"] > 0 and on["copy_hidden_fraction"] == 0  # cpu(): copies are synchronous
    for step in on["steps"]:
        assert step["host_peak_bytes"] > 0 and step["copy_seconds_exposed"] > 0
    assert off["host_peak_bytes"] == 0 and off["activation_offloaded_bytes"] == 0
    assert off["copy_hidden_fraction"] is None  # nothing copied, no share to speak of
    assert on["peak_activation_bytes"] < off["peak_activation_bytes"]  # parked outside the device allocator
    # offload and fetch are copies: the same losses, and after the optimizer the same parameters, bit for bit
    assert on["loss"] == off["loss"]
    assert [s["loss"] for s in on["steps"]] == [s["loss"] for s in off["steps"]]
    assert on["parameters_sha256"] == off["parameters_sha256"]
    table = printed.split("gc off       gc on")[1].split("\n\n")[0]
    rows = [line[:18].strip() for line in table.splitlines()[1:] if line.strip()]
    assert "host memory (MB)" in rows and "copy time (s)" in rows, rows
    code, help_text, _ = _gc_here("run", "--help")
    for row in rows:  # every row stays defined in --help
        assert row.split(" (")[0] in help_text, row


def test_budget_offload_and_host_bandwidth_reach_the_budget_and_the_json(tmp_path, capsys):
    path = tmp_path / "on.json"
    run_gc(TINY + ["--data", tiny_ptb(tmp_path), "--json", str(path), "--use-gc", "1", "--policy", "budget",
                   "--budget-mb", "0.03", "--offload", "--host-bandwidth", "16"])
    r = strict_json(path)
    assert r["policy"] == "budget" and r["budget_offload"] is True
    assert r["host_bandwidth_bytes_per_second"] == 16e9 and r["budget_bytes"] == int(0.03 * 2**20)
    assert r["peak_activation_bytes"] <= r["budget_bytes"]
    assert "predicted_time_seconds" in r and "predicted_host_peak_bytes" in r  # None where Budget does not predict
    argv = ["run", "--policy", "budget", "--budget-mb", "2", "--offload", "--host-bandwidth", "16"]
    budget = setup.make_policy(cli.parse_args(argv))
    assert (budget.bytes, budget.offload, budget.host_bandwidth) == (2 * 2**20, True, 16e9)
    assert setup.make_policy(cli.parse_args(["run", "--policy", "offload"])) == "offload"


def test_a_budget_sweep_draws_three_curves_of_step_time_in_one_png(tmp_path, capsys, monkeypatch):
    from experiment.commands.plot import CURVE_LABELS

    out = tmp_path / "out"
    figures = _figures(monkeypatch)
    run_gc(["sweep", "--over", "budget_mb", "--values", "0.02", "0.03", "--repeats", "1", "--out", str(out),
            "--data", tiny_ptb(tmp_path)] + TINY)
    records = strict_json(out / "sweep.json")
    # the Budget curves at every budget; offload only (which no budget bounds) once
    assert sorted((r["label"], r["sweep_value"]) for r in records) == [
        ("budget", 0.02), ("budget", 0.03), ("budget-offload", 0.02), ("budget-offload", 0.03), ("offload", 0.02)]
    for r in records:
        policy, offload = {"budget": ("budget", False), "offload": ("offload", False),
                           "budget-offload": ("budget", True)}[r["label"]]
        assert (r["policy"], r["budget_offload"]) == (policy, offload), r["label"]
        if policy == "budget":
            assert r["budget_bytes"] == int(r["sweep_value"] * 2**20)
            assert r["peak_activation_bytes"] <= r["budget_bytes"]
    pngs = [f for f in os.listdir(out) if f.endswith(".png")]
    assert len(pngs) == 1 and pngs[0].startswith("sweep_budget_mb-"), pngs
    (fig,) = figures
    step_time = fig.axes[0]
    assert "T_step" in step_time.get_title() and step_time.get_xlabel() == "budget b (MB)"
    labels = [t.get_text() for t in step_time.get_legend().get_texts()]
    assert labels == [CURVE_LABELS[c] for c in ("budget", "offload", "budget-offload")]
    assert "recompute only" in labels[0] and "offload only" in labels[1] and "offload=True" in labels[2]
