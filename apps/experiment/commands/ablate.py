"""gc.py ablate: every memory technique (ablations.ABLATIONS) trained on the same model for the same steps, each
row a child `gc.py run` process; one table, its JSON and a plot."""
import os
import sys
import time
from dataclasses import replace

from needle import checkpoint
from needle import distributed as dist

from ..ablations import ABLATIONS, BASE, BUDGET_ROWS, default_rows
from ..children import invocation_id, last_line, run_child
from ..console import fail, note, progress_on, say, tqdm_class
from ..data import check_corpus, load_data, resolve_data
from ..footprint import check_fits
from ..records import config_of, read_json, write_json
from ..report import mb, model_text, plural, print_ablation
from ..setup import TENSOR_PARALLEL, check_budget, parallel_layout, pick_device, plan_budget
from .plot import plot_ablation

# what each ablation row keeps of its run's record (the run's own JSON, named by "json", has everything)
ABLATION_KEYS = ["policy", "head", "batch_size", "accumulation_steps", "effective_batch_size", "budget_bytes",
                 "activation_bytes", "peak_activation_bytes", "peak_bytes", "peak_by_category", "peak_phase",
                 "floor_bytes", "rss_peak_bytes", "step_time_seconds",
                 "timed_steps", "step_time_reliable", "loss", "recomputed_nodes", "param_bytes", "grad_bytes",
                 "optimizer_bytes", "offloaded_bytes", "parallel", "world_size", "tokens_per_second", "per_rank",
                 "host_peak_bytes", "activation_offloaded_bytes", "copy_seconds_exposed", "copy_hidden_fraction"]


def main(config):
    if dist.comm.launcher_rank_and_size()[0] > 0:
        return  # under mpiexec rank 0 runs the rows (the dp row as a job of all the ranks); the others are done
    source = resolve_data(config.data)
    config = replace(config, max_batches=config.steps)
    device = pick_device(config.device)
    data, vocab = load_data(source)
    check_corpus(config, data)  # the effective batch: every row trains on the same windows
    split = [r for r in config.rows or default_rows() if ABLATIONS[r][1].get("parallel") in TENSOR_PARALLEL]
    ranks = dist.comm.launcher_rank_and_size()[1]
    if split and vocab % ranks:
        fail(f"ablate: row {split[0]} splits the vocabulary over {ranks} ranks, and this corpus has {vocab} words")
    check_fits(config, vocab, device)  # the baseline row's model (Adam, float32), before any row starts
    out_dir = config.out or os.path.join("results", "ablation")
    ablation_id = invocation_id()
    rows = config.rows or default_rows()
    budget = None
    if BUDGET_ROWS & set(rows):  # chosen and checked up front: an infeasible budget stops here, before any row runs
        budget = ablation_budget(config, data, vocab, device, offload="budget" not in rows)
    del data
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "ablation.json")
    result = {"kind": "ablation", "ablation_id": ablation_id, **config_of(config, source, vocab, device),
              "head": None, "steps_per_row": config.steps, "row_names": rows,
              "budget_bytes": budget and budget[0], "budget_rule": budget and budget[1],
              "budget_minimum_bytes": budget and budget[2], "budget_off_predicted_bytes": budget and budget[3],
              "rows": []}
    print(f"gc.py ablate {ablation_id}: {len(rows)} rows ({' '.join(rows)}), each a fresh process training "
          f"{plural(config.steps, 'step')} (warmup {config.warmup}); {model_text(config)}; data {source}; "
          f"writing {path} as it goes", flush=True)
    if budget:
        print(f"budget row: b = {budget[0] / 2**20:.1f} MB ({budget[1]}; least M_peak {budget[2] / 2**20:.1f} MB, "
              f"gc off's {budget[3] / 2**20:.1f} MB)", flush=True)
    bar = tqdm_class()(total=len(rows), desc="ablate", unit="row", file=sys.stderr,
                       disable=not progress_on(config.progress), dynamic_ncols=True)
    for n, name in enumerate(rows, 1):
        result["rows"].append(ablation_row(config, source, name, budget, out_dir, ablation_id, f"[{n}/{len(rows)}]"))
        bar.update()
        compare_to_baseline(result["rows"])
        write_json(path, result)
    bar.close()
    print_ablation(result)
    if not any("failed" not in r for r in result["rows"]):
        print("gc.py ablate: every row failed", file=sys.stderr)
        sys.exit(1)
    png = plot_ablation(result, out_dir)
    print(f"wrote {path} and {png}")
    failed = sum("failed" in r for r in result["rows"])
    if failed:
        print(f"gc.py ablate: {failed} of {len(rows)} rows failed (see above)", file=sys.stderr)
        sys.exit(1)


