"""The text gc.py prints: a run's header, the gc off / on table (or one pass's line), the --parallel figures, and
the ablation's table.  Memory in MB here (MiB, 2**20 bytes); the JSON keeps bytes."""
import math
import os
import textwrap

from needle import distributed as dist
from needle.backend_ndarray.threads import busy_load, busy_machine_note
from needle.ops.ops_fused import chunk_rows

from .ablations import ACCUMULATE
from .data import SYNTHETIC, batch_text
from .measure import threads
from .records import MIN_TIMED_STEPS
from .setup import parallel_layout, policy_label

PARALLEL_TEXT = {"dp": "data parallel (gradients all-reduced in buckets during backward)",
                 "zero1": "ZeRO stage 1 (data parallel, the optimizer state partitioned)",
                 "zero2": "ZeRO stage 2 (data parallel, optimizer state and gradients partitioned: reduce-scatter)",
                 "zero3": "ZeRO stage 3 (data parallel, parameters too: each layer all-gathered for its forward and "
                          "backward, gradients reduce-scattered)",
                 "pipeline": "GPipe (the layers cut into one stage per rank, --accumulation-steps micro-batches)",
                 "tp": "tensor parallel (Megatron-LM: heads, feed-forward and vocabulary split between the ranks, "
                       "the whole batch on each)",
                 "tp+sp": "tensor + sequence parallel (Megatron-LM: layers split, the layer norms, dropouts and "
                          "residual stream on sequence shards)",
                 "tp+dp": "tensor x data parallel (tensor groups of 2 ranks split the model; the groups share the "
                          "batch, gradients all-reduced across them)"}


def mb(x):
    return f"{'n/a':>9s}" if x is None else f"{x / 2**20:9.1f}"


def mb_or_blank(nbytes):
    return "" if nbytes is None else f"{nbytes / 2**20:.1f}"


def pct(new, old):
    return f"{(new / old - 1) * 100:+.1f}%" if old else ""


def plural(n, word):
    return f"{n} {word}{'s' * (n != 1)}"


def time_note(*records):
    """Why the step times of `records` do not measure what a step costs, "" where nothing says so: too few timed
    steps (the header's --warmup note), other work on the machine (its load now, over the run's last minute)."""
    reasons = []
    few = [r for r in records if not r.get("step_time_reliable", True)]
    if few:
        n = min(r["timed_steps"] for r in few)
        reasons.append(f"from {n} timed step{'s' * (n != 1)} (< {MIN_TIMED_STEPS}); raise --max-batches or lower "
                       f"--warmup")
    busy = busy_load()
    if busy:
        reasons.append(f"the machine is busy: load average {busy[0]:.1f} on {busy[1]} CPUs")
    return f"unreliable: {'; '.join(reasons)}" if reasons else ""


def timed(r):
    """Whether a record's T_step is a measurement: some step was timed after the warm-up (0: the figure is of
    warm-up steps, which pay for first-time allocations and planning)."""
    return r.get("timed_steps") != 0


def seconds(r):
    """A record's T_step as a table prints it: n/a where no step was timed."""
    return f"{r['time']:.3f}" if timed(r) else "n/a"


def model_text(config, skip=()):
    parts = [("batch_size", "batch_size" not in skip and batch_text(config)),
             ("seq_len", f"seq_len {config.seq_len}"), ("embedding_size", f"embedding {config.embedding_size}"),
             ("hidden_size", f"feed-forward {config.hidden_size}"), ("num_layers", plural(config.num_layers, "layer")),
             ("num_head", f"{config.num_head} heads")]
    return ", ".join(text for key, text in parts if key not in skip)


