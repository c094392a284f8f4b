"""gc.py run: one configuration trained with checkpointing off and on (or one of them), side by side; every step
measured, the record written as JSON after each step, a table at the end."""
import gc as python_gc  # the standard module (built in, so gc.py's name does not shadow it)
import os
import sys
import time
from dataclasses import replace

import needle as ndl
from needle import backend_ndarray as nd
from needle import checkpoint
from needle import distributed as dist
from needle.checkpoint_budget import InfeasibleBudget
from needle.data import batchify

from ..console import INTERRUPTED_EXIT, OOM_EXIT, fail, progress_on, say, tqdm_class
from ..data import check_corpus, load_data, resolve_data, windows
from ..footprint import check_fits
from ..measure import peak_split
from ..records import ALIASES, config_of, summarize, write_json
from ..report import print_run_header, print_single, print_table, step_line
from ..setup import (AUTOCAST, TENSOR_PARALLEL, build_model, check_budget, check_tensor_parallel_vocabulary, make_loss,
                     make_optimizer, make_policy, pick_device, pipeline_loss, pipeline_stages, policy_label,
                     tensor_parallel_model)
from ..resume import load_training, parameters_sha256, restore_training, save_training
from ..step import captured_step, captured_training, pipeline_step, train_step


def main(config):
    """gc.py run: gc off and on (or the one pass --use-gc / --policy off asks for), then their table."""
    if config.parallel:
        dist.init()
        if dist.rank() > 0:  # rank 0 prints (every rank's figures) and writes the JSON
            sys.stdout = open(os.devnull, "w")
    source = resolve_data(config.data)
    data, vocab = load_data(source)
    device = pick_device(config.device)
    check_corpus(config, data)
    check_tensor_parallel_vocabulary(config, vocab)
    check_fits(config, vocab, device)  # before any model is built: one that cannot fit is refused here
    resumed = load_training(config, vocab) if config.resume else None
    if resumed and resumed["step"] >= total_steps(config, data):
        fail(f"--resume {config.resume} is at step {resumed['step']}, and this run's schedule (--max-batches x "
             f"--epochs) ends at step {total_steps(config, data)}: nothing is left to train")
    which = [False, True] if config.use_gc is None else [bool(config.use_gc)]
    if config.policy == "off" and config.compress_bits is None:  # (off + compress: gc on is compression alone)
        which = [False]
    if config.budget_mb is not None and True in which:  # before the gc-off pass: an infeasible budget fails now
        per_rank = config.batch_size // (dist.world_size() if config.parallel else 1)  # the graph each rank plans
        planned = check_budget(replace(config, batch_size=per_rank), data, vocab, device)
    print_run_header(config, which, device, source, data, vocab)
    if config.budget_mb is not None and True in which and slack(planned):
        print(f"--budget-mb {config.budget_mb:g} is above gc off's peak of {planned.predicted_peak / 2**20:.1f} MB: "
              f"nothing to drop (give a budget between policy all's M_peak and that to see Budget choose)")
    label = policy_label(config)
    out_dir = None if config.json else (config.out or "results")
    results = {}
    for use_gc in which:
        print(f"{f'gc on ({label})' if use_gc else 'gc off'}:", flush=True)
        try:
            results[use_gc] = train(config, use_gc, data, vocab, source, out_dir=out_dir, json_path=config.json,
                                    resumed=resumed)
        except MemoryError as err:
            print(f"gc.py: out of memory under --memory-limit-mb {config.memory_limit_mb:g}: {err}", file=sys.stderr)
            sys.exit(OOM_EXIT)
    if len(results) == 2:
        print_table(results[False], results[True])
    else:
        print_single(next(iter(results.values())))
    for r in results.values():
        if r["json"]:
            print(f"wrote {r['json']}")
    if out_dir:
        print(f"plots: python gc.py plot {out_dir}")


