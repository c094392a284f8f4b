"""gc.py through its command line, continued from test_gc_script.py (whose helpers these tests share): the front
door (what a run writes and what it can hold, checked before any work), saving and resuming, gc.py's own items of
issue 27, the timeline subcommand and offloading."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import needle as ndl

from conftest import GC_ROOT as ROOT
from conftest import GC_TINY as TINY
from conftest import gc_in_process as _gc_here
from conftest import gc_process as _gc
from conftest import run_gc, strict_json, tiny_ptb
from experiment import cli, setup
from experiment.commands import run as run_command

from test_gc_script import _figures, _one_line_error, _read, _write


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


def test_save_checkpoint_creates_its_folder_and_refuses_a_folder_as_its_file(tmp_path, capsys):
    # It used to train to the end and then fail to save into a missing folder, and to write <folder>.npz beside
    # an existing folder; --json and --out create a missing folder, and so does it now.
    data, folder = tiny_ptb(tmp_path), tmp_path / "folder"
    folder.mkdir()
    run = TINY + ["--data", data, "--use-gc", "1", "--max-batches", "2"]
    expected = f"--save-checkpoint {folder} is a folder; give a file name"
    assert expected in _one_line_error(*_gc_here(*run, "--json", tmp_path / "a.json", "--save-checkpoint", folder))
    assert not (tmp_path / "folder.npz").exists() and not (tmp_path / "a.json").exists()
    run_gc(run + ["--json", str(tmp_path / "b.json"), "--save-checkpoint", str(tmp_path / "new" / "deeper" / "ck")])
    assert ndl.load(str(tmp_path / "new" / "deeper" / "ck.npz"))["step"] == 2


def test_an_output_that_is_not_a_regular_file_is_refused_and_a_link_written_through(tmp_path, capsys):
    # The atomic rename replaced whatever node the name was: as root, --json /dev/null made /dev/null a file.
    data, fifo, target, link = tiny_ptb(tmp_path), tmp_path / "fifo", tmp_path / "target.json", tmp_path / "link"
    os.mkfifo(fifo)
    os.mkfifo(tmp_path / "ck.npz")
    (tmp_path / "to_fifo").symlink_to(fifo)
    target.write_text("{}")
    link.symlink_to(target)
    run = TINY + ["--data", data, "--use-gc", "1", "--max-batches", "2"]
    for argv, expected in ((["--json", fifo], f"--json {fifo} is not a regular file"),
                           (["--json", tmp_path / "to_fifo"], f"--json {tmp_path / 'to_fifo'} is not a regular file"),
                           (["--json", tmp_path / "r.json", "--save-checkpoint", tmp_path / "ck"],
                            f"--save-checkpoint {tmp_path / 'ck.npz'} is not a regular file")):
        assert expected in _one_line_error(*_gc_here(*run, *argv)), argv
    assert fifo.is_fifo() and (tmp_path / "ck.npz").is_fifo() and (tmp_path / "to_fifo").is_symlink()
    assert not (tmp_path / "r.json").exists()
    run_gc(run + ["--json", str(link)])
    assert link.is_symlink() and strict_json(target)["complete"] is True


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
    assert exit_.value.code == 2 and f"gc.py: cannot write {path}: it is a folder" in err and "Traceback" not in err
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
    assert saved["step"] == 2 and set(saved) == {"step", "config", "model", "optimizer", "scaler", "rng", "compress",
                                                "vocabulary"}
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


def test_compress_bits_keeps_the_segments_of_segment_len(tmp_path, capsys):
    # It used to build checkpoint.compress("all") and hand enable_gc --segment-len beside it: a ValueError with
    # the policy's repr, after the gc-off pass. The segments are the wrapped policy's.
    out = tmp_path / "out"
    run_gc(TINY + ["--data", tiny_ptb(tmp_path), "--segment-len", "2", "--compress-bits", "8", "--out", str(out)])
    records = sorted((strict_json(out / name) for name in os.listdir(out)), key=lambda r: r["use_gc"])
    assert [(r["policy"], r["segment_len"], r["complete"]) for r in records] == [
        ("off", 2, True), ("all+compress8", 2, True)]
    config = cli.parse_args(TINY + ["--segment-len", "2", "--compress-bits", "8"])
    policy = setup.make_policy(config)
    assert policy.policy == ndl.checkpoint.EverySegment(2) and setup.segment_len(config, policy) is None


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


def test_a_hand_edited_checkpoint_is_one_line_naming_the_field(tmp_path, capsys):
    # A step of -3 or 2.5 used to be trained from (int(2.5) = 2), NaN weights trained on, and a --compress-bits
    # checkpoint without the policy's count resumed with step 0's rounding noise.
    data, ckpt = tiny_ptb(tmp_path), str(tmp_path / "ckpt")
    run = TINY + ["--data", data, "--use-gc", "1", "--json", str(tmp_path / "r.json"), "--compress-bits", "8"]
    run_gc(run + ["--max-batches", "2", "--save-checkpoint", ckpt])
    saved = ndl.load(ckpt)
    weight = next(iter(saved["model"]))
    nan = {**saved["model"], weight: np.full_like(saved["model"][weight], np.nan)}
    cases = [({"step": -3}, "its step is -3; a checkpoint's step is the count of steps trained"),
             ({"step": 2.5}, "its step is 2.5;"), ({"step": True}, "its step is True;"),
             ({"model": nan}, f"model.{weight} holds NaN or infinity"),
             ({"compress": None}, "the checkpoint holds no --compress-bits state")]
    for change, expected in cases:
        edited = ndl.save({**saved, **change}, tmp_path / "edited.npz")
        line = _one_line_error(*_gc_here(*run, "--max-batches", "4", "--resume", edited))
        assert expected in line, (change, line)


def test_a_resume_whose_random_state_would_read_outside_its_key_is_one_line(tmp_path, capsys):
    """NumPy takes an MT19937 position as given: a checkpoint whose pos is 2^31 - 1 crashed the resumed run at its
    first draw. In a process of its own: a crash there is a failure here, not the end of the test run."""
    data, ckpt = tiny_ptb(tmp_path), str(tmp_path / "ckpt")
    run = TINY + ["--data", data, "--use-gc", "1", "--dropout", "0.1", "--json", str(tmp_path / "r.json")]
    run_gc(run + ["--max-batches", "2", "--save-checkpoint", ckpt])
    state = ndl.load(ckpt)
    state["rng"]["state"]["pos"] = 2**31 - 1
    ndl.save(state, ckpt)
    code, _, err = _gc(*run, "--max-batches", "4", "--resume", ckpt)  # (stdout: the run's header, printed first)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (code, err)  # -11: a crash
    assert "--resume: the checkpoint does not fit" in err and "an MT19937 position is an integer in [0, 624]" in err


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


def test_plot_groups_only_runs_of_one_configuration_and_gives_the_true_counts(tmp_path, monkeypatch):
    # Budget(48) and Budget(48, offload) used to be one bar "budget 48 MB" whose error bars spread the two as
    # repeats, under a title of "4 runs each" for counts of 4/1/2/1.
    out = tmp_path / "out"
    run_gc(TINY + ["--data", tiny_ptb(tmp_path), "--out", str(out)])
    off, on = sorted((_read(out / f) for f in os.listdir(out)), key=lambda r: r["use_gc"])
    for name in os.listdir(out):
        os.remove(out / name)
    budget = {**on, "policy": "budget", "budget_bytes": 48 * 2**20, "budget_offload": False}
    runs = [{**off, "seed": seed, "time": off["time"] * (1 + seed)} for seed in range(4)] + [
        budget, {**budget, "budget_offload": True}, {**budget, "budget_offload": True, "time": 2 * on["time"]},
        on, {**on, "precision": "bf16"}]  # the last: another run set, a PNG of its own
    for i, r in enumerate(runs):
        _write(out / f"run{i}.json", r)
    figures = _figures(monkeypatch)
    run_gc(["plot", str(out)])
    assert len([f for f in os.listdir(out) if f.endswith(".png")]) == 2
    fig = figures[0]
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert ticks == ["off\n(4 runs)", "all\n(1 run)", "budget 48 MiB\n(1 run)", "budget 48 MiB,\noffload\n(2 runs)"]
    assert "(1-4 runs per bar, median, bars: min-max)" in fig._suptitle.get_text()
    (errors,) = [c for c in fig.axes[2].containers if type(c).__name__ == "ErrorbarContainer"]
    spreads = [np.ptp(segment[:, 1]) if len(segment) else None for segment in errors.lines[2][0].get_segments()]
    assert spreads[0] > 0 and spreads[3] > 0 and spreads[1:3] == [None, None]  # a single run: no error bar
    assert [t.get_text() for t in figures[1].axes[0].get_xticklabels()] == ["all"]  # alone: 1 run, no count


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


@pytest.mark.parametrize("load", [0.0, 50.0])
def test_the_verdict_carries_the_time_caveats_of_its_own_header(tmp_path, capsys, monkeypatch, load):
    # A busy machine's "time overhead -17.4%" used to come with no caveat, and a T_step of 0 timed steps (the
    # warm-up's) was printed as a number.
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    run_gc(TINY + ["--data", tiny_ptb(tmp_path), "--out", str(tmp_path / "out"), "--max-batches", "5"])
    verdict = [line for line in capsys.readouterr().out.splitlines() if "time overhead" in line][0]
    busy = f"(unreliable: the machine is busy: load average 50.0 on {len(os.sched_getaffinity(0))} CPUs)"
    assert verdict.endswith(busy if load else "%"), verdict
    run_gc(TINY + ["--data", str(tmp_path / "ptb"), "--out", str(tmp_path / "out"), "--max-batches", "2",
                   "--warmup", "2"])
    printed = capsys.readouterr().out
    (row,) = [line for line in printed.splitlines() if line.startswith("T_step (s)")]
    assert row.split()[2:4] == ["n/a", "n/a"] and "from 0 timed steps" in row, row
    assert "time overhead not measured (no step timed after the warm-up: lower --warmup)" in printed


def test_every_row_of_the_table_is_defined_in_help(tmp_path, capsys):
    run_gc(TINY + ["--data", tiny_ptb(tmp_path), "--out", str(tmp_path / "out")])
    table = capsys.readouterr().out.split("gc off       gc on")[1].split("\n\n")[0]
    rows = [line[:18].strip() for line in table.splitlines()[1:] if line.strip()]
    assert "step peak (MB)" in rows and "recomputed nodes" in rows, rows
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


def test_the_ablation_plot_draws_the_steps_peak_first_with_its_change(tmp_path, monkeypatch):
    from experiment.commands.plot import plot_ablation

    row = {"setup": "s", "loss": 5.0, "activation_bytes": 2**20, "peak_activation_bytes": 2**21, "peak_bytes": 2**23,
           "rss_peak_bytes": 2**22, "step_time_seconds": 0.1, "peak_change": 0.0, "time_change": 0.0}
    result = {"rows": [{**row, "row": "baseline"}, {**row, "row": "whole-step", "peak_bytes": 2**20,
                                                    "peak_bytes_change": -0.875}],
              "steps_per_row": 2, "warmup": 1, "batch_size": 4}
    figures = _figures(monkeypatch)
    plot_ablation(result, str(tmp_path))
    first = figures[0].axes[0]
    assert "all live bytes" in first.get_title()
    assert [t.get_text() for t in first.texts] == ["8.0", "1.0 (-88%)"]


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
        # (Adam's update in place allocates nothing: its phase has no event to draw, issue 47)
        assert {p["phase"] for p in snap.phases} >= {"forward", "backward"}
        assert not any(e["phase"] == "optimizer" and e["action"] == "alloc" for e in snap.events)
        assert f"peak {snap.peak['bytes'] / 2**20:.1f} MiB (the allocator's {snap.peak['bytes'] / 2**20:.1f} MiB)" \
            in printed
    assert (out / f"{stem}.png").read_bytes()[:4] == b"\x89PNG"
    page = (out / f"{stem}.html").read_text()
    assert "needle-memory-snapshot" in page and "gc off" in page and "gc on (all)" in page
    # another configuration writes files of its own, never over these
    run_gc(["timeline"] + TINY + ["--data", data, "--out", str(out), "--seq-len", "4"])
    assert set(files) < set(os.listdir(out))


def test_a_compressed_timeline_is_named_by_its_policy(tmp_path, capsys):
    # Its panel said "gc on (all)"; with --policy off, compression alone was not drawn at all.
    out, data = tmp_path / "out", tiny_ptb(tmp_path)
    for policy, label in (("all", "all+compress8"), ("off", "off+compress8")):
        run_gc(["timeline"] + TINY + ["--data", data, "--out", str(out), "--policy", policy, "--compress-bits", "8"])
        printed = capsys.readouterr().out
        assert f"gc off vs on ({label})" in printed.splitlines()[0] and f"gc on ({label}): " in printed
        (page,) = [p for p in out.glob("*.html") if f"_{label}-" in p.name]
        assert f"gc on ({label})" in page.read_text()


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
    assert "T_step" in step_time.get_title() and step_time.get_xlabel() == "budget b (MiB)"
    labels = [t.get_text() for t in step_time.get_legend().get_texts()]
    assert labels == [CURVE_LABELS[c] for c in ("budget", "offload", "budget-offload")]
    assert "recompute only" in labels[0] and "offload only" in labels[1] and "offload=True" in labels[2]


def test_the_lstm_language_model_refuses_the_transformers_flags_and_runs_without_them(tmp_path):
    """--seq-model lstm (issue 46: the same sweep over time steps): a Transformer-only flag is one line, exit 2; the
    LSTM LM itself trains and its JSON says which model it was."""
    data = tiny_ptb(tmp_path)
    for flags in (["--activation", "gelu"], ["--dropout", "0.1"], ["--activation-bits", "1"]):
        line = _one_line_error(*_gc_here(*TINY, "--data", data, "--seq-model", "lstm", *flags))
        assert f"--seq-model lstm: {flags[0]} configure the Transformer" in line
    out = tmp_path / "lstm.json"
    code, _, err = _gc_here(*TINY, "--data", data, "--seq-model", "lstm", "--policy", "sqrt", "--use-gc", "1",
                            "--json", out)
    assert code == 0, err
    record = json.loads(out.read_text())
    assert record["seq_model"] == "lstm" and record["policy"] == "sqrt" and record["steps"]


def test_a_captured_run_trains_alike_and_replays_on_its_arena(tmp_path, capsys):
    data, runs = tiny_ptb(tmp_path), {}
    for name, flags in (("plain", []), ("captured", ["--capture"])):
        runs[name] = tmp_path / f"{name}.json"
        run_gc(TINY + ["--data", data, "--use-gc", "0", "--max-batches", "5", "--json", str(runs[name]), *flags])
    plain, captured = strict_json(runs["plain"]), strict_json(runs["captured"])
    assert [s["loss"] for s in captured["steps"]] == [s["loss"] for s in plain["steps"]]  # bit for bit
    assert captured["parameters_sha256"] == plain["parameters_sha256"]
    replayed = [s for s in captured["steps"] if s["replayed"]]
    assert len(replayed) == 2  # Adam's first update differs from the later ones: three steps recorded
    assert all(s["step_peak_bytes"] == replayed[0]["step_peak_bytes"] > 0 for s in replayed)  # the arena
    assert all(0 < s["activation_bytes"] < s["step_peak_bytes"] for s in replayed)


def test_capture_is_refused_with_what_a_replay_cannot_repeat(tmp_path):
    tiny = TINY + ["--data", tiny_ptb(tmp_path), "--capture"]
    for flags, words in ((["--accumulation-steps", "2"], "--accumulation-steps 2"),
                         (["--offload-state"], "offloading"), (["--optimizer-in-backward"], "--optimizer-in-backward")):
        line = _one_line_error(*_gc_here(*tiny, *flags))
        assert "--capture replays a step recorded once" in line and words in line, line
    for argv, words in ((["explain"], "gc.py explain"), (["max-batch", "--memory-limit-mb", "50", "--dry-run"],
                                                         "--dry-run's predictions")):
        line = _one_line_error(*_gc_here(*argv, *tiny))
        assert "--capture is for gc.py run, sweep and max-batch's real search" in line and words in line, line
