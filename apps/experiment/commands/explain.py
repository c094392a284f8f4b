"""gc.py explain: where the configuration's step peaks and why (ndl.memory.predict's account), then what each lever
would make of it — every row a dry run of the whole step, nothing computed — and, with --verify, one real step per
row measured beside it.

    python gc.py explain --policy all --head full        # the account, then the what-if table
    python gc.py explain --verify --json levers.json     # and measured, each row's JSON

A row's step is the plain training step: reset_grad, forward and loss (lazy unless --no-lazy), backward, the
optimizer's step. Accumulation over K micro-batches is not one dry run (predict refuses a second backward): its row
is the micro-batch's step predicted, and gc.py's sum over the micro-batches around it (a later micro-batch runs beside
the sum so far; then the new sum is made beside the old one and the micro-batch's gradients), marked "~".
"""
import gc as python_gc
import json
import sys
import time
from dataclasses import replace

import needle as ndl
from needle import autograd
from needle import backend_ndarray as nd
from needle.data import batchify

from ..ablations import ABLATIONS
from ..data import check_corpus, load_data, micro_batches, resolve_data
from ..parser import build_parser
from ..setup import RunConfig, make_policy, pick_device
from .run import build_training

LEVERS = [  # (row, what it changes)
    ("as given", {}),
    ("gc off", {"policy": "off"}), ("gc all", {"policy": "all"}), ("gc sqrt", {"policy": "sqrt"}),
    ("gc selective", {"policy": "selective"}),
    ("budget 25%", {"policy": "budget", "budget_fraction": 0.25}),
    ("budget 50%", {"policy": "budget", "budget_fraction": 0.5}),
    ("budget 75%", {"policy": "budget", "budget_fraction": 0.75}),
    ("accumulate x2", {"accumulation_steps": 2}), ("accumulate x4", {"accumulation_steps": 4}),
    ("bf16", {"precision": "bf16", "stochastic_rounding": True}), ("mixed-bf16", {"precision": "mixed-bf16"}),
    ("adam8bit", {"optimizer": "adam8bit"}), ("adafactor", {"optimizer": "adafactor"}),
    ("optimizer in backward", {"optimizer_in_backward": True}), ("offload state", {"offload_state": True}),
    ("fused head", {"head": "fused"}), ("full head", {"head": "full"}), ("compress 8-bit", {"compress_bits": 8}),
]


def main(config):
    source = resolve_data(config.data)
    data, vocab = load_data(source)
    device = pick_device(config.device)
    check_corpus(config, data)
    given = _as_run(config)
    prediction, _ = predict_row(given, data, vocab, device)
    print(f"gc.py explain: {_describe(given)}\n")
    print(prediction)
    print(f"\nWhat each lever would make of it (each row a dry run{'; measured beside it' if config.verify else ''}):")
    bounds = _budget_bounds(given, data, vocab, device)
    rows = []
    for name, change in LEVERS:
        row = lever_row(name, change, given, bounds, data, vocab, device, config.verify)
        if row is not None:
            rows.append(row)
            print(_line(row, config.verify), flush=True)
    if config.json:
        with open(config.json, "w") as f:
            json.dump({"kind": "explain", "configuration": _describe(given), "rows": rows}, f, indent=1)
        print(f"wrote {config.json}")


def _as_run(config):
    """explain's configuration as run's one pass: gc on with --policy (all when not given), off with --policy off."""
    return replace(config, policy=config.policy or "all", accumulation_steps=config.accumulation_steps or 1)


def ablation_row_config(name, model_argv, lazy=True):
    """(gc.py ablate's row `name` as explain's configuration, its accumulation steps): `model_argv` the model's
    flags. A Budget row has no bound yet: set the row's own (ablate.ablation_budget) before using it."""
    flags = ABLATIONS[name][1]
    argv = ["explain", *model_argv] + ([] if lazy else ["--no-lazy"])
    for key, value in flags.items():
        if key == "compress":
            argv += ["--compress-bits", "8"]
        elif key == "offload":
            argv += ["--offload"]
        elif key != "accumulate":
            argv += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    args = build_parser()[1]["explain"].parse_args(argv[1:])
    args.command = "explain"
    return _as_run(RunConfig.from_args(args, argv)), flags.get("accumulate", 1)


def _describe(config):
    return (f"{config.num_layers} layers x {config.embedding_size}, batch {config.batch_size} x {config.seq_len}, "
            f"policy {config.policy}, head {config.head}, {config.optimizer}, {config.precision}"
            f"{', optimizer in backward' if config.optimizer_in_backward else ''}")


def _budget_bounds(config, data, vocab, device):
    """The bounds of the budget rows: gc all's and gc off's predicted M_peak, for the fractions between them."""
    low = predict_row(replace(config, policy="all"), data, vocab, device)[1]["predicted_peak_activation_bytes"]
    high = predict_row(replace(config, policy="off"), data, vocab, device)[1]["predicted_peak_activation_bytes"]
    return low, high


