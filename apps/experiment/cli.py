"""gc.py's command line: argv -> a RunConfig, checked -> the subcommand's function (COMMANDS).

The commands and an example of each are in gc.py's docstring; `python gc.py CMD --help` lists CMD's flags.

A bad input is one line on stderr and exit status 2, before any work: argparse's errors (parser.Parser), the
checks below, which need no data or model, and the paths the command will write (outputs.py).  Those that need the
data come first thing in the subcommand: the corpus, whether the model fits (footprint.py), a --resume's flags.
"""
import difflib
import math
import os
import signal
import sys
from dataclasses import replace

from needle import distributed as dist

from .ablations import ABLATIONS, ACCUMULATE, BUDGET_ROWS, default_rows
from . import presets
from .commands import ablate, explain, plot, run, sample, sweep, timeline, writeup
from .console import BAD_INPUT_EXIT, INTERRUPTED_EXIT, fail
from .outputs import check_outputs, checkpoint_file
from .parser import SUBCOMMANDS, build_parser
from .setup import BUDGET_CURVES, PARALLEL, TENSOR_PARALLEL, TP_DP_TENSOR_SIZE, RunConfig, parallel_layout

COMMANDS = {"run": run.main, "sweep": sweep.main_sweep, "max-batch": sweep.main_max_batch, "ablate": ablate.main,
            "timeline": timeline.main, "explain": explain.main, "plot": plot.main, "sample": sample.main}
POSITIVE = ("batch_size", "seq_len", "embedding_size", "hidden_size", "num_layers", "num_head", "accumulation_steps",
            "epochs", "max_batches", "segment_len", "repeats", "steps", "save_every")
DEFAULT_OUT = {"run": "results", "timeline": "results", "max-batch": os.path.join("results", "max_batch"),
               "ablate": os.path.join("results", "ablation")}  # sweep's: results/sweep_OVER


