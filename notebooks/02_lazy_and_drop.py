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
# # 2. Lazy evaluation and `drop`: checkpointing a chain by hand
#
# Gradient checkpointing trades compute for memory: a value backward will read is *dropped* after the forward
# pass and *recomputed* from the nearest kept values when backward needs it. In needle every graph node carries a
# `drop` flag, and lazy evaluation is what makes it cheap to honour: ops only record the graph, and realization
# computes it, releasing a dropped value as soon as its last forward consumer has run.
#
# This lesson checkpoints a chain of `tanh`s by hand, prints the backward plan, draws the graph, and ends with the
# trade-off of a chain: how many values to keep.

# %%
import os
import shutil
import subprocess
import sys

ROOT = os.path.abspath(".." if os.path.isdir("../python/needle") else ".")  # notebooks/ or the repository root
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "apps")]

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import SVG, display

import needle as ndl
from needle import autograd, checkpoint
from needle import backend_ndarray as nd
from needle.backward import plan_backward

device = ndl.cpu() if ndl.cpu().enabled() else ndl.cpu_numpy()

# %% tags=["parameters"]
LENGTH = 8        # tanh nodes in the chain
ROWS = 256        # each value is ROWS x 256 float32
KEEP_EVERY = 3    # keep every KEEP_EVERY-th node of the chain, drop the others

# %% [markdown]
# ## Lazy: a graph with no values yet
#
# Inside `autograd.lazy_mode()` an op returns a node whose `cached_data` is `None`: nothing is computed until a
# value is asked for.

# %%
np.random.seed(0)
x = ndl.Tensor(np.random.randn(ROWS, 256).astype("float32"), device=device)


def chain(x, keep_every):
    """x -> tanh -> tanh -> ... (LENGTH times) -> sum, every node but each keep_every-th marked drop."""
    nodes, h = [], x
    for i in range(LENGTH):
        h = ndl.tanh(h)
        h.drop = (i + 1) % keep_every != 0 and i < LENGTH - 1  # the last one feeds the loss: kept
        nodes.append(h)
    return nodes, h.sum()


with autograd.lazy_mode():
    nodes, loss = chain(x, KEEP_EVERY)
print("computed so far:", [n.cached_data is not None for n in nodes])
print("marked drop:    ", [n.drop for n in nodes])

# %% [markdown]
# Asking for the loss realizes the graph. A dropped value is released right after the node that reads it has run,
# so after the forward pass only the kept ones remain.

# %%
start = nd.memory_stats(device)["current_bytes"]
loss.realize_cached_data()
print("held after the forward pass:", [n.cached_data is not None for n in nodes])
print(f"bytes held: {(nd.memory_stats(device)['current_bytes'] - start) / 1024:.0f} KiB")

# %% [markdown]
# ## The backward plan
#
# Backward is planned before it runs (`backward.plan_backward`): one step per node, in reverse order, each with
# the values to recompute before it and the values to release after it. Each dropped value is recomputed at most
# once (rule 2), from the nearest kept one.

# %%
names = {id(n): f"tanh{i}" for i, n in enumerate(nodes)} | {id(loss): "sum", id(x): "x"}
plan = plan_backward(loss)
for step in plan.steps:
    line = f"gradient of {names.get(id(step.node), type(step.node.op).__name__ if step.node.op else 'leaf'):6s}"
    if step.recompute:
        line += "  recompute " + ", ".join(names.get(id(n), "?") for n in step.recompute)
    if step.release:
        line += "  then release " + ", ".join(names.get(id(n), "?") for n in step.release)
    print(line)
with autograd.lazy_mode():
    loss.backward()
print("recomputed nodes:", checkpoint.last_backward_stats()["recomputed_nodes"])

# %% [markdown]
# ## The graph, drawn
#
# `ndl.viz.to_dot(loss)` writes the graph in Graphviz's language, dropped and recomputed nodes styled apart, with
# a legend. With Graphviz installed (`apt install graphviz`) the next cell draws it; without, it prints the text.

# %%
with autograd.lazy_mode():
    nodes, loss = chain(x, KEEP_EVERY)
    loss.backward()
dot = ndl.viz.to_dot(loss)
if shutil.which("dot"):
    display(SVG(subprocess.run(["dot", "-Tsvg"], input=dot, capture_output=True, text=True).stdout))
else:
    print(dot[:1500], "..." if len(dot) > 1500 else "")

# %% [markdown]
# ## Your turn: how many to keep?
#
# Keep every k-th node: fewer kept values hold less memory at the start of backward, and cost more recomputation.
# Chen's √n rule sits near the middle. Change `LENGTH`, `ROWS` or `KEEP_EVERY` above and run all again.

# %%
held, recomputed = [], []
choices = list(range(1, LENGTH + 1))
for k in choices:
    with autograd.lazy_mode():
        _, loss = chain(x, k)
        start = nd.memory_stats(device)["current_bytes"]
        loss.realize_cached_data()
        held.append((nd.memory_stats(device)["current_bytes"] - start) / 1024)
        loss.backward()
    recomputed.append(checkpoint.last_backward_stats()["recomputed_nodes"])
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(choices, held, "o-", color="tab:green", label="held at backward's start (KiB)")
ax.set_xlabel("keep every k-th node")
ax.set_ylabel("KiB")
twin = ax.twinx()
twin.plot(choices, recomputed, "s--", color="tab:orange", label="recomputed nodes")
twin.set_ylabel("recomputed nodes")
ax.axvline(KEEP_EVERY, color="grey", lw=0.8)
ax.set_title(f"A chain of {LENGTH} tanh, {ROWS} x 256 each; your KEEP_EVERY = {KEEP_EVERY}")
fig.legend(loc="upper center", bbox_to_anchor=(0.5, 0.88))
plt.show()
