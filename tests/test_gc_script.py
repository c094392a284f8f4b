"""gc.py, the experiment a user runs: it runs, writes what it measured, and keeps it when interrupted."""
import json
import os

import importlib.util

import numpy as np
import pytest

from needle import backend_ndarray as nd

ROOT = os.path.join(os.path.dirname(__file__), "..")
spec = importlib.util.spec_from_file_location("gc_script", os.path.join(ROOT, "gc.py"))
gc_script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gc_script)


def _read(path):
    with open(path) as f:
        return json.load(f)


DEVICE = "cpu" if nd.cpu().enabled() else "cpu_numpy"
TINY = ["--batch_size", "4", "--seq_len", "5", "--embedding_size", "8", "--hidden_size", "8", "--num_layers", "1",
        "--num_head", "2", "--max_batches", "3", "--warmup", "1", "--device", DEVICE]


def _corpus(tmp_path, num_lines=40):
    folder = tmp_path / "ptb"
    folder.mkdir()
    words = [f"w{i}" for i in range(30)]
    rs = np.random.RandomState(0)
    lines = [" ".join(rs.choice(words, size=8)) for _ in range(num_lines)]
    (folder / "train.txt").write_text("\n".join(lines) + "\n")
    (folder / "test.txt").write_text("\n".join(lines[:5]) + "\n")
    return str(folder)


def test_gc_script_runs_and_writes_the_measurements(tmp_path, capsys):
    out = tmp_path / "out"
    gc_script.main(TINY + ["--data", _corpus(tmp_path), "--out", str(out)])
    printed = capsys.readouterr().out
    assert "M_act (MB)" in printed and "M_peak (MB)" in printed and "T_step (s)" in printed
    records = [_read(out / f) for f in sorted(os.listdir(out))]
    assert len(records) == 2
    off, on = sorted(records, key=lambda r: r["use_gc"])
    for r in (off, on):
        for key in ("time", "batch_size", "peak memory", "use_gc", "segment_len", "time_per_batch_median",
                    "peak_bytes", "peak_activation_bytes", "policy", "device", "loss", "recomputed_nodes"):
            assert key in r
    assert off["loss"] == on["loss"]  # checkpointing is exact
    assert on["activation_bytes"] < off["activation_bytes"]
    assert on["recomputed_nodes"] > 0 and off["recomputed_nodes"] == 0


def test_gc_script_synthetic_corpus_when_data_is_absent(tmp_path, capsys):
    gc_script.main(TINY + ["--data", str(tmp_path / "missing"), "--use_gc", "1", "--max_batches", "1"])
    assert "synthetic" in capsys.readouterr().out


def test_interrupted_run_keeps_the_results_written(tmp_path, monkeypatch):
    out = tmp_path / "out"
    real_step = gc_script.train_step
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(gc_script, "train_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gc_script.main(TINY + ["--data", _corpus(tmp_path), "--out", str(out), "--use_gc", "1"])
    (name,) = os.listdir(out)
    record = _read(out / name)
    assert len(record["steps"]) == 2  # both finished steps are on disk


def test_max_batch_finds_a_larger_batch_with_checkpointing(tmp_path, capsys):
    data = _corpus(tmp_path, num_lines=2000)
    gc_script.main(["max-batch", "--memory_limit_mb", "0.5", "--policies", "off", "all", "--data", data,
                    "--out", str(tmp_path / "mb")] + TINY)
    result = _read(tmp_path / "mb" / "max_batch.json")["largest_batch"]
    assert result["all"] >= result["off"] > 0


# ----- statistics that cannot lie: strict JSON, one file per child, the OS's view of memory ---------------------
def _strict_load(path):
    """json.load that rejects NaN / Infinity, as strict JSON parsers (JavaScript, jq, Go) do."""
    def reject(constant):
        raise ValueError(f"non-standard JSON constant {constant} in {path}")

    with open(path) as f:
        return json.load(f, parse_constant=reject)


def test_json_writer_writes_null_for_values_that_are_not_finite(tmp_path):
    path = str(tmp_path / "r.json")
    gc_script._write_json(path, {"loss": float("nan"), "time": 0.5, "x": [1.0, float("inf"), -float("inf")],
                                 "steps": [{"loss": np.float32("nan"), "n": np.int64(3), "ok": np.float64(2.5)}],
                                 "pair": (float("nan"), 1)})
    with open(path) as f:
        text = f.read()
    assert "NaN" not in text and "Infinity" not in text
    assert _strict_load(path) == {"loss": None, "time": 0.5, "x": [1.0, None, None],
                                  "steps": [{"loss": None, "n": 3, "ok": 2.5}], "pair": [None, 1]}


def test_run_with_a_nan_loss_writes_strict_json(tmp_path, capsys):
    out = tmp_path / "out"
    gc_script.main(TINY + ["--data", _corpus(tmp_path), "--out", str(out), "--use_gc", "0", "--lr", "1e30"])
    assert "loss nan" in capsys.readouterr().out  # the huge learning rate did make the loss NaN
    (name,) = os.listdir(out)
    record = _strict_load(out / name)
    assert record["loss"] is None and None in [s["loss"] for s in record["steps"]]


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="RSS is read from /proc/self/status")
def test_rss_peak_growth_is_reported_per_step_and_printed(tmp_path, capsys):
    out = tmp_path / "out"
    gc_script.main(TINY + ["--data", _corpus(tmp_path), "--out", str(out)])
    assert "RSS_peak (MB)" in capsys.readouterr().out
    for name in os.listdir(out):
        record = _strict_load(out / name)
        assert all(isinstance(s["rss_peak_bytes"], int) and s["rss_peak_bytes"] >= 0 for s in record["steps"])
        assert all(s["rss_start_bytes"] > 0 for s in record["steps"])
        assert record["rss_peak_bytes"] == max(s["rss_peak_bytes"] for s in record["steps"][1:])  # warmup 1