# ----- gc.py run ----------------------------------------------------------------------------------------------
def print_run_header(config, which, device, source, data, vocab):
    """What a run trains (the model, the batch, the passes, the data) and where its loss should start."""
    label = policy_label(config)
    model = (f"LSTM LM ({plural(config.num_layers, 'layer')}, embedding {config.embedding_size}, state "
             f"{config.hidden_size})" if config.seq_model == "lstm" else
             f"Transformer LM ({plural(config.num_layers, 'layer')}, embedding {config.embedding_size}, "
             f"feed-forward {config.hidden_size}, {config.num_head} heads)")
    print(f"gc.py: {model}, {batch_text(config)} x seq_len "
          f"{config.seq_len}, device {device}, "
          f"{'lazy' if config.lazy else 'eager'}, {config.head} head; "
          + {(False,): "gc off", (True,): f"gc on ({label})", (False, True): f"gc off vs on ({label})"}[tuple(which)]
          + (f", segment_len {config.segment_len}" if config.segment_len else "")
          + (f", budget {config.budget_mb:g} MB" if config.budget_mb is not None else ""))
    if config.parallel:
        n = dist.world_size()
        tensor_ranks, data_ranks = parallel_layout(config.parallel, n)
        share = (f"({config.accumulation_steps} micro-batches through {plural(n, 'stage')})"
                 if config.parallel == "pipeline" else
                 f"({config.batch_size // data_ranks} sequences of each micro-batch per rank"
                 + (f", each layer split {tensor_ranks} ways)" if tensor_ranks > 1 else ")"))
        print(f"parallel: {PARALLEL_TEXT[config.parallel]}, {plural(n, 'rank')} {share}")
    if source == SYNTHETIC:
        why = "--data synthetic" if config.data == SYNTHETIC else "no PTB at data/ptb or ../shared/data/ptb"
        print(f"data: a synthetic Zipf corpus with a PTB-sized vocabulary ({why}), {vocab} words")
    else:
        print(f"data: {source}, {len(data)} training tokens, vocabulary {vocab}")
    init = (f"the output layer's initial weight is scaled by {config.head_init_scale:g} (--head-init-scale 1 keeps "
            f"the course's init, whose large logits start the loss at about twice that)"
            if config.head_init_scale != 1 else "the course's init (--head-init-scale 1) gives logits with a std of "
            "several units, so the loss starts far above that; the default 0.1 starts near it")
    print(f"loss at init: about ln({vocab}) = {math.log(vocab):.2f}, a uniform guess over the vocabulary; {init}")
    print(head_text(config, vocab))
    print(precision_text(config))
    if device.name == "cpu":
        print(threads_text())


def threads_text():
    """The header's line on the CPU backend's threads, and a note when other work shares the machine."""
    text = (f"threads: {threads()} (OMP_NUM_THREADS; needle's default is the physical cores, shared among the "
            f"ranks under mpiexec), waiting "
            f"{os.environ.get('OMP_WAIT_POLICY', 'PASSIVE').lower()}ly between parallel loops")
    note = busy_machine_note()
    return text + (f"\n{note}" if note else "")


PRECISION_TEXT = {"fp32": "float32 throughout", "mixed-bf16": "ndl.autocast(bfloat16), float32 master weights",
                  "mixed-fp16": "ndl.autocast(float16), float32 master weights",
                  "bf16": "pure bfloat16 weights, activations and optimizer state"}


def precision_text(config):
    """The header's line on --precision: what computes in what, and mixed-fp16's loss scale."""
    text = f"precision: {config.precision} ({PRECISION_TEXT[config.precision]})"
    if config.precision == "mixed-fp16":
        text += (f"; loss scale {config.init_scale:g} at the start (GradScaler: a step whose gradients overflow is "
                 f"skipped and the scale halved; the summary counts the skipped steps)")
    return text


def scaler_text(r):
    """mixed-fp16's summary: the loss scale at the end and the steps GradScaler skipped."""
    if r.get("precision") != "mixed-fp16":
        return None
    return (f"{'gc on' if r['use_gc'] else 'gc off'}: loss scale {r.get('loss_scale') or 0:g} at the end, "
            f"{plural(r.get('skipped_steps') or 0, 'skipped step')} (gradients overflowed in float16)")


def head_text(config, vocab):
    """The header's line on the output layer: what its logits weigh, and what the head holds of them."""
    tokens = config.batch_size * config.seq_len
    logits = (f"output layer: its logits ({tokens} tokens x {vocab} words x 4 bytes) are "
              f"{tokens * vocab * 4 / 2**20:.1f} MB")
    if config.head == "full":
        return f"{logits} a copy, and checkpointing never drops them (--head full: SoftmaxLoss(model(x)))"
    c = chunk_rows(tokens, vocab)
    if c == tokens:
        return (f"{logits}; the fused head (--head fused: model.loss(x, y)) computes them in one chunk inside its op, "
                f"never as a graph value kept for backward")
    return (f"{logits} whole; the fused head (--head fused: model.loss(x, y)) never holds them whole: "
            f"{c} tokens' logits ({c * vocab * 4 / 2**20:.1f} MB) at a time")


def step_line(i, step):
    """A step's line, printed as it ends."""
    rss = "" if step["rss_peak_bytes"] is None else f"  RSS_peak {step['rss_peak_bytes'] / 2**20:8.1f} MB"
    return (f"  step {i:3d}  loss {step['loss']:.3f}  M_act {step['activation_bytes'] / 2**20:8.1f} MB"
            f"  M_peak {step['peak_activation_bytes'] / 2**20:8.1f} MB{rss}  {step['time_seconds']:.3f} s")


