"""Every flag of every gc.py subcommand, its default and its help: what `python gc.py [CMD] --help` prints.
Each flag may be spelled with hyphens (--batch-size) or, as in the earlier project, underscores (--batch_size)."""
import argparse
import difflib
import shutil
import sys

from .ablations import ABLATIONS, ACCUMULATE
from .console import BAD_INPUT_EXIT
from .data import SYNTHETIC
from .presets import PRESETS, WRITEUP_TEXT
from .setup import BUDGET_CURVES, HEADS, OPTIMIZERS, PARALLEL, POLICIES, PRECISIONS

TITLE = "gc.py — how much memory gradient checkpointing saves on a PTB Transformer language model, and what it costs."
SUBCOMMANDS = ["run", "sweep", "max-batch", "ablate", "timeline", "explain", "plot", "sample"]
HELPS = {"run": "gc off vs on for one configuration, side by side (the default)",
         "sweep": "one parameter over several values and policies, a fresh process per run; JSON and plots",
         "max-batch": "the largest batch that trains under --memory-limit-mb, per policy (bisection)",
         "ablate": "every memory technique on the same model and steps, a fresh process per row; one table",
         "timeline": "one step's memory, every allocation and free, gc off beside gc on: JSON, PNG and HTML page",
         "explain": "where the step peaks and why; each lever's whole-step peak from a dry run (--verify: measured)",
         "plot": "draw, into DIR, the plots of the gc.py JSON files DIR holds (run, sweep, max-batch, ablate)",
         "sample": "text from a model gc.py run --save-checkpoint FILE trained: the prompt, continued"}
SWEEPABLE = ["batch_size", "hidden_size", "embedding_size", "num_layers", "seq_len", "segment_len", "budget_mb"]
MEASURES = """\
What is measured, per training step (forward + backward + Adam), from the allocator's exact byte counts
(needle.backend_ndarray.memory_stats); [JSON key]; memory in bytes, times in seconds:
  M_act    activation bytes held at the start of backward: allocator current bytes minus the
           baseline (parameters, optimizer state and the batch)  [activation_bytes]
  M_peak   the allocator's peak over forward + backward (reset at the step's start) minus the same
           baseline: what Budget(b) bounds  [peak_activation_bytes; step_peak_bytes adds Adam's update]
  M_floor  the least M_act checkpointing could reach on this graph: what no policy can drop (leaves
           such as masks and constants, and the boundaries of the annotated regions)  [floor_bytes]
  T_step   median step time over the steps after --warmup; overhead = T_on / T_off - 1; flagged
           unreliable when fewer than 3 steps were timed  [step_time_seconds, alias time]
  RSS_peak what the OS sees: the process's peak resident memory during the step minus its resident
           memory at the step's start (the kernel's high-water mark VmHWM, reset through
           /proc/self/clear_refs; where it cannot be reset, a lower bound from samples); CPU only
           [rss_peak_bytes]
  M_host   (offloading: --policy offload, --offload) the most host memory the step's offloaded
           activations held at once, outside the device allocator and so outside M_act and M_peak
           [host_peak_bytes; activation_offloaded_bytes, activation_fetched_bytes: copied each way]
  T_copy   the seconds the step spent copying activations to and from host memory while nothing else
           ran (exposed)  [copy_seconds_exposed]; hidden = 1 - exposed / all copy seconds (their bytes
           at the measured bandwidth): the share overlapped with compute  [copy_hidden_fraction]; on
           cpu() a copy thread runs them beside compute, on cuda a copy stream; on cpu_numpy they are
           synchronous, so hidden is 0
The table's other rows:
  step peak         the step's peak of all live bytes: the allocator's peak over the whole step,
                    baseline included (parameters, gradients, optimizer state, the batch, activations,
                    temporaries, the optimizer's update)  [peak_bytes]; what it was made of at that
                    instant, by category, and its phase, from the run's last step recorded with
                    ndl.memory.record (that step is left out of T_step)  [peak_by_category, peak_phase]
  loss (last step)  the training loss of the last step  [loss]
  recomputed nodes  graph nodes backward recomputed in the last step (0 with gc off)  [recomputed_nodes]
  GPUtil used       (cuda) the GPU memory the driver reports in use after the last step
                    [gpu_memory_bytes, per step]
  parameters, gradients, state   their bytes on the device: M_act and M_peak leave out the
                    parameters and the state (the baseline); M_peak holds the gradients (made in backward)
                    [param_bytes, grad_bytes, optimizer_bytes; offloaded_bytes: the state in host
                    memory, --offload-state]
  host memory (MB)  (a pass that offloaded) M_host  [host_peak_bytes]
  copy time (s)     (a pass that offloaded) T_copy, and the hidden share
                    [copy_seconds_exposed, copy_hidden_fraction]
  loss scale, skipped steps      (mixed-fp16) GradScaler's scale at the end, and the steps it
                    skipped because a gradient overflowed  [loss_scale, skipped_steps]
Both runs release every activation after its last backward use: the difference is checkpointing alone."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each flag once, in its hyphenated spelling, with its default."""

    def _format_action_invocation(self, action):
        if not action.option_strings:
            return super()._format_action_invocation(action)
        shown = [s for s in action.option_strings if "_" not in s] or action.option_strings
        if action.nargs == 0:
            return ", ".join(shown)
        return f"{', '.join(shown)} {self._format_args(action, self._get_default_metavar_for_optional(action))}"

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if "default" not in text and default is not None and default is not False and default != argparse.SUPPRESS \
                and action.option_strings:
            text += " (default: %(default)s)"
        return text


