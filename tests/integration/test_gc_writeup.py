"""gc.py run --preset writeup: the write-up's experiment as it states it, gc off against on (and the whole-step
row's levers), several runs, its two measures with their spread (commands/writeup.py, presets.py)."""
import json
import statistics
import types

import pytest

from conftest import GC_DEVICE, gc_in_process, gc_process, tiny_ptb
from experiment import cli
from experiment.commands import writeup

# Two layers: with one, gc "all" recomputes all of it in backward and can peak where gc off does.
SMALL = ["--batch-size", "8", "--seq-len", "5", "--embedding-size", "16", "--num-layers", "2", "--num-head", "2",
         "--device", GC_DEVICE, "--no-progress"]


def test_the_preset_is_the_configuration_the_write_up_states():
    config = cli.parse_args(["run", "--preset", "writeup"])
    stated = {name: getattr(config, name) for name in ("batch_size", "seq_len", "hidden_size", "optimizer", "epochs",
                                                       "repeats", "max_batches")}
    assert stated == {"batch_size": 256, "seq_len": 20, "hidden_size": 32, "optimizer": "adam", "epochs": 3,
                      "repeats": 3, "max_batches": None}  # None: every window of the corpus makes the epoch
    assert config.out == "results/writeup" and config.use_gc is None
    defaults = cli.parse_args(["run"])  # what the write-up leaves unstated stays at gc.py's defaults
    assert (config.embedding_size, config.num_layers, config.lr, config.policy) == \
        (defaults.embedding_size, defaults.num_layers, defaults.lr, defaults.policy)


def test_a_flag_given_wins_over_the_presets_value_in_either_spelling():
    config = cli.parse_args(["run", "--preset", "writeup", "--epochs", "1", "--batch_size=8", "--max-batches", "2"])
    assert (config.epochs, config.batch_size, config.max_batches, config.seq_len) == (1, 8, 2, 20)


@pytest.mark.parametrize("flags, message", [
    (["--use-gc", "1"], "leave out --use-gc"), (["--json", "x.json"], "leave out --json"),
    (["--save-checkpoint", "ck"], "leave out --save-checkpoint"), (["--policy", "off"], "compares gc off with gc on"),
    (["--preset", "paper"], "invalid choice: 'paper'"),
])
def test_what_the_preset_cannot_do_is_one_line_and_exit_status_2(flags, message):
    code, out, err = gc_in_process("run", "--preset", "writeup", *flags)
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err


def test_it_measures_peak_memory_and_time_per_batch_over_the_runs_and_writes_them(tmp_path):
    data = tiny_ptb(tmp_path)  # 360 tokens: 8 windows of 8 x 5 per epoch
    code, out, err = gc_process("run", "--preset", "writeup", "--data", data, "--out", tmp_path / "out", *SMALL)
    assert code == 0, err
    assert "gc.py run --preset writeup: the write-up's experiment, \"PTB, batch_size 256, seq_len 20" in out
    assert "given on the command line: --batch-size 8 (write-up: 256), --embedding-size 16" in out
    table = out[out.rindex("mean ± standard deviation over 3 runs"):].splitlines()
    assert table[1].split() == ["peak", "memory", "(MB)", "time", "per", "batch", "(s)"]
    names = [line[:22].strip() for line in table[2:7]]
    assert names == ["gc off", "gc on (all)", "whole-step", "gc on against off", "whole-step against off"], names
    assert "whole-step: ablate's row on this model" in out
    with open(tmp_path / "out" / "writeup.json") as f:
        result = json.load(f)
    (table,) = result["tables"]
    for name, p in table["passes"].items():
        assert [r["seed"] for r in p["runs"]] == [0, 1, 2] and all(r["batches"] == 3 * 8 for r in p["runs"])
        peaks, times = [], []
        for r in p["runs"]:  # each run's figures are its own JSON's: the maximum peak, the mean step time
            with open(r["json"]) as f:
                steps = json.load(f)["steps"]
            peaks.append(max(s["peak_bytes"] for s in steps))
            times.append(statistics.mean(s["time_seconds"] for s in steps))
        assert p["peak_bytes"] == {"mean": statistics.mean(peaks), "std": statistics.stdev(peaks)}
        assert p["time_per_batch_seconds"]["mean"] == pytest.approx(statistics.mean(times))
        assert p["time_per_batch_seconds"]["std"] == pytest.approx(statistics.stdev(times))
    off, on, whole = table["passes"].values()
    assert on["peak_bytes"]["mean"] < off["peak_bytes"]["mean"]  # gc on holds fewer activations at its peak
    assert whole["peak_bytes"]["mean"] < on["peak_bytes"]["mean"]  # and the whole step's levers fewer bytes still


def test_the_gpu_gets_the_same_table_where_there_is_one(monkeypatch):
    config = cli.parse_args(["run", "--preset", "writeup"])
    monkeypatch.setattr(writeup.nd, "cuda", lambda: types.SimpleNamespace(enabled=lambda: False))
    assert writeup.devices(config) == ["cpu"]
    monkeypatch.setattr(writeup.nd, "cuda", lambda: types.SimpleNamespace(enabled=lambda: True))
    assert writeup.devices(config) == ["cpu", "cuda"]
    assert writeup.devices(cli.parse_args(["run", "--preset", "writeup", "--device", "cpu_numpy"])) == ["cpu_numpy"]
