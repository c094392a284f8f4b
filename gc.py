"""gc.py — how much memory gradient checkpointing saves on a PTB Transformer language model, and what it costs.

    python gc.py                          # gc off vs on ("all"), side by side: the demo model (README: its time)
    python gc.py run --policy sqrt --batch-size 128 --hidden-size 512
    python gc.py sweep --over batch-size --values 16 32 64     # a fresh process per run; JSON as it goes, PNGs
    python gc.py max-batch --memory-limit-mb 400                 # the largest batch under a memory cap, per policy
    python gc.py ablate --rows baseline all fused combined       # each technique, the same model and steps: a table
    mpiexec -n 2 python gc.py run --parallel dp                  # data parallel (also zero1, zero2, pipeline)
    python gc.py timeline --policy all                           # one step's every allocation and free: PNG, page
    python gc.py explain --verify                                # where the step peaks, why; each lever's dry run
    python gc.py plot results/sweep_batch_size                   # the plots of whatever gc.py JSON a folder holds
    python gc.py sample --checkpoint FILE --prompt "the company said"   # text from a run's --save-checkpoint FILE

`python gc.py CMD --help` lists CMD's flags with their defaults.  The experiment itself is the package
apps/experiment/ (its __init__.py is the map: cli.py, parser.py, setup.py, step.py, ... and commands/, one file
per subcommand); this file only finds it.
"""
import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "apps")]  # needle, and the course's apps

from experiment.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
