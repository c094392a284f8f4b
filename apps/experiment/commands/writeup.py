"""gc.py run --preset writeup: the write-up's experiment as it states it (presets.py), gc off against gc on.

    python gc.py run --preset writeup                 # on the CPU, and on the GPU too where there is one
    python gc.py run --preset writeup --epochs 1      # a flag given wins over the write-up's value (said so)

It reports exactly the write-up's two measures, per pass: the peak memory during batch training, the maximum over
the epochs of each step's allocator peak (parameters, Adam's state, the batch and the step's activations: the
JSON's peak_bytes), and the time per batch, the mean over every batch of the epochs (forward, backward and Adam's
update: the JSON's time_seconds); each as the mean over the runs ± their standard deviation. Runs differ by their
seed (--seed, --seed + 1, ...), and gc off and on take turns, run by run, so that a machine growing busier slows
both alike.  A third pass, whole-step, trains the write-up's model with ablate's whole-step row's levers (which
replace its Adam and fp32: ablations.WHOLE_STEP), so that the table shows the step's peak with every lever pulled.
Each pass's JSON goes to --out (default results/writeup), with writeup.json: the table's figures.
"""
import os
import statistics
from dataclasses import replace

from needle import backend_ndarray as nd

from ..data import SYNTHETIC, check_corpus, load_data, resolve_data, windows
from ..footprint import check_fits
from ..presets import PRESETS, WRITEUP_TEXT, given_flags
from ..ablations import WHOLE_STEP, WHOLE_STEP_TEXT
from ..records import write_json
from ..report import plural, threads_text
from ..setup import RunConfig, pick_device, policy_label
from .run import train

COLUMNS = ("peak memory (MB)", "time per batch (s)")


def main(config):
    """Every run of the preset, on each device, then its table; writeup.json beside the runs' JSON."""
    source = resolve_data(config.data)
    data, vocab = load_data(source)
    check_corpus(config, data)
    config = replace(config, max_batches=config.max_batches or windows(config, len(data)))
    print_header(config, source, data, vocab)
    tables = []
    for name in devices(config):
        device = pick_device(name)
        check_fits(replace(config, device=name), vocab, device)
        print(f"\n{device}:", flush=True)
        tables.append(measure(replace(config, device=name), data, vocab, source, device))
    for table in tables:
        print_table(table, config.repeats)
    path = os.path.join(config.out, "writeup.json")
    write_json(path, {"kind": "writeup", "stated": WRITEUP_TEXT, "argv": ["gc.py", *config.argv],
                      "columns": list(COLUMNS), "tables": tables})
    print(f"\nwrote {path} and each pass's JSON beside it")


def devices(config):
    """--device, or the CPU and, where there is one, the GPU."""
    return [config.device] if config.device else ["cpu"] + (["cuda"] if nd.cuda().enabled() else [])


def passes(config):
    """(name, gc on?, configuration) of each pass: gc off, gc on (--policy), and the whole step, ablate's whole-step
    row on the write-up's model (its levers replace the write-up's Adam, fp32 and policy)."""
    return [("gc off", False, config), (f"gc on ({policy_label(config)})", True, config),
            ("whole-step", True, replace(config, **WHOLE_STEP))]


def measure(config, data, vocab, source, device):
    """{device, passes: {gc off, gc on, whole-step: per-run figures, their mean and spread}} of the preset's runs."""
    runs = {name: [] for name, _, _ in passes(config)}
    for run in range(config.repeats):
        for name, use_gc, pass_config in passes(config):
            # no step recorded (split_peak): the time per batch is the mean over every batch
            r = train(replace(pass_config, seed=config.seed + run), use_gc, data, vocab, source, out_dir=config.out,
                      quiet=True, split_peak=False)
            steps = r["steps"]
            runs[name].append({"seed": config.seed + run, "json": r["json"], "batches": len(steps),
                               "peak_bytes": max(s["peak_bytes"] for s in steps),
                               "time_per_batch_seconds": statistics.mean(s["time_seconds"] for s in steps),
                               "loss": r["loss"]})
            m = runs[name][-1]
            print(f"  run {run + 1}/{config.repeats}, {name}: peak memory {m['peak_bytes'] / 2**20:.1f} MB, time per "
                  f"batch {m['time_per_batch_seconds']:.3f} s over {m['batches']} batches, loss (last batch) "
                  f"{m['loss']:.3f}", flush=True)
    return {"device": str(device), "passes": {name: summary(rs) for name, rs in runs.items()}}