def main(argv=None):
    """Run gc.py with `argv` (default: this process's command line)."""
    config = parse_args(argv)
    previous = signal.signal(signal.SIGINT, interrupt_once)
    try:
        (writeup.main if config.preset else COMMANDS[config.command])(config)
    except KeyboardInterrupt:  # Ctrl-C outside a run's steps (those say which step, and where its JSON is)
        print(f"gc.py: {config.command} interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT)
    finally:  # not interrupted (then Ctrl-C stays ignored while the process ends): the caller's handler again
        if signal.getsignal(signal.SIGINT) is interrupt_once:
            signal.signal(signal.SIGINT, previous)


def interrupt_once(signum, frame):
    """Ctrl-C: KeyboardInterrupt, once. A second Ctrl-C (a user pressing again while the first unwinds) is ignored:
    it would interrupt a destructor or the line that says where the results are, and print a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def parse_args(argv=None):
    """The RunConfig of a gc.py command line, validated (a bad input exits 2 with one line on stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    top, parsers = build_parser()
    if argv and argv[0] in ("-h", "--help"):
        top.print_help()
        sys.exit(0)
    if argv and argv[0] in SUBCOMMANDS:
        command, rest = argv[0], argv[1:]
    elif argv and not argv[0].startswith("-"):
        close = difflib.get_close_matches(argv[0], SUBCOMMANDS, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        print(f"gc.py: error: {argv[0]!r} is not a subcommand ({', '.join(SUBCOMMANDS)}){hint} "
              f"(see python gc.py --help)", file=sys.stderr)
        sys.exit(BAD_INPUT_EXIT)
    else:
        command, rest = "run", argv
    args = parsers[command].parse_args(rest)
    args.command = command
    config = RunConfig.from_args(args, argv)
    if config.preset:
        config = presets.apply(config, rest)
    validate(config)
    return config


def validate(config):
    """Every check that needs no data or model: bad input fails here, before any work."""
    command = config.command
    if command == "plot":
        return
    if command == "sample":
        return sample.validate(config)
    if command == "ablate":
        validate_ablate(config)
    validate_numbers(config)
    if command != "ablate":
        validate_command(config)
    if command == "explain":  # it writes --json FILE only
        if config.json:
            check_outputs(config, None)
        return
    check_outputs(config, DEFAULT_OUT.get(command) or os.path.join("results", f"sweep_{config.over}"))


def validate_command(config):
    """run's, sweep's and max-batch's checks (ablate's rows set what these check)."""
    command = config.command
    _, ranks = dist.comm.launcher_rank_and_size()  # mpiexec's environment; MPI itself starts later
    if command == "run":
        validate_parallel(config, ranks)
        validate_checkpoint_flags(config)
    elif ranks > 1:
        fail(f"gc.py {command} runs in one process, not under mpiexec with {ranks} ranks (gc.py run --parallel and "
             f"gc.py ablate do)")
    validate_policies(config)
    validate_seq_model(config)
    validate_in_backward(config)
    validate_capture(config)
    if command == "sweep":
        validate_sweep(config)
    if config.stochastic_rounding and config.precision != "bf16":
        fail(f"--stochastic-rounding is for pure bf16 training (--precision bf16), whose bfloat16 weights it rounds "
             f"the updates of; --precision {config.precision} keeps float32 weights: leave it out, or give "
             f"--precision bf16")


def validate_capture(config):
    """--capture replays one recorded program per step: refused with what a replay cannot repeat."""
    clash = (f"--accumulation-steps {config.accumulation_steps}" if config.accumulation_steps > 1 else
             "--precision mixed-fp16 (GradScaler reads every gradient into Python)"
             if config.precision == "mixed-fp16" else f"--parallel {config.parallel}" if config.parallel else
             "--optimizer-in-backward" if config.optimizer_in_backward else
             "offloading (--offload-state, --policy offload, --offload)"
             if config.offload_state or config.policy == "offload" or getattr(config, "offload", False) else None)
    if config.capture and clash:
        fail(f"--capture replays a step recorded once, which it cannot do with {clash}: leave one of them out")
    if config.capture and (config.command in ("timeline", "explain") or getattr(config, "dry_run", False)):
        what = "--dry-run's predictions and its one real step" if config.command == "max-batch" else \
            f"gc.py {config.command}"
        fail(f"--capture is for gc.py run, sweep and max-batch's real search: {what} measures the step uncaptured")


def validate_in_backward(config):
    """--optimizer-in-backward updates each parameter during backward, the moment its gradient is complete: refused
    where something must see every gradient, or a later backward's, before the update."""
    if not config.optimizer_in_backward:
        return
    clash = (f"--accumulation-steps {config.accumulation_steps}, which sums several backwards' gradients before one "
             "update" if config.accumulation_steps > 1 else
             "--precision mixed-fp16, whose GradScaler checks every gradient for overflow before the update"
             if config.precision == "mixed-fp16" else
             f"--parallel {config.parallel}, whose gradients are reduced across the ranks after backward"
             if config.parallel else None)
    if clash:
        fail(f"--optimizer-in-backward updates each parameter inside backward, so it cannot go with "
             f"{clash}: leave one of them out")


def validate_seq_model(config):
    """--seq-model lstm: the Transformer's own flags have nothing to configure; said, not ignored."""
    if config.seq_model != "lstm":
        return
    transformer_only = [flag for flag, given in (
        ("--activation", config.activation != "relu"), ("--activation-bits", config.activation_bits is not None),
        ("--dropout", bool(config.dropout)), ("--parallel", config.parallel in ("pipeline", "tp", "tp+sp", "tp+dp")))
        if given]
    if transformer_only:
        fail(f"--seq-model lstm: {', '.join(transformer_only)} configure the Transformer (its MLP, its layers, its "
             f"tensor or pipeline parallelism); the LSTM language model has none: leave them out")


def validate_checkpoint_flags(config):
    """--save-checkpoint, --save-every, --resume: one pass's training, and a file to resume that exists."""
    if (config.save_checkpoint or config.resume) and config.use_gc is None and config.policy != "off":
        flag = "--save-checkpoint" if config.save_checkpoint else "--resume"
        fail(f"{flag} carries one pass's training; give --use-gc 0 or 1 (or --policy off) with it")
    if config.save_every is not None and not config.save_checkpoint:
        fail("--save-every N saves to --save-checkpoint FILE: give that too")
    if config.resume:
        path = checkpoint_file(config.resume, *dist.comm.launcher_rank_and_size())
        if not os.path.isfile(path):
            fail(f"--resume {config.resume}: there is no file {path}")


def validate_numbers(config):
    """Sizes, rates and bounds: each in its range."""
    for name in POSITIVE:
        value = getattr(config, name)
        if value is not None and value < 1:
            fail(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if config.embedding_size % config.num_head:
        fail(f"--num-head {config.num_head} must divide --embedding-size {config.embedding_size}")
    if config.warmup < 0:
        fail(f"--warmup must be 0 or more, got {config.warmup}")
    if not 0 <= config.dropout < 1:
        fail(f"--dropout must be in [0, 1), got {config.dropout:g}")
    if config.activation_bits not in (None, 1) and config.activation == "relu":
        fail("--activation-bits with --activation relu is 1 (its mask: relu's derivative is 0 or 1); 2..4 are for "
             "gelu, gelu_tanh or silu")
    if not (math.isfinite(config.lr) and config.lr > 0):
        fail(f"--lr must be a positive number, got {config.lr:g}")
    if not 0 <= config.seed < 2**32:
        fail(f"--seed must be in [0, 2**32), got {config.seed}")
    if not (math.isfinite(config.init_scale) and config.init_scale > 0):
        fail(f"--init-scale must be a positive number, got {config.init_scale:g}")
    if not (math.isfinite(config.head_init_scale) and config.head_init_scale >= 0):
        fail(f"--head-init-scale must be 0 or more, got {config.head_init_scale:g}")
    for name, value in (("budget_mb", config.budget_mb), ("memory_limit_mb", config.memory_limit_mb)):
        if value is not None and not (math.isfinite(value) and value > 0):
            fail(f"--{name.replace('_', '-')} must be a positive number of MiB, got {value:g}")
    if config.host_bandwidth is not None and not (math.isfinite(config.host_bandwidth) and config.host_bandwidth > 0):
        fail(f"--host-bandwidth must be a positive number of GB/s, got {config.host_bandwidth:g}")


def validate_ablate(config):
    """ablate's rows: known, each once, and trainable with this batch and this many processes."""
    rows = config.rows or []
    unknown = [r for r in rows if r not in ABLATIONS]
    if unknown:
        fail(f"ablate: unknown row{'s' * (len(unknown) > 1)} {' '.join(unknown)} (rows: {' '.join(ABLATIONS)})")
    ranks = dist.comm.launcher_rank_and_size()[1]
    parallel = [r for r in config.rows or default_rows() if ABLATIONS[r][1].get("parallel")]
    if parallel and ranks < 2:
        fail(f"ablate: row {parallel[0]} trains on several processes: run gc.py ablate under mpiexec -n N "
             f"(N >= 2)")
    if parallel and config.batch_size % ranks:
        fail(f"ablate: row {parallel[0]} splits --batch-size {config.batch_size} over {ranks} ranks: give a "
             f"multiple of {ranks}")
    for row in [r for r in parallel if ABLATIONS[r][1]["parallel"] in TENSOR_PARALLEL]:
        for name, value in (("--num-head", config.num_head), ("--hidden-size", config.hidden_size)):
            if value % ranks:
                fail(f"ablate: row {row} splits every layer over {ranks} ranks: {name} {value} does not divide by "
                     f"{ranks}")
    if len(set(rows)) < len(rows):
        fail(f"ablate: a row is named twice in --rows {' '.join(rows)}")
    accumulating = [r for r in config.rows or ABLATIONS if ABLATIONS[r][1].get("accumulate", 1) > 1]
    if accumulating and config.batch_size % ACCUMULATE:
        fail(f"ablate: row {accumulating[0]} trains {ACCUMULATE} micro-batches of --batch-size / {ACCUMULATE}: "
             f"give a --batch-size that divides by {ACCUMULATE}, not {config.batch_size}")
    if config.budget_mb is not None and not BUDGET_ROWS & set(config.rows or ABLATIONS):
        fail("ablate: --budget-mb is the bound of the budget rows: add budget to --rows (or budget-offload)")


def validate_policies(config):
    """run's --policy / --use-gc / --json, and the flags that belong to one policy (run, sweep, max-batch)."""
    command = config.command
    if command in ("timeline", "explain"):
        policies = [config.policy or "all"]
    elif command == "run":
        policies = [config.policy or "all"]
        if config.use_gc == 1 and config.policy == "off" and config.compress_bits is None:
            fail("--use-gc 1 runs gc on, --policy off runs gc off: give one of them")
        if config.use_gc == 0 and config.policy not in (None, "off"):
            fail(f"--use-gc 0 runs gc off only, so --policy {config.policy} would be ignored: leave one out")
        if config.json and config.use_gc is None and (config.policy != "off" or config.compress_bits is not None):
            fail("--json names one run's file; give --use-gc 0 or 1 (or --policy off) with it")
    else:
        policies = sweep_policies(config)
    validate_offload_flags(config, policies)
    if command == "sweep" and config.over == "budget_mb":
        pass  # the budgets are its --values (validate_budget_sweep)
    elif "budget-offload" in policies:
        fail("policy budget-offload is a curve of gc.py sweep --over budget_mb (elsewhere: --policy budget "
             "--offload)")
    elif config.budget_mb is not None and "budget" not in policies:
        fail("--budget-mb is the bound of --policy budget: give --policy budget with it" if command == "run" else
             "--budget-mb is the bound of policy budget: add budget to --policies")
    elif "budget" in policies and config.budget_mb is None:
        fail("policy budget needs --budget-mb (the M_peak bound, in MiB)")
    if config.segment_len is not None and set(policies) - {"off", "all"}:
        other = sorted(set(policies) - {"off", "all"})[0]
        fail(f"--segment-len sets the checkpoints of policy all; policy {other} chooses its own: give only one")


def sweep_policies(config):
    """sweep's and max-batch's policies: --policies, else off all (over budget_mb: the three Budget curves)."""
    if config.policies:
        return config.policies
    return list(BUDGET_CURVES) if config.command == "sweep" and config.over == "budget_mb" else ["off", "all"]


def validate_offload_flags(config, policies):
    """--offload and --host-bandwidth shape a Budget's plan: a policy budget must be there to read them."""
    budgets = {"budget", "budget-offload"} & set(policies)
    if config.offload and "budget" not in policies:
        fail("--offload lets Budget park values in host memory: give --policy budget with it (--policy offload "
             "offloads what all drops)")
    if config.host_bandwidth is not None and not budgets:
        fail("--host-bandwidth is the bandwidth Budget plans its copies at: give --policy budget with it" if
             config.command in ("run", "timeline") else "--host-bandwidth is the bandwidth Budget plans its "
             "copies at: add budget to --policies")


def validate_sweep(config):
    """sweep's values, and every configuration the sweep will run."""
    policies = sweep_policies(config)
    if config.over == "budget_mb":
        validate_budget_sweep(config, policies)
    elif any(not isinstance(v, int) or v < 1 for v in config.values):
        fail(f"--values must be positive integers, got {' '.join(map(str, config.values))}")
    if config.over == "segment_len" and set(policies) - {"off", "all"}:
        fail("a sweep over segment_len compares policies off and all only")
    for value in config.values:  # each configuration the sweep will run must be valid too
        trial = replace(config, **{config.over: value})
        if trial.embedding_size % trial.num_head:
            fail(f"--num-head {trial.num_head} must divide --embedding-size {trial.embedding_size} "
                 f"(the sweep's value {value})")


def validate_budget_sweep(config, policies):
    """A sweep over budget_mb: positive budgets, and only the policies a budget is a bound of, or that stand for
    one (offload, its offload-only curve; off, the reference)."""
    if not all(math.isfinite(v) and v > 0 for v in config.values):
        fail(f"--values must be positive numbers of MiB over budget_mb, got {' '.join(map(str, config.values))}")
    others = [p for p in policies if p not in BUDGET_CURVES and p != "off"]
    if others:
        fail(f"a sweep over budget_mb compares off and the Budget curves {' '.join(BUDGET_CURVES)}; policy "
             f"{others[0]} has no budget")
    if config.budget_mb is not None:
        fail("a sweep over budget_mb takes its budgets from --values: leave --budget-mb out")


def validate_parallel(config, ranks):
    """--parallel's checks, the same on every rank (each prints the line and exits 2: no rank is left waiting)."""
    if config.parallel is None:
        if ranks > 1:
            fail(f"gc.py run is under mpiexec with {ranks} ranks: give --parallel {'|'.join(PARALLEL)} "
                 f"(without it every rank would train the same model alone)")
        return
    if not (math.isfinite(config.bucket_mb) and config.bucket_mb > 0):
        fail(f"--bucket-mb must be a positive number of MiB, got {config.bucket_mb:g}")
    if config.parallel in TENSOR_PARALLEL:
        validate_tensor_parallel(config, ranks)
    _, data_ranks = parallel_layout(config.parallel, ranks)
    if config.parallel != "pipeline" and config.batch_size % data_ranks:
        fail(f"--parallel {config.parallel}: --batch-size {config.batch_size} does not split over {data_ranks} ranks: "
             f"give a multiple of {data_ranks}")
    if config.parallel == "pipeline" and config.precision in ("mixed-bf16", "mixed-fp16"):
        fail(f"--parallel pipeline with --precision {config.precision} is not supported (autocast would have to wrap "
             f"each stage's forward apart from its backward); use fp32 or bf16")
    if config.parallel == "pipeline" and config.policy == "budget":
        fail("--parallel pipeline with --policy budget is not supported: each stage would need its own budget")
    if config.parallel == "zero3" and (config.accumulation_steps > 1 or config.optimizer not in ("adam", "sgd")):
        fail(f"--parallel zero3 needs --accumulation-steps 1 (each backward reduce-scatters its gradients into the "
             f"shards) and an element-wise optimizer (adam, sgd), got {config.accumulation_steps} and "
             f"{config.optimizer}")
    if config.parallel in ("zero2", "zero3", "pipeline") and config.precision == "mixed-fp16":
        fail(f"--parallel {config.parallel} with --precision mixed-fp16 is not supported: GradScaler's overflow check "
             f"needs every gradient on every rank")


def validate_tensor_parallel(config, ranks):
    """--parallel tp, tp+sp, tp+dp: the model's heads, feed-forward width (and with tp+sp the sequence) split over
    the tensor-parallel ranks; the vocabulary, known once the data is read, is checked by run (setup.py)."""
    if config.parallel == "tp+dp" and ranks % TP_DP_TENSOR_SIZE:
        fail(f"--parallel tp+dp: tensor groups of {TP_DP_TENSOR_SIZE} ranks need an even number of ranks, got {ranks} "
             f"(mpiexec -n 4: two tensor groups of 2, data parallel across them)")
    size, _ = parallel_layout(config.parallel, ranks)
    splits = [("--num-head", config.num_head), ("--hidden-size", config.hidden_size)]
    if config.parallel == "tp+sp":
        splits.append(("--seq-len", config.seq_len))
    for name, value in splits:
        if value % size:
            fail(f"--parallel {config.parallel}: {name} {value} does not divide by the tensor-parallel size {size}")
    if config.policy == "budget":
        fail(f"--parallel {config.parallel} with --policy budget is not supported: Budget plans the one-process "
             f"graph, not a rank's slice of it")
    if config.precision == "mixed-fp16":
        fail(f"--parallel {config.parallel} with --precision mixed-fp16 is not supported: GradScaler's overflow "
             f"check needs every gradient on every rank")
