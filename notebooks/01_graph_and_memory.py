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
# # 1. The graph and its memory
#
# Training keeps values alive between the forward pass and backward, because backward reads them. This lesson
# builds a two-layer MLP by hand, looks at the graph it makes, asks each node what its gradient will read, and
# counts the bytes with the allocator, which in needle is exact.
#
# Run the cells from the top. The cell marked **parameters** is yours to change; the last figure redraws with it.

# %%
import os
import sys

ROOT = os.path.abspath(".." if os.path.isdir("../python/needle") else ".")  # notebooks/ or the repository root
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "apps")]  # no install needed, as in the course

import matplotlib.pyplot as plt
import numpy as np

import needle as ndl
from needle import backend_ndarray as nd
from needle import checkpoint
from needle.autograd import find_topo_sort
from needle.backward import reads

device = ndl.cpu() if ndl.cpu().enabled() else ndl.cpu_numpy()  # cpu_numpy: the NumPy reference, nothing built
print("device:", device)

# %% tags=["parameters"]
BATCH = 64      # examples per step: the activations grow with it, the weights do not
FEATURES = 784  # an MNIST image, flattened
HIDDEN = 256
CLASSES = 10

# %% [markdown]
# ## A tiny MLP by hand
#
# Two weight matrices, a batch, and the course's softmax loss written out. Every line makes a node of the graph:
# an op, its inputs, and (needle evaluates eagerly by default) its value, `cached_data`.

# %%
np.random.seed(0)
W1 = ndl.Tensor(np.random.randn(FEATURES, HIDDEN).astype("float32") / np.sqrt(HIDDEN), device=device)
W2 = ndl.Tensor(np.random.randn(HIDDEN, CLASSES).astype("float32") / np.sqrt(CLASSES), device=device)
X = ndl.Tensor(np.random.rand(BATCH, FEATURES).astype("float32"), device=device, requires_grad=False)
Y = ndl.Tensor(np.eye(CLASSES, dtype="float32")[np.random.randint(CLASSES, size=BATCH)], device=device,
               requires_grad=False)

start = nd.memory_stats(device)["current_bytes"]          # the weights and the batch are already here
Z1 = X @ W1
A1 = ndl.relu(Z1)
logits = A1 @ W2
loss = (ndl.logsumexp(logits, axes=(1,)) - (logits * Y).sum((1,))).sum() / BATCH
after_forward = nd.memory_stats(device)["current_bytes"]
print(f"loss {loss.numpy():.3f}; the forward pass left {(after_forward - start) / 1024:.1f} KiB more in memory")

# %% [markdown]
# ## What backward reads
#
# Each op says which values its gradient needs (`Op.saves`): a matmul reads both inputs, ReLU reads its output
# (where it is positive), a sum reads nothing but shapes. `backward.reads(node)` lists them. A value some gradient
# reads must stay in memory until backward has used it; the others could go as soon as the forward pass is done.

# %%
for node in find_topo_sort([loss]):
    if node.op is None:
        continue
    needed = ", ".join(f"{type(v.op).__name__ if v.op else 'leaf'}{tuple(v.shape)}" for v in reads(node)) or "nothing"
    print(f"{type(node.op).__name__:14s} -> {str(tuple(node.shape)):12s} its gradient reads: {needed}")

# %% [markdown]
# `print_saved_residuals` (JAX's name) lists every buffer the graph holds right now, and why (weights and batch left
# out). With no checkpointing every value is kept, each *not annotated* (no checkpointed region covers it): even
# those whose entry above says their gradient reads nothing, because the loss still points to them. Lessons 2 and 3
# drop what backward can do without, or can recompute.

# %%
checkpoint.print_saved_residuals(loss, exclude=[W1, W2, X, Y])

# %% [markdown]
# ## The allocator's bytes
#
# `nd.memory_stats(device)` counts every byte the arrays hold: `current_bytes` now, `peak_bytes` the most since
# `reset_peak_memory_stats`. Backward adds a gradient for every weight (W1's as large as W1) and, while it runs,
# the temporaries of each op's gradient: the red bar is its peak, the orange what stays once it is done.

# %%
nd.reset_peak_memory_stats(device)
loss.backward()
stats = nd.memory_stats(device)
moments = {"weights and batch": start, "after forward": after_forward, "peak in backward": stats["peak_bytes"],
           "after backward": stats["current_bytes"]}
fig, ax = plt.subplots(figsize=(7, 3))
ax.bar(list(moments), [b / 1024 for b in moments.values()], color=["grey", "tab:green", "tab:red", "tab:orange"])
ax.set_ylabel("KiB held by the allocator")
ax.set_title(f"A step of the MLP, batch {BATCH}")
plt.show()
print(f"gradients: W1 {W1.grad.shape}, W2 {W2.grad.shape}")

# %% [markdown]
# ## Your turn: what the graph keeps, value by value
#
# The bars are the values held for backward after the forward pass, beside the weights. Change `BATCH` (or
# `HIDDEN`) in the parameters cell and run everything again: the activations scale with the batch, the weights with
# the layer sizes.

# %%
Z1 = X @ W1
logits = ndl.relu(Z1) @ W2
loss = (ndl.logsumexp(logits, axes=(1,)) - (logits * Y).sum((1,))).sum() / BATCH
kept = [(f"{type(n.op).__name__ if n.op else 'leaf'} {tuple(n.shape)}", b)
        for n, reason, b in checkpoint.saved_residuals(loss, exclude=[W1, W2, X, Y])]
kept += [(f"weight {tuple(W.shape)}", W.realize_cached_data().nbytes) for W in (W1, W2)]
fig, ax = plt.subplots(figsize=(7, 0.4 * len(kept) + 1))
ax.barh([name for name, _ in kept], [b / 1024 for _, b in kept],
        color=["tab:green"] * (len(kept) - 2) + ["grey", "grey"])
ax.set_xlabel("KiB")
ax.set_title(f"Held for backward (green) beside the weights (grey), batch {BATCH}, hidden {HIDDEN}")
plt.show()