def summary(runs):
    """A pass's runs, with the mean and standard deviation (0 with one run) of each measure over them."""
    out = {"runs": runs}
    for key in ("peak_bytes", "time_per_batch_seconds"):
        values = [r[key] for r in runs]
        out[key] = {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}
    return out


def print_header(config, source, data, vocab):
    """The write-up's words, the flags they became, what it leaves unstated (gc.py's defaults) and what was given."""
    stated = PRESETS["writeup"]
    print(f"gc.py run --preset writeup: the write-up's experiment, \"{WRITEUP_TEXT}\"")
    print(f"stated: --batch-size {stated['batch_size']} --seq-len {stated['seq_len']} --hidden-size "
          f"{stated['hidden_size']} (each layer's feed-forward width) --optimizer {stated['optimizer']} --epochs "
          f"{stated['epochs']}, {stated['repeats']} runs of gc off and of gc on, an epoch every window of the corpus "
          f"(here {config.max_batches} batches of {config.batch_size} x {config.seq_len} tokens)")
    print(f"unstated, gc.py's defaults unless given: the Transformer LM with embedding {config.embedding_size}, "
          f"{plural(config.num_layers, 'layer')}, {config.num_head} heads, {config.activation}, dropout "
          f"{config.dropout:g}; lr {config.lr:g}, {config.precision}, the {config.head} head, "
          f"{'lazy' if config.lazy else 'eager'}, gc on = policy {policy_label(config)}; seeds {config.seed}.."
          f"{config.seed + config.repeats - 1}")
    given = given_here(config)
    if given:
        print(f"given on the command line: {', '.join(given)}")
    if source == SYNTHETIC:
        print(f"data: a synthetic Zipf corpus with a PTB-sized vocabulary (no PTB at data/ptb or ../shared/data/ptb), "
              f"{vocab} words: not the write-up's PTB")
    else:
        print(f"data: {source}, {len(data)} training tokens, vocabulary {vocab}")
    print(f"whole-step: ablate's row on this model, {WHOLE_STEP_TEXT} (not the write-up's Adam and fp32)")
    print(f"measures: peak memory during batch training (the most the allocator held in any batch: parameters, "
          f"Adam's state, the batch, the activations) and the mean time per batch; mean ± standard deviation over "
          f"the {plural(config.repeats, 'run')}")
    if config.device in (None, "cpu"):
        print(threads_text())


def given_here(config):
    """The command line's flags that shape the runs, each with its value, and the write-up's where it states one."""
    stated = PRESETS["writeup"]
    shown = []
    for name in sorted(given_flags(config.argv) - {"preset", "out", "progress", "data", "device"}):
        value = getattr(config, name, None)
        if hasattr(RunConfig, name) and not isinstance(value, bool) and value is not None:
            shown.append(f"--{name.replace('_', '-')} {value}" + (f" (write-up: {stated[name]})" if name in stated
                                                                   else ""))
    return shown


def print_table(table, repeats):
    """One device's table: gc off and on, the two measures, and gc on's change."""
    print(f"\n{table['device']}, mean ± standard deviation over {plural(repeats, 'run')}")
    print(f"{'':22s}{COLUMNS[0]:>22s}{COLUMNS[1]:>22s}")
    for name, p in table["passes"].items():
        peak, time = p["peak_bytes"], p["time_per_batch_seconds"]
        print(f"{name:22s}{peak['mean'] / 2**20:>13.1f} ± {peak['std'] / 2**20:<6.1f}"
              f"{time['mean']:>13.3f} ± {time['std']:<6.3f}")
    off, *others = table["passes"].items()
    for name, p in others:
        change = [p[key]["mean"] / off[1][key]["mean"] - 1 for key in ("peak_bytes", "time_per_batch_seconds")]
        print(f"{name.split(' (')[0] + ' against off':22s}{change[0]:>+21.1%} {change[1]:>+21.1%}")
