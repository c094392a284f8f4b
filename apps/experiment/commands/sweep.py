"""gc.py sweep (one parameter over several values and policies) and gc.py max-batch (the largest batch under a
memory cap, per policy): each configuration a child `gc.py run` process, the JSON written as they end."""
import gc as python_gc
import os
import sys
import time
from dataclasses import replace

from needle import backend_ndarray as nd

from ..children import invocation_id, last_line, run_child
from ..console import OOM_EXIT, fail, note, progress_on, say, tqdm_class
from ..data import check_corpus, load_data, resolve_data
from ..footprint import check_fits
from ..growth import DEPTH_PARAMETERS, growth_exponents
from ..records import config_of, read_json, write_json
from ..report import mb, model_text
from ..setup import BUDGET_CURVES, budget_policy, make_policy, pick_device, plan_budget
from .explain import build, predict_row
from .plot import plot_max_batch, plot_sweep
from .run import build_training


def main_sweep(config):
    source = resolve_data(config.data)
    device = pick_device(config.device)
    data, vocab = load_data(source)
    for value in config.values:  # every configuration fits the corpus and the memory, or the sweep does not start
        check_corpus(replace(config, **{config.over: value}), data)
        check_fits(replace(config, **{config.over: value}), vocab, device)
    policies = config.policies or (["off", "all", "sqrt", "selective"] if config.over == "num_layers" else
                                   list(BUDGET_CURVES) if config.over == "budget_mb" else ["off", "all"])
    points = [(value, policy) for value in config.values for policy in policies]
    if config.over == "budget_mb":
        points = budget_points(config, policies, data, vocab, device)
    del data
    out_dir = config.out or os.path.join("results", f"sweep_{config.over}")
    os.makedirs(out_dir, exist_ok=True)
    sweep_id = invocation_id()
    summary = os.path.join(out_dir, f"sweep-{sweep_id}.json")
    total = config.repeats * len(points)
    print(f"gc.py sweep {sweep_id}: {config.over} in {config.values}, policies {' '.join(policies)}, "
          f"{config.repeats} repeat{'s' * (config.repeats != 1)} ({total} runs, each a fresh process); "
          f"{model_text(config, {config.over})}; data {source}; writing {summary} as it goes", flush=True)
    records, failed, n = [], 0, 0
    bar = tqdm_class()(total=total, desc=f"sweep {config.over}", unit="run", file=sys.stderr,
                       disable=not progress_on(config.progress), dynamic_ncols=True)
    for rep in range(config.repeats):
        for value, policy in points:
            n += 1
            r = sweep_run(config, source, sweep_id, out_dir, (rep, value, policy), f"[{n}/{total}]")
            bar.update()
            if r is None:
                failed += 1
                continue
            records.append(r)
            for name in (summary, os.path.join(out_dir, "sweep.json")):  # as it goes; sweep.json: the latest
                write_json(name, records)
    bar.close()
    if not records:
        print(f"gc.py sweep: all {total} runs failed", file=sys.stderr)
        sys.exit(1)
    if config.over in DEPTH_PARAMETERS:
        print_growth(records, config.over)
    pngs = plot_sweep(records, out_dir)
    print(f"wrote {summary} (also as {os.path.join(out_dir, 'sweep.json')}) and {', '.join(pngs)}")
    if failed:
        print(f"gc.py sweep: {failed} of {total} runs failed (see above)", file=sys.stderr)
        sys.exit(1)


def print_growth(records, over):
    """How each policy's M_act, M_peak and M_floor grow with depth: the exponent p of c + a * over^p."""
    print(f"growth with {over}: p of v = c + a * {over}^p, fitted to the increments of the medians "
          f"(1: linear, 0.5: Chen's sqrt; '-': does not grow)")
    print(f"  {'policy':12s}" + "".join(f"{name:>10s}" for name in ("M_act", "M_peak", "M_floor")))
    for label, fitted in growth_exponents(records, over).items():
        print(f"  {label:12s}" + "".join(f"{'-' if p is None else f'{p:.2f}':>10s}" for p in fitted.values()))