def lever_row(name, change, given, bounds, data, vocab, device, verify):
    """One what-if row: the configuration with `change`, predicted (and measured with `verify`); None where the
    lever is the configuration already (other than "as given")."""
    change = dict(change)
    fraction = change.pop("budget_fraction", None)
    config = replace(given, **change)
    if change and config == given:
        return None
    if fraction is not None:
        config = replace(config, budget_mb=(bounds[0] + fraction * (bounds[1] - bounds[0])) / 2**20)
    k = config.accumulation_steps
    if k > 1:  # the same effective batch, as gc.py ablate's accumulation rows: k micro-batches of batch / k
        config = replace(config, batch_size=max(1, config.batch_size // k))
    micro = replace(config, accumulation_steps=1)
    t0 = time.perf_counter()
    prediction, row = predict_row(micro, data, vocab, device)
    row.update(lever=name, seconds=time.perf_counter() - t0, approximate=k > 1, causes=prediction.causes)
    if k > 1:  # gc.py's sum: a later micro-batch runs beside the sum so far, then the new sum is made beside both
        grads = prediction.gradient_bytes
        row["predicted_peak_bytes"] = max(prediction.peak_bytes + grads, prediction.after_backward_bytes + 2 * grads)
    row.update(measure_row(config, data, vocab, device) if verify else
               {"measured_peak_bytes": None, "measured_activation_bytes": None})  # (null: not measured)
    return row


def build(config, data, vocab, device, training=None, collect=True):
    """(the plain step, its argument: the micro-batches, the parameters) for a configuration: the model and
    optimizer fresh, or `training` (build_training's, reused: max-batch --dry-run tries batch after batch);
    `collect`: the garbage of what ran before given back first (a dry run's holds no device memory)."""
    if collect:
        python_gc.collect()
    policy = make_policy(config) if config.policy != "off" else "off"
    model, loss_fn, params, opt = training or build_training(config, vocab, device, policy)
    batches = batchify(data, config.batch_size * config.accumulation_steps, device=device, dtype="float32")
    micro = micro_batches(batches, 0, config, device)

    def step(micro, measure=None):
        opt.reset_grad()
        sums = None
        if measure is not None:
            measure.append(nd.memory_stats(device)["current_bytes"])  # the step's start (M_act's baseline)
        for X, y in micro:
            with autograd.lazy_mode(config.lazy):
                loss = loss_fn(X, y) / len(micro) if len(micro) > 1 else loss_fn(X, y)
            if measure is not None:  # the forward pass, then what it holds (M_act)
                autograd.run_deferred([loss])
                loss.realize_cached_data()
                measure.append(nd.memory_stats(device)["current_bytes"])
            loss.backward()
            if len(micro) > 1:  # the gradients summed over the micro-batches, as gc.py run does
                grads = [p.grad.realize_cached_data() for p in params]
                sums = grads if sums is None else [s + g for s, g in zip(sums, grads)]
                del grads  # (not alive beside the next micro-batch's)
                for p in params:
                    p.grad = None
        if len(micro) > 1:
            for p, g in zip(params, sums):
                p.grad = ndl.Tensor(g, device=device, requires_grad=False)
        opt.step()
    return step, micro, params


def predict_row(config, data, vocab, device, training=None, collect=True):
    """(ndl.memory.predict's Prediction of the configuration's step, its row's predicted fields)."""
    step, micro, params = build(config, data, vocab, device, training, collect)
    prediction = ndl.memory.predict(step, micro, device=device)
    if config.policy == "budget":  # the dry run planned the Budget: the steps after the first apply its plan as
        prediction = ndl.memory.predict(step, micro, device=device)  # they go (eager mode frees sooner)
    row = {"predicted_peak_bytes": prediction.peak_bytes,
           "predicted_activation_bytes": prediction.activation_bytes,
           "predicted_peak_activation_bytes": prediction.peak_activation_bytes}
    return prediction, row


def measure_row(config, data, vocab, device):
    """One real step after a first (the Budget plans, the state and gradients exist as a later step finds them):
    the allocator's peak over it and what its forward held (M_act, above the step's start)."""
    step, micro, _ = build(config, data, vocab, device)
    step(micro)
    python_gc.collect()
    nd.reset_peak_memory_stats(device)
    step(micro)  # the plain step: reading M_act computes the forward pass before backward() makes its seed
    peak = nd.memory_stats(device)["peak_bytes"]
    measure = []
    step(micro, measure)
    return {"measured_peak_bytes": peak, "measured_activation_bytes": measure[1] - measure[0]}


def _line(row, verify):
    mark = "~" if row["approximate"] else " "
    text = (f"  {row['lever']:<22s} peak {mark}{row['predicted_peak_bytes'] / 2**20:8.1f} MB   M_act "
            f"{row['predicted_activation_bytes'] / 2**20:8.1f} MB")
    if verify:
        text += (f"   measured {row['measured_peak_bytes'] / 2**20:8.1f} MB  ({_off(row)})   M_act "
                 f"{row['measured_activation_bytes'] / 2**20:8.1f} MB")
    return text + f"   ({row['seconds']:.2f} s)" + (f"   [{', '.join(row['causes'])}]" if row["causes"] else "")


def _off(row):
    return f"{100 * (row['predicted_peak_bytes'] / row['measured_peak_bytes'] - 1):+.2f}%"


if __name__ == "__main__":
    sys.exit("run it as: python gc.py explain [flags]")