def formatter(prog):
    columns = shutil.get_terminal_size((106, 24)).columns  # 104 wide, or the terminal's width
    return HelpFormatter(prog, max_help_position=28, width=max(80, min(104, columns - 2)))


class Parser(argparse.ArgumentParser):
    """argparse, with every error as one line on stderr (exit status 2), naming the flag and the closest one."""

    def flags(self):
        """The parser's flags (argparse actions with an option string), in the order they were added."""
        return [action for action in self._actions if action.option_strings]

    def error(self, message):
        hint = ""
        if "unrecognized arguments" in message:
            words = message.split(":", 1)[1].split()
            flags = [s for a in self.flags() for s in a.option_strings if "_" not in s]
            close = [(w, difflib.get_close_matches(w.split("=")[0].replace("_", "-"), flags, n=1, cutoff=0.6))
                     for w in words if w.startswith("--")]
            hint = "".join(f"; did you mean {m[0]} for {w}?" for w, m in close if m)
            misplaced = [w for w in words if w in SUBCOMMANDS]
            if misplaced:
                hint += f"; the subcommand goes first: python gc.py {misplaced[0]} [flags]"
        print(f"{self.prog}: error: {message}{hint} (see python {self.prog} --help)", file=sys.stderr)
        sys.exit(BAD_INPUT_EXIT)


def flag(parser, name, **kwargs):
    """--name-with-hyphens, also accepted as --name_with_underscores (the earlier project's spelling)."""
    names = [f"--{name.replace('_', '-')}"] + ([f"--{name}"] if "_" in name else [])
    parser.add_argument(*names, dest=name, **kwargs)


