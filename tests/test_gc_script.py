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
