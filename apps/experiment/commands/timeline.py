"""gc.py timeline: one training step's memory, every allocation and free, recorded with ndl.memory.record() — gc off
and gc on (--policy) — drawn side by side on one shared y axis, and written as JSON, a PNG and an HTML page."""
import gc as python_gc  # the standard module
import hashlib
import json
import os

import needle as ndl
from needle.data import batchify
from needle.toolbox.memory.html import write_html
from needle.toolbox.memory.plot import plot_side_by_side

from ..data import check_corpus, load_data, resolve_data
from ..footprint import check_fits
from ..report import model_text, print_run_header
from ..setup import check_budget, make_policy, pick_device, policy_label
from ..step import train_step
from .run import build_training

MIB = 2**20  # the timeline's units are binary, and say so: MiB


def main(config):
    """Record one step (after --warmup steps) with gc off and with gc on; write the files; say how to read them."""
    source = resolve_data(config.data)
    data, vocab = load_data(source)
    device = pick_device(config.device)
    check_corpus(config, data)
    check_fits(config, vocab, device)
    if config.budget_mb is not None:
        check_budget(config, data, vocab, device)
    which = [False] if config.policy == "off" and config.compress_bits is None else [False, True]
    print_run_header(config, which, device, source, data, vocab)
    label = policy_label(config)  # "all+compress8" where --compress-bits wraps it
    out = config.out or "results"
    os.makedirs(out, exist_ok=True)
    base = os.path.join(out, file_stem(config, label))
    labelled = []
    for use_gc in which:
        name = f"gc on ({label})" if use_gc else "gc off"
        snapshot, step = recorded_step(config, use_gc, data, device, vocab)
        path = snapshot.save(f"{base}_{label if use_gc else 'off'}.json")
        print(f"{name}: {len(snapshot.events)} events, peak {snapshot.peak['bytes'] / MIB:.1f} MiB (the allocator's "
              f"{step['peak_bytes'] / MIB:.1f} MiB), {recomputed(snapshot)}; wrote {path}")
        print(largest_at_peak(snapshot))
        labelled.append((name, snapshot))
    title = (f"one training step of gc.py's model ({model_text(config)}): live bytes by category, "
             f"{' beside '.join(name for name, _ in labelled)}")
    png = plot_side_by_side(labelled, f"{base}.png", title=title)
    html = write_html([(name, s.data) for name, s in labelled], f"{base}.html", title=title)
    print(f"wrote {png} and {html} (open it in a browser: zoom with the wheel, hover an allocation, click an "
          f"instant)")


def recorded_step(config, use_gc, data, device, vocab):
    """(the Snapshot of one step, that step's measurements): --warmup steps first, unrecorded."""
    python_gc.collect()  # the previous pass's model must not be alive in this one's picture
    policy = make_policy(config) if use_gc else "off"
    model, loss_fn, params, opt = build_training(config, vocab, device, policy)
    batches = batchify(data, config.batch_size * config.accumulation_steps, device=device, dtype="float32")
    for i in range(config.warmup):
        _, loss = train_step(model, loss_fn, opt, batches, i * config.seq_len, config, device, params)
        del loss
    with ndl.memory.record(device) as snapshot:
        step, loss = train_step(model, loss_fn, opt, batches, config.warmup * config.seq_len, config, device, params)
        del loss
    return snapshot, step


def recomputed(snapshot):
    made = [b for b in snapshot.blocks if b["category"] == "activation_recomputed"]
    return f"{len(made)} buffers recomputed ({sum(b['bytes'] for b in made) / MIB:.1f} MiB)"


def largest_at_peak(snapshot, n=4):
    """The peak's largest tensors besides the parameters and optimizer state (there all step long), one line each:
    what made the peak, which a student looks for first."""
    alive = [b for b in snapshot.alive_at(snapshot.peak["event"])
             if b["category"] not in ("parameter", "optimizer_state")]
    rows = [f"    {b['bytes'] / MIB:7.2f} MiB  {b['category']:<21} {b.get('name') or b['op'] or ''} "
            f"{b['module'] or ''} {list(b['shape'])}" for b in alive[:n]]
    return "  the peak's largest tensors besides parameters and optimizer state:\n" + "\n".join(rows)


def file_stem(config, label):
    """timeline_b<batch>x<seq_len>_e<embedding>_h<hidden>_l<layers>_<policy>-<digest of every other flag>: no run
    of another configuration writes over it."""
    key = {k: v for k, v in sorted(vars(config).items()) if k not in ("argv", "out", "progress", "command")}
    digest = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return (f"timeline_b{config.batch_size}x{config.seq_len}_e{config.embedding_size}_h{config.hidden_size}_"
            f"l{config.num_layers}_{label}-{digest}")
