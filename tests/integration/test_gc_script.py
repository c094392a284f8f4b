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
import socket
import subprocess
import sys
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
from experiment import ablations

SUBCOMMANDS = ["run", "sweep", "max-batch", "ablate", "timeline", "explain", "plot"]


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


def max_batch_search(folder, *flags):
    """gc.py max-batch as a user runs it (its tries child processes), in `folder`: (exit status, its output, the
    largest batches it wrote, its tries)."""
    data = os.path.join(folder, "ptb")
    if not os.path.exists(data):
        data = tiny_ptb(pathlib.Path(folder), num_lines=2000)
    out = os.path.join(folder, "mb" + "".join(flags))
    code, printed, err = _gc("max-batch", "--memory_limit_mb", "0.5", "--policies", "off", "all", "--data", data,
                             "--out", out, *TINY, *flags, timeout=600)
    path = os.path.join(out, "max_batch.json")
    result = _read(path) if os.path.exists(path) else {}
    return code, printed + err, result.get("largest_batch"), result.get("tries")


def test_max_batch_finds_a_larger_batch_with_checkpointing_and_its_dry_run_the_same(tmp_path):
    """Rule: max-batch --dry-run (bisection on ndl.memory.predict) finds the batch the real search finds, training
    only its answer."""
    code, log, result, _ = max_batch_search(str(tmp_path))
    assert code == 0, log
    assert result["all"] >= result["off"] > 0
    code, log, dry, tries = max_batch_search(str(tmp_path), "--dry-run")
    assert code == 0, log
    assert dry == result
    trained = [t for t in tries if t.get("confirmed")]
    assert len(trained) == 2 and {(t["policy"], t["batch_size"]) for t in trained} == set(result.items())
    assert all(t["seconds"] > 0 for t in trained)  # (bench_predict.py --max-batch sums them: the ratio's floor)
    assert all(t.get("dry_run") for t in tries if not t.get("confirmed"))


def test_explain_prints_the_account_and_each_lever_predicted_and_measured(tmp_path):
    path = tmp_path / "levers.json"
    code, out, err = _gc_here("explain", *TINY, "--data", tiny_ptb(tmp_path), "--head", "full", "--verify",
                              "--json", path)
    assert code == 0, err
    assert "The step's peak will be" in out and "What each lever would make of it" in out
    rows = _read(path)["rows"]
    levers = [r["lever"] for r in rows]
    assert levers[0] == "as given"
    assert {"gc off", "budget 50%", "adam8bit", "fused head", "accumulate x2"} <= set(levers)
    for r in rows:
        assert {"lever", "predicted_peak_bytes", "measured_peak_bytes", "predicted_activation_bytes",
                "measured_activation_bytes"} <= set(r)
        if not r["approximate"]:
            assert r["predicted_peak_bytes"] == r["measured_peak_bytes"], r


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
    status, output)]."""
    folder = pathlib.Path(folder)
    out, data = folder / "out", tiny_ptb(folder)
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "gc.py"), "sweep", "--values", "4", "6", "8",
                               "--repeats", "1", "--policies", "off", "--out", str(out), "--data", data]
                              + TINY + ["--hidden_size", str(hidden)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for hidden in (8, 12)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    return [(hidden, proc.returncode, log) for hidden, proc, log in zip((8, 12), procs, logs)]


def test_two_concurrent_sweeps_into_one_out_folder_do_not_mix(tmp_path):
    for hidden, code, log in two_concurrent_sweeps(str(tmp_path)):
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
    assert "--policy {off,all,sqrt,selective,layers,budget,offload}" in run_help and \
        "None" not in run_help.split("--policy")[1][:48]
    assert "--head {full,fused}" in run_help and "(default: fused)" in run_help.split("--head {full,fused}")[1]
    assert "--rows ROW" in results["ablate"][1] and "--steps N" in results["ablate"][1]
    assert "--memory-limit-mb MB" in results["max-batch"][1] and "(required)" in results["max-batch"][1]
    assert "DIR" in results["plot"][1]
    # that every flag has a help line and both spellings: test_experiment.py, on the parsers themselves


def test_the_help_and_the_usage_say_what_gc_py_does(capsys):
    # --help said cpu()'s offload copies were synchronous (hidden 0%: a run prints 19%) and that M_peak leaves the
    # gradients out (it holds them); the usage line and gc.py's docstring left timeline out.
    help_text = " ".join(_gc_here("run", "--help")[1].split())
    assert "cpu() the copies are synchronous" not in help_text and "on cpu() a copy thread runs them" in help_text
    assert "M_peak holds the gradients" in help_text
    usage = _gc_here("--help")[1].splitlines()[0]
    assert all(name in usage for name in SUBCOMMANDS), usage
    docstring = pathlib.Path(ROOT, "gc.py").read_text().split('"""')[1]
    assert all(f"gc.py {name}" in docstring for name in SUBCOMMANDS if name != "run"), docstring


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
        (["--optimizer-in-backward", "--accumulation-steps", "2"], "cannot go with --accumulation-steps 2"),
        (["--optimizer-in-backward", "--precision", "mixed-fp16"], "cannot go with --precision mixed-fp16"),
        (["--optimizer-in-backward", "--parallel", "dp"], "cannot go with --parallel dp"),
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
        ["sweep", "--optimizer-in-backward", "--accumulation-steps", "2"] + tiny,
    ]
    expected = [e for _, e in cases] + ["--values must be positive integers", "compares policies off and all only",
                                        "add budget to --policies", "required: --memory-limit-mb",
                                        "is not a folder", "holds no gc.py run, sweep, max-batch or ablation JSON",
                                        "give a --batch-size that divides by 4, not 6", "add budget to --rows",
                                        "cannot go with --accumulation-steps 2"]
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
    # steps 1 and 2 follow the warm-up; the last, recorded for the step peak's split, is not timed
    assert "unreliable: from 1 timed step (< 3)" in printed and "time overhead" in printed
    for name in os.listdir(out):
        r = strict_json(out / name)
        assert r["timed_steps"] == 1 and r["step_time_reliable"] is False