def print_table(off, on):
    rows = [("M_act (MB)", "activation_bytes"), ("M_peak (MB)", "peak_activation_bytes"),
            ("step peak (MB)", "peak_bytes")]
    print(f"\n{'':18s}{'gc off':>12s}{'gc on':>12s}{'change':>10s}")
    for label, key in rows:
        a, b = off[key], on[key]
        print(f"{label:18s}{mb(a):>12s}{mb(b):>12s}{pct(b, a):>10s}")
    print(f"{'M_floor (MB)':18s}{'':>12s}{mb(on['floor_bytes']):>12s}   (what no policy can drop)")
    note, both = time_note(off, on), timed(off) and timed(on)
    print(f"{'T_step (s)':18s}{seconds(off):>12s}{seconds(on):>12s}{pct(on['time'], off['time']) if both else '':>10s}"
          + (f"   ({note})" if note else ""))
    print(f"{'loss (last step)':18s}{off['loss']:12.4f}{on['loss']:12.4f}")
    print(f"{'recomputed nodes':18s}{off['recomputed_nodes']:12d}{on['recomputed_nodes']:12d}")
    if off.get("activation_offloaded_bytes") or on.get("activation_offloaded_bytes"):
        print(f"{'host memory (MB)':18s}{mb(off.get('host_peak_bytes') or 0):>12s}"
              f"{mb(on.get('host_peak_bytes') or 0):>12s}   (M_host: {host_text(on)}, outside M_peak)")
        print(f"{'copy time (s)':18s}{off.get('copy_seconds_exposed') or 0:12.3f}"
              f"{on.get('copy_seconds_exposed') or 0:12.3f}   ({copy_text(on)})")
    if off.get("rss_peak_bytes") is not None and on.get("rss_peak_bytes") is not None:
        a, b = off["rss_peak_bytes"], on["rss_peak_bytes"]
        print(f"{'RSS_peak (MB)':18s}{mb(a):>12s}{mb(b):>12s}{pct(b, a):>10s}"
              "   (resident memory a step uses at its peak)")
    if off.get("steps") and off["steps"][0].get("gpu_memory_bytes") is not None:
        used = [r["steps"][-1]["gpu_memory_bytes"] for r in (off, on)]
        print(f"{'GPUtil used (MB)':18s}{mb(used[0]):>12s}{mb(used[1]):>12s}")
    lower = lambda key: (1 - on[key] / off[key]) * 100 if off[key] else 0.0  # noqa: E731
    overhead = (f"time overhead {pct(on['time'], off['time'])}" + (f" ({note})" if note else "") if both else
                "time overhead not measured (no step timed after the warm-up: lower --warmup)")
    print(f"\nactivation memory at backward start: {lower('activation_bytes'):.1f}% lower; M_peak: "
          f"{lower('peak_activation_bytes'):.1f}% lower; step peak (all live bytes): {lower('peak_bytes'):.1f}% lower; "
          f"{overhead}")
    if off.get("rss_peak_bytes") and on.get("rss_peak_bytes") is not None:
        print(f"resident memory a step uses at its peak (what the OS sees): {lower('rss_peak_bytes'):.1f}% lower")
    print(state_text(off))
    for r in (off, on):
        if r.get("peak_by_category"):
            print(f"{'gc on' if r['use_gc'] else 'gc off'}: {split_text(r)}")
    for line in filter(None, map(scaler_text, (off, on))):
        print(line)
    for r in (off, on) if off.get("parallel") else ():
        print(f"{'gc on' if r['use_gc'] else 'gc off'}: {parallel_text(r)}")


def print_single(r):
    """The summary of a run with one pass only (--use-gc, --policy off)."""
    note = time_note(r)
    print(f"\n{r['policy']}: M_act {mb(r['activation_bytes']).strip()} MB, M_peak "
          f"{mb(r['peak_activation_bytes']).strip()} MB, M_floor {mb(r['floor_bytes']).strip()} MB, "
          f"step peak {mb(r['peak_bytes']).strip()} MB, T_step {seconds(r)}{' s' * timed(r)}"
          f"{f' ({note})' if note else ''}, loss {r['loss']:.4f}")
    if r.get("peak_by_category"):
        print(split_text(r))
    if r.get("activation_offloaded_bytes"):
        print(f"host memory {mb(r['host_peak_bytes']).strip()} MB (M_host: {host_text(r)}, outside M_peak), "
              f"copy time {r['copy_seconds_exposed'] or 0:.3f} s ({copy_text(r)})")
    print(state_text(r))
    if scaler_text(r):
        print(scaler_text(r))
    if r.get("parallel"):
        print(parallel_text(r))