def add_model_flags(p, command):
    """Every flag of run, sweep, max-batch and ablate, in the groups --help shows."""
    g = p.add_argument_group("model and data")
    flag(g, "data", default=None, metavar="DIR",
         help=f"PTB folder with train.txt and test.txt, or '{SYNTHETIC}' (default: data/ptb, else ../shared/data/ptb, "
              "else a synthetic Zipf corpus with a PTB-sized vocabulary; an explicit folder must exist)")
    if command == "max-batch":
        flag(g, "batch_size", type=int, default=8, metavar="N",
             help="the first batch tried: the search doubles it until a batch does not fit, then bisects")
    elif command == "ablate":
        flag(g, "batch_size", type=int, default=32, metavar="N",
             help=f"sequences per optimizer step in every row; rows with accumulation x{ACCUMULATE} train "
                  f"micro-batches of N/{ACCUMULATE} (N must divide by {ACCUMULATE})")
    else:
        flag(g, "batch_size", type=int, default=32, metavar="N", help="sequences per micro-batch")
    if command != "ablate":
        flag(g, "accumulation_steps", type=int, default=1, metavar="K",
             help="micro-batches per optimizer step, their gradients summed: the effective batch is batch-size x "
                  "K, with about 1/K of the activation memory")
    flag(g, "seq_len", type=int, default=32, metavar="T", help="tokens per sequence (BPTT window)")
    flag(g, "embedding_size", type=int, default=256, metavar="D", help="model width")
    flag(g, "hidden_size", type=int, default=256, metavar="H", help="feed-forward width of each Transformer layer")
    flag(g, "num_layers", type=int, default=4, metavar="L",
         help="Transformer layers (LSTM layers with --seq-model lstm)")
    flag(g, "seq_model", default="transformer", choices=["transformer", "lstm"],
         help="the language model's sequence model: the Transformer, or an LSTM (--seq-len its chain of time steps; "
              "--hidden-size its state; the Transformer's own flags unused)")
    flag(g, "num_head", type=int, default=4, metavar="N", help="attention heads; must divide --embedding-size")
    flag(g, "dropout", type=float, default=0.0, metavar="P", help="dropout probability, in [0, 1)")
    flag(g, "activation", default="relu", choices=["relu", "gelu", "gelu_tanh", "silu"],
         help="the MLP's activation in each Transformer layer (gelu: exact, with erf; gelu_tanh: PyTorch's tanh "
              "approximation), fused into its first linear; relu keeps no pre-activation for backward, the "
              "others keep it")
    flag(g, "activation_bits", type=int, default=None, choices=[1, 2, 3, 4], metavar="K",
         help="few-bit derivatives (gelu, gelu_tanh, silu): backward keeps a K-bit code of each pre-activation "
              "instead of the pre-activation, and multiplies by the fitted derivative of its interval (1..4); "
              "relu: 1, its exact mask, so its gradient reads no activation")
    flag(g, "compress_bits", type=int, default=None, choices=[2, 4, 8], metavar="K",
         help="compressed saved activations (checkpoint.compress): what gc on's policy keeps for backward is kept "
              "as K-bit codes (2, 4, 8) where the gradients reading it allow; with --policy off, everything kept, "
              "compressed; gc off stays exact. ablate: the bits of its compress rows (default: 8)")
    flag(g, "head_init_scale", type=float, default=0.1, metavar="S",
         help="scale of the output layer's initial weight, so the loss starts near ln(vocab); 1 keeps the course's "
              "init (whose logits start with a std of several units)")
    if command == "ablate":
        add_ablate_flags(p)
        return
    add_step_flags(g)
    add_checkpointing_flags(p, command)
    add_training_flags(p, command)
    if command == "run":
        add_parallel_flags(p)
    add_output_flags(p, command)
    if command == "run":
        add_checkpoint_flags(p)
        g = p.add_argument_group("preset")
        flag(g, "preset", default=None, choices=list(PRESETS),
             help=f"writeup: the write-up's experiment, \"{WRITEUP_TEXT}\": those flags set (a flag given wins), "
                  "gc off against on, each run on the CPU and on the GPU where there is one; the two measures with "
                  "their spread over the runs")


def add_step_flags(g):
    """How a step computes and updates: precision, optimizer, the LM head (not ablate's: its rows set them)."""
    flag(g, "precision", default="fp32", choices=PRECISIONS,
         help="fp32; mixed-bf16 / mixed-fp16: ndl.autocast around forward and loss, float32 master weights "
              "(mixed-fp16 with ndl.amp.GradScaler); bf16: pure bfloat16 weights, activations and Adam state "
              "(default: fp32)")
    flag(g, "stochastic_rounding", action="store_true",
         help="with --precision bf16: round each weight update stochastically (else to nearest)")
    flag(g, "init_scale", type=float, default=2.0**16, metavar="S", help="with --precision mixed-fp16: "
         "GradScaler's initial loss scale (default: 65536, PyTorch's; overflowing steps are skipped)")
    flag(g, "optimizer", default="adam", choices=OPTIMIZERS,
         help="adam (the course's), adam8bit (8-bit block-wise moments), adafactor (factored second moments, "
              "no first moment, at --lr), sgd (momentum 0.9) (default: adam)")
    flag(g, "optimizer_in_backward", action="store_true",
         help="update each parameter inside backward, as soon as its gradient is complete, and free that gradient "
              "there (the optimizer's in_backward=True): the step never holds every gradient at once. Not with "
              "--accumulation-steps > 1, --precision mixed-fp16 (GradScaler) or --parallel")
    flag(g, "offload_state", action="store_true", help="keep the optimizer's state in host memory, outside the "
         "device allocator, and bring each parameter's state in for its update")
    flag(g, "capture", action="store_true", help="run the step through ndl.jit.capture: recorded on its first "
         "calls, then replayed as its backend calls on a static memory plan (docs/capture.md)")
    flag(g, "head", default="fused", choices=HEADS,
         help="the LM head and loss: fused is model.loss(x, y) (ops.linear_cross_entropy: the logits computed "
              "a chunk of tokens at a time, never held whole; the same loss and gradients); full is the "
              "course's SoftmaxLoss(model(x)), logits and their gradient held whole (default: fused)")


