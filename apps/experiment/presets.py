"""gc.py run --preset NAME: a configuration someone stated in words, as flags.  `writeup` is the experiment of the
write-up that started needle:

    "PTB, batch_size 256, seq_len 20, hidden size 32, 3 epochs with Adam, peak memory during batch training and the
    average time per batch, averaged over three runs"

Its values go where the command line gave none; what the write-up leaves unstated stays at gc.py's defaults, and
commands/writeup.py prints both. A flag given on the command line wins over the preset's value (`--epochs 1` for a
quicker look), and the header says so. "hidden size" is gc.py's --hidden-size, the feed-forward width of each
Transformer layer (the model's width, --embedding-size, the write-up does not state).
"""
import os
from dataclasses import replace

from .console import fail

WRITEUP_TEXT = ("PTB, batch_size 256, seq_len 20, hidden size 32, 3 epochs with Adam, peak memory during batch "
                "training and the average time per batch, averaged over three runs")
# dest -> value.  max_batches None: every window of the corpus is a batch of the epoch (the run sets the count).
PRESETS = {"writeup": {"batch_size": 256, "seq_len": 20, "hidden_size": 32, "optimizer": "adam", "epochs": 3,
                       "repeats": 3, "max_batches": None}}
# A preset trains gc off and on, several runs each, in one process: these flags name one pass, one file or ranks.
REFUSED = ("use_gc", "json", "save_checkpoint", "save_every", "resume", "parallel")


def given_flags(argv):
    """The dests of the flags written on a command line (--batch-size, --batch_size, --batch-size=8)."""
    return {word.split("=")[0][2:].replace("-", "_") for word in argv if word.startswith("--")}


def apply(config, argv):
    """`config` with its preset's values for every flag `argv` does not give; its --out defaults to results/NAME."""
    refused = [name for name in REFUSED if getattr(config, name) not in (None, False)]
    if refused:
        fail(f"--preset {config.preset} trains gc off and on, {PRESETS[config.preset]['repeats']} runs each, in this "
             f"process: leave out --{refused[0].replace('_', '-')}")
    if config.policy == "off":
        fail(f"--preset {config.preset} compares gc off with gc on: --policy names gc on's policy, not off")
    given = given_flags(argv)
    values = {name: value for name, value in PRESETS[config.preset].items() if name not in given}
    return replace(config, **values, out=config.out or os.path.join("results", config.preset))

