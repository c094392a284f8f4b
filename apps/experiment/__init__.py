"""The experiment `python gc.py` runs: how much memory gradient checkpointing saves on a PTB Transformer language
model, and what it costs.  gc.py (at the repository's top) only puts python/ and apps/ on sys.path and calls
`experiment.cli.main()`.

How to read it: a command line becomes one frozen RunConfig, and a subcommand's function runs it.

    cli.py          argv -> a validated RunConfig -> the subcommand's function (the table COMMANDS)
    parser.py       every flag, its default and its help: what `python gc.py CMD --help` prints
    setup.py        RunConfig, and what a run builds from it: the device, the model, the policy, the optimizer,
                    the loss; Budget's plan checked before any work
    data.py         the corpus (PTB, or a synthetic stand-in) and a step's micro-batches
    step.py         one optimizer step, measured (train_step; pipeline_step for --parallel pipeline)
    measure.py      what the OS and the driver see: peak RSS, GPU memory, the thread count
    records.py      the JSON a run writes (its configuration, its steps, their summary), strict and atomic
    runsets.py      which runs are repeats of one configuration (all but the seed equal), and their names in a plot
    report.py       the text a run prints: its header, the gc off / on table, the ablation's table
    ablations.py    ablate's rows: name -> (what it is, the `gc.py run` flags it trains with)
    children.py     sweep, max-batch and ablate run each configuration as a child `gc.py run` process
    console.py      one-line errors (exit status 2), progress bars, lines printed above them
    outputs.py      where a command writes (--json, --out, --save-checkpoint), checked before any work
    footprint.py    the model's parameters, gradients and optimizer state counted from the flags: refused before
                    it is built when they cannot fit
    resume.py       run --save-checkpoint / --resume: the training state saved, and continued bit for bit
    commands/       one file per subcommand: run.py, sweep.py (sweep and max-batch), ablate.py, timeline.py,
                    plot.py (the only importer of matplotlib), sample.py (text from a saved model)
"""
import os

# The repository: gc.py, data/ptb and the git checkout whose commit each JSON records.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENTRY_POINT = os.path.join(ROOT, "gc.py")  # what a child process runs