def add_checkpointing_flags(p, command):
    g = p.add_argument_group("checkpointing")
    if command in ("run", "timeline", "explain"):
        flag(g, "policy", default=None, choices=POLICIES,
             help="what gc on drops: all (every node inside each layer, and the layers' outputs but the last), "
                  "sqrt (Chen's schedule, inside each layer and across them), selective (keeps matmul outputs), "
                  "layers (every layer's interior, its output kept: one extra forward), budget (keeps M_peak under "
                  "--budget-mb), offload (parks in host memory what all drops, fetched back for backward); off runs "
                  "gc off alone (default: all)")
        flag(g, "offload", action="store_true",
             help="with --policy budget: Budget may also park a value in host memory instead of recomputing it, "
                  "whichever it predicts is faster (Budget(b, offload=True))")
    if command == "run":
        flag(g, "use_gc", type=int, choices=[0, 1], default=None,
             help="run only gc off (0) or only gc on (1) (default: both, side by side)")
    if command not in ("run", "timeline", "explain"):
        choices = POLICIES + (["budget-offload"] if command == "sweep" else [])
        flag(g, "policies", nargs="+", choices=choices, default=None, metavar="POLICY",
             help="policies to compare, from " + "|".join(choices) + " (default: " +
                  ("off all; off all sqrt selective over num_layers; over budget_mb the three curves " +
                   " ".join(BUDGET_CURVES) + ": recompute only, offload only, both" if command == "sweep"
                   else "off all sqrt selective") + ")")
    flag(g, "segment_len", type=int, default=None, metavar="N",
         help="with policy all: keep every N-th node of a region as a checkpoint (default: none kept)")
    flag(g, "budget_mb", type=float, default=None, metavar="MB",
         help="the M_peak bound of policy budget, in MiB (needs --policy budget)")
    flag(g, "host_bandwidth", type=float, default=None, metavar="GBPS",
         help="Budget plans its copies to and from host memory as if at GBPS GB/s (16: PCIe 4) (default: the "
              "bandwidth measured on this machine)")


def add_training_flags(p, command):
    g = p.add_argument_group("training and measurement")
    flag(g, "lazy", action=argparse.BooleanOptionalAction, default=True,
         help="lazy evaluation: ops record the graph and realization computes it (default: lazy)")
    flag(g, "device", default=None, choices=["cpu", "cuda", "cpu_numpy"],
         help="array backend (default: cuda when available, else cpu)")
    flag(g, "epochs", type=int, default=1, metavar="N", help="passes over the --max-batches windows")
    flag(g, "max_batches", type=int, default=30, metavar="N", help="optimizer steps per epoch (at most)")
    if command == "timeline":
        flag(g, "warmup", type=int, default=1, metavar="N",
             help="steps trained before the recorded one (so the optimizer's state exists, and a Budget has planned)")
    else:
        flag(g, "warmup", type=int, default=2, metavar="N", help="steps left out of the T_step median")
    flag(g, "lr", type=float, default=1e-3, metavar="LR", help="Adam's learning rate")
    flag(g, "seed", type=int, default=0, metavar="N", help="NumPy seed for the model's initialization")
    if command == "max-batch":
        flag(g, "memory_limit_mb", type=float, required=True, metavar="MB",
             help="the cap: past it the allocator raises MemoryError (required)")
    else:
        flag(g, "memory_limit_mb", type=float, default=None, metavar="MB",
             help="cap the allocator: past it a run stops with MemoryError, exit status 3 (default: no cap)")