# the recorder's categories (ndl.memory.CATEGORIES) as the tables name them
CATEGORY_TEXT = {"parameter": "parameters", "gradient": "gradients", "optimizer_state": "optimizer state",
                 "activation_kept": "activations kept", "activation_recomputed": "recomputed",
                 "workspace": "temporaries", "input": "inputs", "other": "other"}


def split_text(r):
    """What a run's step peak (all live bytes) was made of, by category, at the recorded step's peak."""
    split = r["peak_by_category"]
    parts = [f"{CATEGORY_TEXT.get(c, c)} {mb(n).strip()}" for c, n in split.items() if n]
    where = f" in {r['peak_phase']}" if r.get("peak_phase") else ""
    return (f"step peak {mb(sum(split.values())).strip()} MB{where} (step {r.get('peak_split_step')}, recorded): "
            f"{', '.join(parts)} MB")


def host_text(r):
    """What a run's host memory holds: offloaded activations, and the parameters' gradients where the Budget
    parked them too (nothing fit without)."""
    return "offloaded activations and gradients" if r.get("parks_gradients") else "offloaded activations"


def copy_text(r):
    """What the copy time of an offloading pass is: the exposed seconds, and the share hidden under compute."""
    hidden = r.get("copy_hidden_fraction")
    return "exposed: nothing ran beside them" + ("" if hidden is None else f"; {hidden:.0%} hidden under compute")


def state_text(r):
    """Parameters, gradients and the optimizer's state: M_act and M_peak leave out the parameters and the state
    (their baseline); M_peak holds the gradients, which backward makes."""
    text = (f"parameters {mb(r.get('param_bytes') or 0).strip()} MB, gradients {mb(r.get('grad_bytes') or 0).strip()}"
            f" MB, {r.get('optimizer', 'adam')} state {mb(r.get('optimizer_bytes') or 0).strip()} MB on the device")
    if r.get("offloaded_bytes"):
        text += f" + {mb(r['offloaded_bytes']).strip()} MB offloaded to host memory"
    return text


def parallel_text(r):
    """--parallel: the memory of every rank (parameters, gradients, optimizer state, activations) and the
    throughput, with the communication (dp, zero) or the pipeline's bubble."""
    n, kind = r["world_size"], r["parallel"]
    lines = [f"--parallel {kind} over {plural(n, 'rank')}: {r['tokens_per_second']:,.0f} tokens/s (the global batch "
             f"{r['effective_batch_size']} x seq_len {r['seq_len']} per step)"]
    lines.append(f"  {'rank':>4s}{'parameters MB':>15s}{'gradients MB':>14s}{'opt. state MB':>15s}{'M_act MB':>10s}"
                 f"{'M_peak MB':>11s}{'T_step s':>10s}")
    for m in r.get("per_rank") or []:
        seconds = f"{m['time_seconds']:.3f}" if m.get("time_seconds") is not None else ""
        lines.append(f"  {m['rank']:4d}{mb(m['param_bytes']):>15s}{mb(m['grad_bytes']):>14s}"
                     f"{mb(m['optimizer_bytes']):>15s}{mb(m['activation_bytes']):>10s}"
                     f"{mb(m['peak_activation_bytes']):>11s}{seconds:>10s}")
    if r.get("tensor_parallel"):
        moved = ", ".join(f"{calls} {kind.replace('_', '-')}s of {elements:,} elements in all"
                          for kind, (calls, elements) in r["tensor_parallel"].items())
        lines.append(f"  the split layers' collectives in the last step, per rank: {moved or 'none'}")
    if r.get("sync"):
        s = r["sync"]
        op = "reduce-scatter" if kind == "zero2" else "all-reduce"
        lines.append(f"  gradients: {plural(s['buckets'], 'bucket')} of {s['bytes'] / 2**20:.1f} MB in all ({op}), "
                     f"{s['started_before_last_gradient']} started while backward ran; backward waited "
                     f"{s['wait_seconds'] * 1e3:.1f} ms at its end and copied {s['copy_seconds'] * 1e3:.1f} ms")
    if r.get("pipeline"):
        p = r["pipeline"]
        lines.append(f"  GPipe bubble: measured {p['bubble_median']:.1%} of a step (median over the timed steps, mean "
                     f"over ranks), (d - 1)/(m + d - 1) = {p['theory']:.1%}")
    return "\n".join(lines)