def test_the_step_peak_is_split_by_category_at_its_instant_on_the_last_step(tmp_path, capsys):
    out = tmp_path / "out"
    run_gc(TINY + ["--data", tiny_ptb(tmp_path), "--out", str(out)])
    printed = capsys.readouterr().out
    assert "step peak (MB)" in printed
    for name in os.listdir(out):
        r = strict_json(out / name)
        *others, last = r["steps"]
        assert last["recorded"] is True and not any(s.get("recorded") for s in others)  # one step recorded
        split = r["peak_by_category"]
        assert set(split) <= set(ndl.memory.CATEGORIES) - {"host"}, split
        # the categories sum to the step's peak of all live bytes: parameters, gradients, state, activations, ...
        assert sum(split.values()) == last["peak_bytes"] == r["peak_bytes"]
        assert split["parameter"] >= r["param_bytes"] and split["optimizer_state"] >= r["optimizer_bytes"] > 0
        assert r["peak_phase"] in ndl.memory.PHASES and r["peak_split_step"] == last["step"]
        assert f"{'gc on' if r['use_gc'] else 'gc off'}: step peak {r['peak_bytes'] / 2**20:.1f} MB in " \
               f"{r['peak_phase']}" in printed


def test_the_optimizer_in_backward_trains_alike_and_no_gradient_outlives_its_update(tmp_path, capsys):
    data, runs = tiny_ptb(tmp_path), {}
    for name, flags in (("after", []), ("inside", ["--optimizer-in-backward"])):
        runs[name] = tmp_path / f"{name}.json"
        run_gc(TINY + ["--data", data, "--policy", "off", "--json", str(runs[name]), *flags])
    after, inside = strict_json(runs["after"]), strict_json(runs["inside"])
    assert (after["optimizer_in_backward"], inside["optimizer_in_backward"]) == (False, True)
    assert [s["loss"] for s in inside["steps"]] == pytest.approx([s["loss"] for s in after["steps"]], rel=1e-6)
    assert inside["grad_bytes"] == 0 < after["grad_bytes"]  # each gradient freed by its own update
    assert inside["peak_by_category"]["gradient"] < after["grad_bytes"]  # never every gradient at once


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
    run_gc(["ablate", "--steps", "2", "--rows", "baseline", "fused", "whole-step", "--data", tiny_ptb(tmp_path),
            "--out", str(out), *ABLATE_TINY])  # each row a child process, as always
    printed = capsys.readouterr().out
    table = printed.split("\nrow ")[1]  # the table, after the lines each row printed as it ended
    assert "M_act MB" in table and "M_peak MB" in table and "T_step s" in table and "loss-base" in table
    lines = [ln.split()[0] for ln in table.splitlines()[1:4]]
    assert lines == ["baseline", "fused", "whole-step"]
    result = strict_json(out / "ablation.json")
    assert result["kind"] == "ablation" and result["steps_per_row"] == 2 and result["batch_size"] == 4
    assert [r["row"] for r in result["rows"]] == ["baseline", "fused", "whole-step"]
    for r in result["rows"]:
        for key in ("setup", "policy", "head", "activation_bytes", "peak_activation_bytes", "rss_peak_bytes",
                    "step_time_seconds", "loss", "loss_diff", "peak_change", "time_change", "json", "peak_bytes",
                    "peak_bytes_change", "peak_by_category", "peak_phase"):
            assert key in r, key
        run = strict_json(r["json"])
        assert run["ablation_id"] == result["ablation_id"]  # each row's own run JSON
        assert r["peak_bytes"] == run["peak_bytes"] == sum(r["peak_by_category"].values())  # the step's peak, split
    base, fused, whole = result["rows"]
    assert (base["policy"], base["head"], fused["policy"], fused["head"]) == ("off", "full", "off", "fused")
    # the whole step's levers reached its run: no gradient outlives its update inside backward
    assert whole["flags"] == ablations.WHOLE_STEP and whole["grad_bytes"] == 0 < base["grad_bytes"]
    assert strict_json(whole["json"])["optimizer_in_backward"] is True
    assert base["loss_diff"] == 0 and abs(fused["loss_diff"]) < 1e-4
    assert "the step's peak (all live bytes), by category at its instant" in printed
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