def test_peak_rss_measures_the_peak_inside_an_interval():
    if not os.path.exists("/proc/self/status"):
        assert gc_script.PeakRSS().growth() is None
        return
    rss = gc_script.PeakRSS()
    block = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB, touched
    del block  # freed before the reading: only the high-water mark still sees it
    growth = rss.growth()
    if rss.exact:
        assert growth >= 60 << 20
    else:
        assert growth >= 0


def test_a_sweep_reads_back_only_its_own_childrens_files(tmp_path, monkeypatch):
    # Another sweep (or any run) writing into the same --out while this one's child runs: its file must not be
    # taken for this child's result.
    out = tmp_path / "out"
    real_child = gc_script._child

    def with_a_neighbour(*args, **kwargs):
        out.mkdir(exist_ok=True)
        foreign = {"batch_size": 999, "activation_bytes": 1, "peak_activation_bytes": 1, "time": 1.0,
                   "hidden_size": 999}
        gc_script._write_json(str(out / f"aaa_neighbour_{len(os.listdir(out))}.json"), foreign)
        return real_child(*args, **kwargs)

    monkeypatch.setattr(gc_script, "_child", with_a_neighbour)
    gc_script.main(["sweep", "--values", "4", "6", "--repeats", "1", "--policies", "off", "--out", str(out),
                    "--data", _corpus(tmp_path)] + TINY)
    records = _strict_load(out / "sweep.json")
    assert sorted(r["batch_size"] for r in records) == [4, 6]
    assert {r["hidden_size"] for r in records} == {8}
    (summary,) = [f for f in os.listdir(out) if f.startswith("sweep-") and "_" not in f]  # sweep-<id>.json
    assert _strict_load(out / summary) == records
    for r in records:  # each record is the file its child was told to write, inside --out
        assert os.path.dirname(r["json"]) == str(out) and _strict_load(r["json"])["batch_size"] == r["batch_size"]


def test_two_concurrent_sweeps_into_one_out_folder_do_not_mix(tmp_path):
    import subprocess
    import sys

    out, data = tmp_path / "out", _corpus(tmp_path)
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "gc.py"), "sweep", "--values", "4", "6", "8",
                               "--repeats", "1", "--policies", "off", "--out", str(out), "--data", data]
                              + TINY + ["--hidden_size", str(hidden)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for hidden in (8, 12)]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    for hidden, proc, log in zip((8, 12), procs, logs):
        assert proc.returncode == 0, log
        (line,) = [ln for ln in log.splitlines() if ln.startswith("wrote ")]
        records = _strict_load(line.split()[1])  # this sweep's own summary
        assert sorted(r["batch_size"] for r in records) == [4, 6, 8]
        assert {r["hidden_size"] for r in records} == {hidden}, log
        assert len({r["sweep_id"] for r in records}) == 1