def add_parallel_flags(p):
    g = p.add_argument_group("distributed: mpiexec -n N python gc.py run --parallel ...")
    flag(g, "parallel", default=None, choices=PARALLEL,
         help="dp: data parallel, --batch-size split over the ranks, gradients all-reduced; zero1 / zero2 / zero3: "
              "ZeRO stage 1 / 2 / 3 on top (optimizer state / and gradients / and parameters partitioned); "
              "pipeline: GPipe, one stage of layers per rank, the --accumulation-steps micro-batches flowing through "
              "them; tp: tensor parallel (Megatron: heads, feed-forward width and vocabulary split over the ranks); "
              "tp+sp: and sequence parallel (layer norms and dropouts on sequence shards); tp+dp: tensor groups of 2 "
              "ranks, data parallel across them (mpiexec -n 4) (default: none)")
    flag(g, "bucket_mb", type=float, default=25.0, metavar="MB",
         help="dp, zero: gradients are reduced in buckets of about MB (PyTorch DDP's 25)")


def add_output_flags(p, command):
    g = p.add_argument_group("output")
    if command == "explain":  # (it writes --json FILE only)
        flag(g, "verify", action="store_true", help="also train each what-if row one step, measured beside it")
        flag(g, "json", default=None, metavar="FILE", help="write the what-if rows to FILE (JSON)")
        return
    if command == "max-batch":
        flag(g, "dry_run", action="store_true", help="bisect on dry runs (ndl.memory.predict), then train the answer")
    default_out = {"sweep": "results/sweep_OVER", "max-batch": "results/max_batch"}.get(command, "results")
    what = "the JSON, PNG and HTML files" if command == "timeline" else "the JSON (and PNG) files"
    flag(g, "out", default=None, metavar="DIR", help=f"folder for {what} (default: {default_out})")
    if command == "run":
        flag(g, "json", default=None, metavar="FILE",
             help="write the one run's JSON to exactly FILE instead (needs --use-gc or --policy off; sweep and "
                  "max-batch give each child its own)")
    flag(g, "progress", action=argparse.BooleanOptionalAction, default=None,
         help="progress bars on stderr (default: when stderr is a terminal or in a notebook)")


def add_checkpoint_flags(p):
    g = p.add_argument_group("saving and resuming (one pass: with --use-gc or --policy off)")
    flag(g, "save_checkpoint", default=None, metavar="FILE",
         help="save the model, optimizer, loss scaler and RNG state, the step and the run's flags to FILE (.npz; "
              "under mpiexec one FILE.rankR.npz per rank) when training ends, and every --save-every steps")
    flag(g, "save_every", type=int, default=None, metavar="N",
         help="with --save-checkpoint: also save after every N-th step (default: at the end only)")
    flag(g, "resume", default=None, metavar="FILE",
         help="continue the training a --save-checkpoint FILE saved, from its step to the end of this run's "
              "schedule (--max-batches x --epochs), bit for bit as if it had not stopped; the model flags must "
              "match")


def add_ablate_flags(p):
    g = p.add_argument_group("ablation")
    flag(g, "rows", nargs="+", default=None, metavar="ROW",
         help="the rows to train, in this order, from " + " ".join(ABLATIONS) + " (default: all of them; dp only "
              "when gc.py ablate runs under mpiexec -n N)")
    flag(g, "steps", type=int, default=8, metavar="N", help="optimizer steps each row trains")
    flag(g, "warmup", type=int, default=2, metavar="N", help="steps left out of the T_step median")
    flag(g, "budget_mb", type=float, default=None, metavar="MB",
         help="the M_peak bound of the budget rows (budget, budget-offload), in MiB (default: midway between the "
              "least M_peak checkpointing can reach and gc off's, as Budget's planner predicts them; checked before "
              "any row runs)")
    g = p.add_argument_group("training and measurement")
    flag(g, "lazy", action=argparse.BooleanOptionalAction, default=True,
         help="lazy evaluation: ops record the graph and realization computes it (default: lazy)")
    flag(g, "device", default=None, choices=["cpu", "cuda", "cpu_numpy"],
         help="array backend (default: cuda when available, else cpu)")
    flag(g, "lr", type=float, default=1e-3, metavar="LR", help="Adam's learning rate")
    flag(g, "seed", type=int, default=0, metavar="N", help="NumPy seed for the model's initialization")
    g = p.add_argument_group("output")
    flag(g, "out", default=None, metavar="DIR",
         help="folder for ablation.json, ablation.png and each row's run JSON (default: results/ablation)")
    flag(g, "progress", action=argparse.BooleanOptionalAction, default=None,
         help="a progress bar on stderr (default: when stderr is a terminal or in a notebook)")
    # what the rows set themselves, or gc.py run's defaults
    p.set_defaults(accumulation_steps=1, epochs=1, max_batches=None, segment_len=None, memory_limit_mb=None, head=None)