def ablation_row(config, source, name, budget, out_dir, ablation_id, counter):
    """One row trained in a child process: its line of the table (what it kept of the run's record)."""
    what, flags = ABLATIONS[name]
    flags = dict(flags)
    policy, k = flags.pop("policy", "off"), flags.pop("accumulate", 1)
    compress_bits = (config.compress_bits or 8) if flags.pop("compress", False) else None
    overrides = {**flags, "batch_size": config.batch_size // k, "accumulation_steps": k, "epochs": 1,
                 "compress_bits": compress_bits,
                 "max_batches": config.steps, "budget_mb": budget[0] / 2**20 if policy == "budget" else None,
                 "offload": flags.get("offload", False)}
    setup = setup_text(config, ABLATIONS[name][1], budget[0] if budget else 0, compress_bits)
    note(f"  {counter} start  {name}: {setup}")
    t0 = time.perf_counter()
    json_path = os.path.join(out_dir, f"ablation-{ablation_id}_{name}.json")
    code, log = run_child(config, source, overrides, policy, json_path)
    row = {"row": name, "what": what, "setup": setup, "flags": ABLATIONS[name][1], "json": json_path}
    if code != 0 or not os.path.exists(json_path):
        row["failed"] = f"exit {code}: {last_line(log)}"
        say(f"  {counter} failed {name} ({row['failed']})")
        return row
    r = read_json(json_path)
    write_json(json_path, {**r, "ablation_id": ablation_id, "label": name})  # plot: part of this ablation
    row.update({key: r.get(key) for key in ABLATION_KEYS})
    say(f"  {counter} done   {name}: M_act {mb(r['activation_bytes'])} MB  M_peak "
        f"{mb(r['peak_activation_bytes'])} MB  step peak {mb(r['peak_bytes'])} MB  T {r['time']:.3f} s  "
        f"loss {r['loss']:.4f}  "
        f"({time.perf_counter() - t0:.0f} s)")
    return row


def ablation_budget(config, data, vocab, device, offload=False):
    """(the budget rows' b in bytes, how it was chosen, Budget's least M_peak, its gc-off M_peak), up front; the
    budget-offload row plans with the same b (`offload`: it is the only budget row, so b is checked for it).

    Without --budget-mb, b is the midpoint between the least M_peak checkpointing can reach and gc off's M_peak,
    both as Budget's planner predicts them on the first step's graph (lazy: nothing computed; its predictions are
    within about 1% of the allocator's peak), so it is feasible and makes Budget drop some of what "all" drops.
    A given --budget-mb is checked the same way: below the least peak, one line and exit 2 before any row runs."""
    trial = replace(config, policy="budget", head=BASE["head"], accumulation_steps=1, segment_len=None)
    probe = checkpoint.Budget(2**62)  # above any peak: plans to drop nothing, and measures the least peak
    plan_budget(trial, data, vocab, device, probe)
    least, off = probe.minimum_peak, probe.predicted_peak
    if config.budget_mb is None:
        return (least + off) // 2, "midway between the least M_peak and gc off's (Budget's predictions)", least, off
    check_budget(replace(trial, offload=offload), data, vocab, device)
    return int(config.budget_mb * 2**20), "--budget-mb", least, off


def setup_text(config, flags, budget_bytes, compress_bits=None):
    """A row's setup in a few words: its policy, its head, its batch (micro-batches x accumulation)."""
    policy = flags.get("policy", "off")
    if compress_bits:
        policy += f", compressed {compress_bits}-bit"
    if policy == "budget":
        policy = f"budget {budget_bytes / 2**20:.1f} MB" + (", offload" if flags.get("offload") else "")
    k = flags.get("accumulate", 1)
    batch = f"batch {config.batch_size}" if k == 1 else f"batch {config.batch_size // k} x {k} = {config.batch_size}"
    extra = [f"{key} {value}" for key, value in flags.items() if key not in ("policy", "head", "accumulate",
                                                                            "parallel", "offload", "compress")]
    if flags.get("parallel"):
        ranks = dist.comm.launcher_rank_and_size()[1]
        _, data_ranks = parallel_layout(flags["parallel"], ranks)
        extra.append(f"{flags['parallel']} over {ranks} ranks ({config.batch_size // data_ranks} per rank)")
    return ", ".join([f"gc {policy}", f"{flags.get('head', 'full')} head", batch] + extra)


def compare_to_baseline(rows):
    """Each row's change from the baseline row: M_peak, the step's peak and T_step as ratios - 1, the final loss as
    a difference."""
    base = next((r for r in rows if r["row"] == "baseline" and "failed" not in r), None)
    for r in rows:
        if "failed" in r:
            continue
        ok = base is not None
        r["peak_change"] = r["peak_activation_bytes"] / base["peak_activation_bytes"] - 1 if ok else None
        r["peak_bytes_change"] = r["peak_bytes"] / base["peak_bytes"] - 1 if ok else None
        r["time_change"] = r["step_time_seconds"] / base["step_time_seconds"] - 1 if ok else None
        r["loss_diff"] = r["loss"] - base["loss"] if ok and None not in (r["loss"], base["loss"]) else None
