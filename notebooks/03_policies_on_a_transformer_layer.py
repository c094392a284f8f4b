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
# # 3. Policies on a Transformer layer
#
# Marking nodes by hand does not scale to a model. Instead each layer *annotates* its own forward pass as a region,
# and a **policy** decides, for the region's candidate nodes, which to keep: `"all"` drops everything inside,
# `"sqrt"` keeps Chen's √n checkpoints, `"selective"` keeps the matmul outputs (expensive to recompute) and drops
# the cheap element-wise ones. `model.enable_gc(policy=...)` hands every module the policy.
#
# This lesson looks at what one Transformer layer keeps under each policy and why, watches a step's memory on a
# timeline, and draws the trade-off: memory against recomputation.

# %%
import os
import sys

ROOT = os.path.abspath(".." if os.path.isdir("../python/needle") else ".")  # notebooks/ or the repository root
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "apps")]

import matplotlib.pyplot as plt
import numpy as np

import needle as ndl
from needle import autograd, checkpoint, nn
from needle import backend_ndarray as nd

device = ndl.cpu() if ndl.cpu().enabled() else ndl.cpu_numpy()

# %% tags=["parameters"]
POLICY = "sqrt"   # "off", "all", "sqrt" or "selective"
BATCH = 8
SEQ = 64
WIDTH = 128       # the layer's width; its MLP is 4 x WIDTH wide
HEADS = 4

# %%
np.random.seed(0)
layer = nn.TransformerLayer(WIDTH, HEADS, WIDTH // HEADS, 4 * WIDTH, device=device)
x = ndl.Tensor(np.random.randn(BATCH, SEQ, WIDTH).astype("float32"), device=device)
params = layer.parameters()


def forward(policy, segment_len=None):
    """The layer's loss with checkpointing by `policy` (off: none), in lazy mode, realized: the forward pass done."""
    if policy == "off":
        layer.disable_gc()
    else:  # segment_len: "all", keeping every segment_len-th node of each region
        layer.enable_gc(segment_len=segment_len, policy=None if segment_len else policy)
    with autograd.lazy_mode():
        y = layer(x)
        loss = (y * y).sum()
        loss.realize_cached_data()
    return loss


# %% [markdown]
# ## What is kept, and why
#
# After the forward pass, `print_saved_residuals` lists every buffer the graph still holds, with its reason:
# a *leaf* (a constant such as a mask), a region's *boundary* (its input or output, never dropped: rule 1), a
# value the policy chose to keep (*checkpoint*), or a value in no region at all. With `"off"` everything a gradient
# reads stays.

# %%
for policy in ("off", POLICY):
    print(f"--- policy {policy}")
    checkpoint.print_saved_residuals(forward(policy), exclude=params + [x])

# %% [markdown]
# ## The timeline
#
# `ndl.memory.record()` logs every allocation and free of a step, each named by what it is. The stacked bands are
# bytes alive over the step: gradients orange, activations kept for backward green, recomputed yellow, temporaries
# grey. Without checkpointing the forward pass climbs and backward climbs down; with it, backward rebuilds each
# region just before it needs it.

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
for ax, policy in zip(axes, ("off", POLICY)):
    with ndl.memory.record(device) as snap:
        loss = forward(policy)
        with autograd.lazy_mode():
            loss.backward()
    snap.plot(ax=ax, title=f"policy {policy}")
plt.show()

# %% [markdown]
# ## Your turn: the trade-off
#
# Each point is a policy: the peak of the step above what was there before (M_peak, what `Budget` bounds, next
# lesson) against the bytes backward recomputed. `"all"` with `segment_len=k` keeps every k-th node, a curve of
# its own. Change `SEQ`, `WIDTH` or `POLICY` and run all again.

# %%
def measure(policy, segment_len=None):
    """(M_peak, bytes recomputed) of one step's forward and backward, in MiB."""
    for p in params:
        p.grad = None
    nd.reset_peak_memory_stats(device)
    start = nd.memory_stats(device)["current_bytes"]
    loss = forward(policy, segment_len)
    with autograd.lazy_mode():
        loss.backward()
    recomputed = checkpoint.last_backward_stats()["recomputed_bytes"]
    return (nd.memory_stats(device)["peak_bytes"] - start) / 2**20, recomputed / 2**20


points = {policy: measure(policy) for policy in ("off", "selective", "sqrt", "all")}
curve = [measure("all", k) for k in (2, 3, 4, 6, 8)]
fig, ax = plt.subplots(figsize=(7, 4))
ax.plot([c[1] for c in curve], [c[0] for c in curve], ":", color="grey", label='"all", segment_len 2..8')
for policy, (peak, recomputed) in points.items():
    ax.plot(recomputed, peak, "o", ms=12 if policy == POLICY else 7, label=policy)
ax.set_xlabel("recomputed in backward (MiB)")
ax.set_ylabel("M_peak (MiB)")
ax.set_ylim(bottom=0)
ax.set_title(f"One TransformerLayer, batch {BATCH} x {SEQ} x {WIDTH}; your POLICY = {POLICY}")
ax.legend()
plt.show()