def number(text):
    """A --values entry: an int where it is one (batch sizes, layers), else a float (budgets in MiB)."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None


def add_sweep_flags(p):
    g = p.add_argument_group("sweep")
    flag(g, "over", default="batch_size", type=lambda s: s.replace("-", "_"), choices=SWEEPABLE,
         help="the parameter to sweep")
    flag(g, "values", type=number, nargs="+", default=[16, 32, 64, 128], metavar="V",
         help="its values (positive integers; over budget_mb, MiB)")
    flag(g, "repeats", type=int, default=2, metavar="N", help="runs per value and policy (error bars)")


def add_sample_flags(p):
    g = p.add_argument_group("sample")
    flag(g, "checkpoint", required=True, metavar="FILE",
         help="a file gc.py run --save-checkpoint FILE wrote (the model's flags and vocabulary travel in it) "
              "(required)")
    flag(g, "prompt", required=True, metavar="TEXT",
         help="the words to continue, from the model's vocabulary (PTB: lower case, numbers as N, rare words <unk>) "
              "(required)")
    flag(g, "tokens", type=int, default=40, metavar="N", help="words to add to the prompt")
    flag(g, "temperature", type=float, default=1.0, metavar="T",
         help="draw each word from softmax(logits / T): below 1 surer, above 1 wilder, 0 always the likeliest")
    flag(g, "top_k", type=int, default=None, metavar="K", help="draw only among the K likeliest words (default: all)")
    flag(g, "seed", type=int, default=0, metavar="N", help="the draws' seed: one seed, one text")
    flag(g, "device", default=None, choices=["cpu", "cuda", "cpu_numpy"],
         help="array backend (default: cuda when available, else cpu)")


def build_parser():
    """(the top-level parser, which only prints the overview, {subcommand: its parser})."""
    top = Parser(prog="gc.py", formatter_class=formatter,
                 usage="python gc.py [run|sweep|max-batch|ablate|timeline|explain|plot|sample] [flags]",
                 description=TITLE + "\n\nsubcommands (run is the default):\n"
                             + "".join(f"  {c:11s}{h}\n" for c, h in HELPS.items()),
                 epilog="python gc.py CMD --help lists CMD's flags and their defaults. Every flag may be spelled with\n"
                        "hyphens or underscores (--batch-size, --batch_size).\n\n" + MEASURES, allow_abbrev=False)
    return top, {command: subcommand_parser(command) for command in SUBCOMMANDS}


def subcommand_parser(command):
    epilog = MEASURES + "\n\nEvery flag may also be spelled with underscores (--batch_size)."
    p = Parser(prog=f"gc.py {command}", description=f"python gc.py {command}: {HELPS[command]}.",
               formatter_class=formatter, epilog=epilog if command not in ("plot", "sample") else None,
               usage=f"python gc.py {command} {'DIR' if command == 'plot' else '[flags]'}", allow_abbrev=False)
    if command == "plot":
        p.add_argument("dir", metavar="DIR", help="a folder of gc.py JSON (run, sweep, max-batch or ablate); the "
                                                  "PNGs are written there")
    elif command == "sample":
        add_sample_flags(p)
    else:
        add_model_flags(p, command)
    if command == "sweep":
        add_sweep_flags(p)
    return p