# ----- gc.py ablate -------------------------------------------------------------------------------------------
def print_ablation(result):
    """The ablation's table: a line per row, its change from the baseline row beside M_peak, T_step and the loss."""
    rows = result["rows"]
    widths = (max(len(r["row"]) for r in rows + [{"row": "row"}]) + 2, max(len(r["setup"]) for r in rows) + 2)
    print(f"\n{'row':{widths[0]}s}{'setup':{widths[1]}s}{'M_act MB':>9s}{'M_peak MB':>10s}{'vs base':>9s}"
          f"{'peak MB':>9s}{'vs base':>9s}{'P+G MB':>8s}{'state MB':>9s}{'RSS MB':>8s}{'T_step s':>9s}{'vs base':>9s}"
          f"{'loss':>8s}{'loss-base':>10s}")
    for r in rows:
        print(_ablation_line(r, widths))
    split = [r for r in rows if r.get("peak_by_category")]
    if split:
        cats = [c for c in CATEGORY_TEXT if any(r["peak_by_category"].get(c) for r in split)]
        print(f"\nthe step's peak (all live bytes), by category at its instant, MB:\n{'row':{widths[0]}s}"
              f"{'peak':>8s}{'in':>10s}" + "".join(f"{CATEGORY_TEXT[c]:>{len(CATEGORY_TEXT[c]) + 2}s}" for c in cats))
        for r in split:
            print(f"{r['row']:{widths[0]}s}{r['peak_bytes'] / 2**20:8.1f}{r.get('peak_phase') or '':>10s}" + "".join(
                f"{r['peak_by_category'].get(c, 0) / 2**20:{len(CATEGORY_TEXT[c]) + 2}.1f}" for c in cats))
    note = time_note(*[r for r in rows if "failed" not in r]).replace("--max-batches", "--steps")
    b = result["batch_size"]
    accumulation = (f" x {ACCUMULATE}: {ACCUMULATE} micro-batches of {b // ACCUMULATE} per step, their gradients "
                    f"summed." if any(r.get("accumulation_steps", 1) > 1 for r in rows) else "")
    print(textwrap.fill(
        f"M_act, M_peak: exact allocator bytes over forward + backward, parameters and optimizer state left out; "
        f"peak: the step's peak of all live bytes (parameters, gradients, optimizer state, activations, "
        f"temporaries), split by category on the row's last step, recorded (and left out of T_step); "
        f"P+G: parameters and gradients; state: the optimizer's state on the device (moments, master weights); "
        f"RSS: the resident memory a step uses at its peak (RSS less the allocator's free cache); "
        f"T_step: median step time after the warm-up"
        f"{' (' + note + ')' if note else ''}; loss: the last step's, loss-base: minus the baseline's. Every row "
        f"trains the same {result['steps_per_row']} steps of {b} sequences each.{accumulation}", 110))


def _ablation_line(r, widths):
    """One row of the ablation's table, its name and setup in columns `widths` wide (the longest, and 2 spaces)."""
    name = f"{r['row']:{widths[0]}s}{r['setup']:{widths[1]}s}"
    if "failed" in r:
        return f"{name}failed ({r['failed']})"
    change = lambda key: "" if r.get(key) is None or r["row"] == "baseline" else f"{r[key] * 100:+.1f}%"  # noqa
    rss = "" if r.get("rss_peak_bytes") is None else f"{r['rss_peak_bytes'] / 2**20:.1f}"
    loss = "" if r["loss"] is None else f"{r['loss']:.4f}"
    diff = "" if r.get("loss_diff") is None or r["row"] == "baseline" else \
        "0" if r["loss_diff"] == 0 else f"{r['loss_diff']:+.1e}"
    return (f"{name}{r['activation_bytes'] / 2**20:9.1f}"
            f"{r['peak_activation_bytes'] / 2**20:10.1f}{change('peak_change'):>9s}"
            f"{mb_or_blank(r.get('peak_bytes')):>9s}{change('peak_bytes_change'):>9s}"
            f"{mb_or_blank((r.get('param_bytes') or 0) + (r.get('grad_bytes') or 0)):>8s}"
            f"{mb_or_blank(r.get('optimizer_bytes')):>9s}{rss:>8s}"
            f"{seconds({**r, 'time': r['step_time_seconds']}):>9s}{change('time_change') if timed(r) else '':>9s}"
            f"{loss:>8s}{diff:>10s}")