def train(config, use_gc, data, vocab, source, out_dir=None, quiet=False, json_path=None, resumed=None,
          split_peak=True):
    """Train for a few batches with checkpointing off or on; return the measured record (also as JSON: to
    json_path if given, else to a new file in out_dir if given), written after every step.  `resumed`, a state
    resume.load_training read, continues that training from its step instead of from the start.  `split_peak`:
    the last step is recorded with ndl.memory.record, its peak split by category (peak_by_category; one process
    only: not under --parallel)."""
    python_gc.collect()  # a previous run's model and optimizer must not count in this run's memory
    device = pick_device(config.device)
    if hasattr(device.mod, "empty_cache"):  # nor its freed blocks, which the allocator keeps for reuse
        device.mod.empty_cache()
    policy = make_policy(config) if use_gc else "off"
    model, loss_fn, params, opt = build_training(config, vocab, device, policy)
    scaler = ndl.amp.GradScaler(init_scale=config.init_scale) if config.precision == "mixed-fp16" else None
    first = restore_training(resumed, model, opt, scaler) if resumed else 0
    batches = batchify(data, config.batch_size * config.accumulation_steps, device=device, dtype="float32")
    captured = captured_training(model, loss_fn, opt, config, device) if config.capture else None
    record = new_record(config, use_gc, source, vocab, device, first)
    path = record_path(config, record["policy"], out_dir, json_path)
    nbatch, total = min(config.max_batches, windows(config, len(data))), total_steps(config, data)
    if config.memory_limit_mb:
        nd.set_memory_limit(int(config.memory_limit_mb * 2**20), device)
    bar = tqdm_class()(total=total - first, desc=f"gc {'on, ' + record['policy'] if use_gc else 'off'}", unit="step",
                       file=sys.stderr, disable=not progress_on(config.progress), leave=False, dynamic_ncols=True)
    i = first
    try:
        for i in range(first, total):
            start = (i % nbatch) * config.seq_len  # the step's window: a function of i, so a resumed run's too
            # the last step is recorded (measure.peak_split: its peak, by category), and left out of T_step
            step = one_step(config, (model, loss_fn, opt, params, scaler, captured), batches, start, device,
                            split_peak and i == total - 1 and not config.parallel and not captured)
            add_step(record, {"step": i, **step}, policy, config, path)
            if config.save_checkpoint and (i + 1 == total or config.save_every and (i + 1) % config.save_every == 0):
                save_training(config, vocab, i + 1, model, opt, scaler)
            bar.set_postfix(loss=f"{step['loss']:.3f}", M_peak=f"{step['peak_activation_bytes'] / 2**20:.0f}MB",
                            refresh=False)
            bar.update()
            if not quiet:
                say(step_line(i, step))
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback; the JSON holds every finished step
        where = f"results so far in {path}" if path else "no JSON written"
        print(f"gc.py: interrupted at step {i}; {where}", file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT)
    finally:
        bar.close()
        if config.memory_limit_mb:
            nd.set_memory_limit(0, device)
    record["parameters_sha256"] = parameters_sha256(params)  # two runs that trained alike end alike, to the byte
    record["complete"] = True
    if path:
        write_json(path, record)
    record["json"] = path
    return record


def one_step(config, training, batches, start, device, recorded):
    """One optimizer step, measured (train_step, or pipeline_step with --parallel pipeline); `recorded`: with
    ndl.memory.record on, its peak split by category (measure.peak_split) into the step's record."""
    model, loss_fn, opt, params, scaler, captured = training
    # the previous step's garbage in reference cycles is given back first, outside the step's clock: each step's
    # peak is its own bytes, the same whether recorded (ndl.memory.record collects too) or not
    python_gc.collect()
    try:
        with peak_split(device, on=recorded) as split:
            if captured:
                step, loss = captured_step(captured, batches, start, config, device, params, opt)
            elif config.parallel == "pipeline":
                step, loss = pipeline_step(model, loss_fn, opt, batches, start, config, device, params)
            else:
                step, loss = train_step(model, loss_fn, opt, batches, start, config, device, params, scaler)
            del loss
    except InfeasibleBudget as err:
        fail(str(err))  # planned before anything was computed
    if split:
        step.update(split, recorded=True)
    return step