def sweep_run(config, source, sweep_id, out_dir, point, counter):
    """One run of the sweep, point = (repeat, value, policy), in a child process; its record tagged with the
    sweep, or None when it failed."""
    rep, value, policy = point
    name = f"{config.over}={value} policy={policy} rep {rep}"
    note(f"  {counter} start  {name}")
    t0 = time.perf_counter()
    path = os.path.join(out_dir, f"sweep-{sweep_id}_{config.over}{value}_{policy}_rep{rep}.json")
    child_policy, offload = BUDGET_CURVES.get(policy, (policy, False))  # budget-offload: --policy budget --offload
    code, log = run_child(config, source, {config.over: value, "offload": offload}, child_policy, path)
    if code != 0 or not os.path.exists(path):
        say(f"  {counter} failed {name} (exit {code}): {last_line(log)}")
        return None
    r = read_json(path)  # exactly the file this child was told to write
    r.update({"repeat": rep, "label": policy, "sweep_id": sweep_id, "sweep_over": config.over, "sweep_value": value,
              "json": path})
    write_json(path, r)  # the child's file says which sweep it belongs to (plot reads it)
    unreliable = " (T unreliable)" if not r.get("step_time_reliable", True) else ""
    say(f"  {counter} done   {name}: M_act {mb(r['activation_bytes'])} MB  "
        f"M_peak {mb(r['peak_activation_bytes'])} MB  T {r['time']:.3f} s{unreliable}  "
        f"({time.perf_counter() - t0:.0f} s)")
    return r


def budget_points(config, policies, data, vocab, device):
    """A sweep over budget_mb: its (budget, policy) points.  What no budget bounds (off; offload, which stands for
    offload only) runs once, at the first budget; a Budget curve's point under the least M_peak its Budget can
    reach is left out, and said so; a budget under every Budget curve's least M_peak stops the sweep here."""
    least = {}
    for curve in [p for p in policies if BUDGET_CURVES.get(p, ("",))[0] == "budget"]:
        probe = budget_policy(replace(config, offload=BUDGET_CURVES[curve][1]), bound=2**62)  # above any peak
        plan_budget(replace(config, policy="budget"), data, vocab, device, probe)
        least[curve] = probe.minimum_peak or 0
    points = []
    for value in config.values:
        bound = int(value * 2**20)
        if least and all(bound < m for m in least.values()):
            fail(f"--values {value:g} is infeasible: the least M_peak Budget can reach on this model is "
                 f"{min(least.values()) / 2**20:.3g} MB ({min(least.values())} bytes)")
        for policy in policies:
            if policy in least and bound < least[policy]:
                print(f"budget {value:g} MB is under {policy}'s least M_peak ({least[policy] / 2**20:.3g} MB): "
                      f"that point is left out")
            elif policy in least or value == config.values[0]:
                points.append((value, policy))
    return points


def main_max_batch(config):
    source = resolve_data(config.data)
    device = pick_device(config.device)
    out_dir = config.out or os.path.join("results", "max_batch")
    search = BatchSearch(config, source, device, out_dir)
    check_fits(config, search.result["vocab_size"], device)  # the model alone under the cap, or no search
    os.makedirs(out_dir, exist_ok=True)
    search.start()
    for policy in search.policies:
        fits = search.predicted_fits if config.dry_run else search.fits
        lo, hi = 0, config.batch_size
        while fits(hi, policy):  # double until a batch does not fit...
            lo, hi = hi, hi * 2
        while hi - lo > max(1, lo // 16):  # ...then bisect to within ~6%
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid, policy) else (lo, mid)
        if config.dry_run:
            lo = search.confirm(lo, policy)
        search.result["largest_batch"][policy] = lo
        write_json(search.path, search.result)
        say(f"  {policy:>9s}: largest batch under {config.memory_limit_mb:g} MB = {lo}")
    search.bar.close()
    best = search.result["largest_batch"]
    if best.get("off"):
        for policy, b in best.items():
            print(f"  {policy:>9s}: {b / best['off']:.2f}x the batch of gc off")
    png = plot_max_batch(search.result, out_dir)
    print(f"wrote {search.path} and {png}")


