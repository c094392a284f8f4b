# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 5. The whole step: every lever's bytes
#
# Checkpointing shrinks one part of a training step's memory, the activations. A step also holds the parameters,
# their gradients and the optimizer's state (Adam: two numbers per parameter), and other levers work on those:
#
# | lever | what it shrinks | `gc.py run` flag |
# | --- | --- | --- |
# | mixed precision | activations computed in bfloat16 | `--precision mixed-bf16` |
# | 8-bit Adam | the optimizer's state, block-wise 8-bit codes | `--optimizer adam8bit` |
# | gradient accumulation | activations: k micro-batches of 1/k, gradients summed | `--accumulation-steps 4` |
# | offloading | the optimizer's state, kept in host memory | `--offload-state` |
# | checkpointing | activations | gc on, policy `"all"` |
#
# This lesson trains a few steps of gc.py's language model with each lever, using gc.py's own `train` (what
# `python gc.py run` runs), and puts every lever's bytes on one bar chart.

# %%
import os
import sys

ROOT = os.path.abspath(".." if os.path.isdir("../python/needle") else ".")  # notebooks/ or the repository root
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "apps")]

import matplotlib.pyplot as plt
import numpy as np

import needle as ndl
from experiment import cli
from experiment.commands.run import train
from experiment.data import load_data, resolve_data

DEVICE = "cpu" if ndl.cpu().enabled() else "cpu_numpy"

# %% tags=["parameters"]
BATCH = 32          # sequences per optimizer step (accumulation: 4 micro-batches of BATCH / 4)
SEQ = 32
WIDTH = 128
LAYERS = 2
STEPS = 2           # steps per lever (the optimizer's state exists from the first step on)
DATA = None         # a PTB folder; None: data/ptb, else ../shared/data/ptb, else a synthetic corpus
LEVERS = ["fp32 + Adam", "mixed-bf16", "8-bit Adam", "accumulation x4", "offloaded state", "checkpointing",
          "all together"]

# %%
FLAGS = {"fp32 + Adam": [], "mixed-bf16": ["--precision", "mixed-bf16"], "8-bit Adam": ["--optimizer", "adam8bit"],
         "accumulation x4": ["--batch-size", BATCH // 4, "--accumulation-steps", 4],
         "offloaded state": ["--offload-state"], "checkpointing": ["--use-gc", 1],
         "all together": ["--precision", "mixed-bf16", "--optimizer", "adam8bit", "--batch-size", BATCH // 4,
                          "--accumulation-steps", 4, "--offload-state", "--use-gc", 1]}
MODEL = ["--batch-size", BATCH, "--seq-len", SEQ, "--embedding-size", WIDTH, "--hidden-size", 2 * WIDTH,
         "--num-layers", LAYERS, "--max-batches", STEPS, "--warmup", 0, "--device", DEVICE, "--no-progress"]
source = resolve_data(DATA)
data, vocab = load_data(source)
print(f"data: {source}, {len(data)} tokens, vocabulary {vocab}")


def last_step(lever):
    """The last step's record of gc.py run with the lever's flags (a flag given twice: the later one wins)."""
    argv = ["run", *map(str, MODEL + FLAGS[lever])]
    config = cli.parse_args(argv)
    record = train(config, config.use_gc == 1, data, vocab, source, quiet=True)
    return record["steps"][-1]


steps = {lever: last_step(lever) for lever in LEVERS}
for lever, s in steps.items():
    mib = {key: s[key] / 2**20 for key in ("param_bytes", "optimizer_bytes", "offloaded_bytes",
                                           "peak_activation_bytes", "grad_bytes")}
    print(f"{lever:16s} parameters {mib['param_bytes']:6.2f} MiB, optimizer state {mib['optimizer_bytes']:6.2f} MiB"
          f" (+ {mib['offloaded_bytes']:.2f} in host memory), M_peak {mib['peak_activation_bytes']:6.2f} MiB"
          f" (gradients {mib['grad_bytes']:.2f} of it), loss {s['loss']:.3f}")

# %% [markdown]
# ## Your turn: one bar per lever
#
# Each bar is the device memory of a step at its peak, stacked: the parameters and the optimizer's state, held all
# step long, and M_peak, what forward and backward add on top (activations, and the gradients as backward makes
# them). The hatched bar is optimizer state parked in host memory instead. A lever can cost another part:
# accumulation keeps the running sum of the gradients beside each micro-batch's own, so where the activations are
# small next to the parameters (a small model, a large vocabulary) it can add more than it saves. Change `BATCH`
# (activations grow with it, nothing else does), `WIDTH` or `LAYERS` (everything grows), or `LEVERS`, and run all
# again.

# %%
parts = [("parameters", "param_bytes", "grey"), ("optimizer state", "optimizer_bytes", "tab:purple"),
         ("M_peak: activations + gradients", "peak_activation_bytes", "tab:green")]
fig, ax = plt.subplots(figsize=(9, 4))
bottom = np.zeros(len(steps))
for name, key, color in parts:
    values = np.array([s[key] for s in steps.values()]) / 2**20
    ax.bar(list(steps), values, bottom=bottom, color=color, label=name)
    bottom += values
host = np.array([s["offloaded_bytes"] for s in steps.values()]) / 2**20
ax.bar(list(steps), host, bottom=bottom, color="white", edgecolor="tab:purple", hatch="//",
       label="optimizer state in host memory (not device)")
ax.set_ylabel("MiB")
ax.set_title(f"One step of a {LAYERS}-layer LM, width {WIDTH}, batch {BATCH} x {SEQ}, vocabulary {vocab}")
ax.legend(fontsize=8)
plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
plt.show()