def new_record(config, use_gc, source, vocab, device, first_step):
    """A run's record before its first step: what it is, its whole configuration, where it started."""
    label = policy_label(config) if use_gc else "off"
    record = {"kind": "run", "policy": label, "use_gc": bool(use_gc), **config_of(config, source, vocab, device),
              "aliases": ALIASES, "first_step": first_step, "complete": False, "steps": []}
    if not use_gc:
        record["budget_bytes"] = None  # the gc-off pass has no budget
    return record


def slack(budget):
    """Whether a planned Budget drops nothing: its bound is above gc off's peak, which it then predicts."""
    return all(all(flags) for flags in budget.planned.values())


def total_steps(config, data):
    """The run's schedule: --epochs passes over --max-batches windows (fewer where the corpus has fewer)."""
    return min(config.max_batches, windows(config, len(data))) * config.epochs


def build_training(config, vocab, device, policy):
    """(the model, or with --parallel its wrapper; loss_fn(X, y); the parameters; the optimizer)."""
    tensor_parallel = config.parallel in TENSOR_PARALLEL
    model = build_model(config, vocab, device, "off" if tensor_parallel else policy)
    model.train()
    if tensor_parallel:  # this rank's slice of every split layer (tp+dp: inside DataParallel over its data group)
        model = tensor_parallel_model(config, model, policy)
        params = model.parameters()
        opt = make_optimizer(config, params, getattr(model, "module", model))
        return model, make_loss(model, config.head, AUTOCAST[config.precision]), params, opt
    if config.parallel == "pipeline":  # this rank's stage of the model; the rest of it is freed
        model = dist.Pipeline(pipeline_stages(model, dist.world_size()), config.accumulation_steps)
        loss_fn = pipeline_loss(model.stage, config.head)
        params = model.parameters()
        return model, loss_fn, params, make_optimizer(config, params, model.stage)
    if config.parallel:
        model = dist.DataParallel(model, bucket_mb=config.bucket_mb)
    params = model.parameters()
    opt = make_optimizer(config, params, model)
    if config.parallel == "zero3":  # what the rank holds are its shards (the model's parameters: placeholders)
        params = opt.params
    return model, make_loss(model, config.head, AUTOCAST[config.precision]), params, opt


def record_path(config, label, out_dir, json_path):
    """Where the run's JSON goes: json_path, else a new file in out_dir, else nowhere (and on ranks > 0 nowhere:
    rank 0 writes it)."""
    if config.parallel and dist.rank() > 0:
        return None
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        return json_path
    if not out_dir:
        return None
    os.makedirs(out_dir, exist_ok=True)
    segment = f"_s{config.segment_len}" if config.segment_len else ""
    name = (f"{label}_b{config.batch_size}_h{config.hidden_size}_l{config.num_layers}{segment}_"
            f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{os.urandom(2).hex()}")
    return os.path.join(out_dir, f"{name}.json")


def add_step(record, step, policy, config, path):
    """A finished step into the record, its summary updated, the JSON rewritten: an interrupted run keeps what it
    measured."""
    if isinstance(policy, checkpoint.Budget) and "predicted_peak_activation_bytes" not in record:
        # Budget planned during this first step (lazy: before computing it; eager: at backward, after a forward
        # that kept everything)
        record["predicted_peak_activation_bytes"] = policy.predicted_peak
        record["budget_minimum_bytes"] = policy.minimum_peak
        # what the planner predicts besides the peak (None where it does not predict them)
        record["predicted_host_peak_bytes"] = getattr(policy, "predicted_host_peak", None)
        record["predicted_time_seconds"] = getattr(policy, "predicted_time", None)
        record["trace_seconds"] = policy.trace_seconds  # the Python that built the graph, timed (in predicted time)
        record["parks_gradients"] = policy.parks_gradients  # gradients to host memory: nothing fit without
        step["traced"] = not config.lazy
    record["steps"].append(step)
    summarize(record, config.warmup)
    if path:
        write_json(path, record)