class BatchSearch:
    """max-batch's tries: each a child `gc.py run` of 2 steps under the cap, recorded in max_batch.json."""

    def __init__(self, config, source, device, out_dir):
        self.config, self.source, self.out_dir = config, source, out_dir
        self.id = invocation_id()
        self.policies = config.policies or ["off", "all", "sqrt", "selective"]
        data, vocab = load_data(source)
        self.result = {"kind": "max-batch", "max_batch_id": self.id, "policies": self.policies,
                       **config_of(config, source, vocab, device), "largest_batch": {}, "tries": []}
        self.result.update(batch_size=None, effective_batch_size=None, first_batch_size=config.batch_size,
                           max_batches=2)  # the batch is what is searched; each try trains 2 steps
        self.path = os.path.join(out_dir, "max_batch.json")
        self.bar = None
        self.device = device
        self.data = (data, vocab) if config.dry_run else None  # --dry-run predicts in this process
        self.trainings = {}  # policy -> (model, loss, parameters, optimizer) of --dry-run's tries

    def start(self):
        """The search's header line, and its progress bar under it."""
        config = self.config
        how = ("each try a dry run of the step (ndl.memory.predict), the answer trained one step" if config.dry_run
               else "a fresh process per try")
        print(f"gc.py max-batch {self.id}: the largest batch that trains under {config.memory_limit_mb:g} MB, per "
              f"policy ({' '.join(self.policies)}), from batch {config.batch_size} (doubled, then bisected; "
              f"{how}); {model_text(config, {'batch_size'})}; data {self.source}", flush=True)
        self.bar = tqdm_class()(desc="max-batch tries", unit="try", file=sys.stderr,
                                disable=not progress_on(config.progress), dynamic_ncols=True)

    def predicted_fits(self, batch, policy):
        """--dry-run: whether ndl.memory.predict's whole-step peak of `batch` with `policy` is under the cap (one
        dry run in this process: nothing computed)."""
        config = replace(self.config, batch_size=batch, policy=policy, accumulation_steps=1)
        data, vocab = self.data
        if policy not in self.trainings:  # one model per policy: the batch is all a try changes
            self.trainings.clear()
            python_gc.collect()  # (the last policy's model and real step go before this one's tries count bytes)
            self.trainings[policy] = build_training(config, vocab, self.device,
                                                    make_policy(config) if policy != "off" else "off")
        peak = predict_row(config, data, vocab, self.device, self.trainings[policy], collect=False)[1][
            "predicted_peak_bytes"]
        fits = peak <= self.config.memory_limit_mb * 2**20
        self.result["tries"].append({"policy": policy, "batch_size": batch, "fits": fits, "predicted_peak_bytes": peak,
                                     "dry_run": True})
        note(f"  [{len(self.result['tries'])}] predicted policy={policy} batch_size={batch}: {peak / 2**20:.1f} MB, "
             f"{'fits' if fits else 'over the cap'}")
        self.bar.update()
        return fits

    def confirm(self, batch, policy):
        """--dry-run's answer, trained for real: one step under the cap, in this process (the model the predictions
        were made on; nothing else of the search holds device memory); if it does not fit after all, the batch ~6%
        smaller, until one does (0: none)."""
        while batch > 0 and not self.one_real_step(batch, policy):
            batch = min(batch - 1, batch * 15 // 16)
        return batch

    def one_real_step(self, batch, policy):
        """Whether one real training step of `batch` with `policy` stays under the cap (the allocator's limit)."""
        config = replace(self.config, batch_size=batch, policy=policy, accumulation_steps=1)
        data, vocab = self.data
        step, micro, _ = build(config, data, vocab, self.device, self.trainings[policy])
        t0, fits = time.perf_counter(), True
        nd.set_memory_limit(int(self.config.memory_limit_mb * 2**20), self.device)
        try:
            step(micro)
        except MemoryError:
            fits = False
        finally:
            nd.set_memory_limit(0, self.device)
        seconds = time.perf_counter() - t0
        self.result["tries"].append({"policy": policy, "batch_size": batch, "fits": fits, "confirmed": True,
                                     "seconds": seconds})
        write_json(self.path, self.result)
        note(f"  [{len(self.result['tries'])}] trained policy={policy} batch_size={batch}: one step, "
             f"{'fits' if fits else 'out of memory'} ({seconds:.0f} s)")
        return fits

    def fits(self, batch, policy):
        """Whether `batch` trains under the cap with `policy` (a run that fails otherwise stops the search)."""
        tries = self.result["tries"]
        name = f"policy={policy} batch_size={batch}"
        note(f"  [{len(tries) + 1}] start  {name}")
        t0 = time.perf_counter()
        json_path = os.path.join(self.out_dir, f"max-batch-{self.id}_{policy}_b{batch}.json")
        code, log = run_child(self.config, self.source, {"batch_size": batch, "max_batches": 2}, policy, json_path)
        self.bar.update()
        if code not in (0, OOM_EXIT):
            self.bar.close()
            print(f"gc.py max-batch: the run {name} failed (exit {code}): {last_line(log)}", file=sys.stderr)
            sys.exit(1)
        if os.path.exists(json_path):  # tag it: plot leaves a search's tries out of its run plots
            write_json(json_path, {**read_json(json_path), "max_batch_id": self.id})
        tries.append({"policy": policy, "batch_size": batch, "fits": code == 0, "json": json_path})
        write_json(self.path, self.result)
        note(f"  [{len(tries)}] done   {name}: {'fits' if code == 0 else 'out of memory'} "
             f"({time.perf_counter() - t0:.0f} s)")
        return code == 0
