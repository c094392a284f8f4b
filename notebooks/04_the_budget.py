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
# # 4. The Budget: a bound that holds
#
# A policy like `"sqrt"` says *what* to drop; you find out afterwards how much memory that saved. `Budget(b)`
# turns the question around: give it a number of bytes and it chooses what to drop so that the step's peak stays
# under b, recomputing the cheapest values first (per byte saved). It plans before anything is computed, by walking
# the graph with a ledger that counts bytes exactly as the allocator would, so its prediction is the measurement.
#
# This lesson measures the bound, finds the least peak any checkpointing can reach, and watches how memory grows
# with depth.

# %%
import gc as python_gc
import os
import sys

ROOT = os.path.abspath(".." if os.path.isdir("../python/needle") else ".")  # notebooks/ or the repository root
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "apps")]

import matplotlib.pyplot as plt
import numpy as np

import needle as ndl
from needle import autograd, checkpoint
from needle import backend_ndarray as nd
from needle.checkpoint_budget import InfeasibleBudget
from experiment.growth import fitted_exponent
from models import LanguageModel

device = ndl.cpu() if ndl.cpu().enabled() else ndl.cpu_numpy()

# %% tags=["parameters"]
LAYERS = 4        # Transformer layers
BATCH = 16
SEQ = 32
WIDTH = 128
VOCAB = 2000
BUDGET_AT = 0.5   # your budget: this far from the least feasible peak (0) to gc off's peak (1)
DEPTHS = (2, 4, 8, 16, 32)  # the numbers of layers of the last figure
POLICIES = ("off", "sqrt", "layers", "Revolve(2)")  # its lines: "all", "selective" or Revolve(k) too

# %%
rs = np.random.RandomState(0)
X = ndl.Tensor(rs.randint(VOCAB, size=(SEQ, BATCH)), device=device, requires_grad=False)
Y = ndl.Tensor(rs.randint(VOCAB, size=SEQ * BATCH), device=device, requires_grad=False)


def language_model(layers):
    np.random.seed(0)
    return LanguageModel(WIDTH, VOCAB, 2 * WIDTH, num_layers=layers, seq_model="transformer", seq_len=SEQ,
                         device=device, num_head=4, dim_head=WIDTH // 4)


def m_peak(model, policy):
    """M_peak of one forward + backward with `policy` ("off", a name or a Budget): the allocator's peak above what
    was held when the step started (parameters, the batch), in bytes."""
    model.disable_gc() if policy == "off" else model.enable_gc(policy=policy)
    for p in model.parameters():
        p.grad = None
    nd.reset_peak_memory_stats(device)
    start = nd.memory_stats(device)["current_bytes"]
    with autograd.lazy_mode():
        loss, _ = model.loss(X, Y)
        loss.backward()
    return nd.memory_stats(device)["peak_bytes"] - start


def least_peak(model, say=False):
    """The least M_peak checkpointing can reach on this graph: what an impossible Budget reports."""
    budget = checkpoint.Budget(1)
    model.enable_gc(policy=budget)
    with autograd.lazy_mode():
        loss, _ = model.loss(X, Y)
        try:
            budget.plan(loss)
        except InfeasibleBudget as err:
            if say:
                print("Budget(1 byte):", err)
    return budget.minimum_peak


model = language_model(LAYERS)
off, least = m_peak(model, "off"), least_peak(model, say=True)
print(f"gc off: M_peak {off / 2**20:.2f} MiB; the least any checkpointing reaches: {least / 2**20:.2f} MiB")

# %% [markdown]
# ## A bound that holds
#
# Budgets from the least feasible peak up to gc off's, each measured. Every point sits on or under the line
# M_peak = b: the Budget keeps what it can afford and drops the rest. A budget below the least feasible peak is
# refused before anything is computed, with that least peak in the message (above).

# %%
budgets = np.linspace(least, off, 6)
measured = [m_peak(model, checkpoint.Budget(int(b))) for b in budgets]
over = [(b, m) for b, m in zip(budgets, measured) if m > int(b)]
assert not over, f"a budget did not hold: (budget, measured) {over}"
print(f"{len(budgets)} budgets from {least / 2**20:.2f} to {off / 2**20:.2f} MiB: every measured peak within its "
      "budget")
fig, ax = plt.subplots(figsize=(6, 4))
ax.plot(budgets / 2**20, budgets / 2**20, "--", color="grey", label="M_peak = b")
ax.plot(budgets / 2**20, np.array(measured) / 2**20, "o-", label="measured M_peak")
ax.axvline(least / 2**20, color="tab:red", lw=0.8, label="least feasible")
ax.set_xlabel("budget b (MiB)")
ax.set_ylabel("M_peak (MiB)")
ax.legend()
plt.show()

# %% [markdown]
# ## Your budget
#
# `BUDGET_AT` picks a budget between the least feasible peak and gc off's. The Budget predicts its peak while
# planning (`predicted_peak`), before the step runs.

# %%
bound = int(least + BUDGET_AT * (off - least))
budget = checkpoint.Budget(bound)
got = m_peak(model, budget)
print(f"budget {bound / 2**20:.2f} MiB: predicted {budget.predicted_peak / 2**20:.2f} MiB, measured "
      f"{got / 2**20:.2f} MiB")

# %% [markdown]
# ## Your turn: depth
#
# A Transformer's layers are a *stack* (docs/checkpointing.md, "Depth"): its policy decides about the layers'
# outputs too, not only about what is inside each layer. Below, M_act (the bytes held when backward starts) and
# M_peak against the number of layers, on log axes, where growth c + a·L^p is a line of slope p (fitted to the
# increments of M_act, so the constant embedding and head cancel; p is in the legend). gc off keeps every layer's
# activations; "layers" keeps every layer's output and drops its interior; "sqrt" keeps every k-th output
# (k ≈ sqrt L: Chen's O(sqrt L)); Revolve(2) keeps at most 2, recomputing more. M_peak also counts the gradients,
# which grow as L whatever the policy, and the LM head, which does not: where the peak sits moves as L grows, so it
# gets no single slope. Change `DEPTHS` or `POLICIES` and run all again.

# %%
def held_and_peak(model, policy):
    """(M_act, M_peak) of one lazy step under `policy`: bytes held when backward starts, and the peak, above what
    was held before it."""
    model.disable_gc() if policy == "off" else model.enable_gc(policy=policy)
    for p in model.parameters():
        p.grad = None
    python_gc.collect()  # the models measured before: freed now, not in the middle of this step
    nd.reset_peak_memory_stats(device)
    start = nd.memory_stats(device)["current_bytes"]
    with autograd.lazy_mode():
        loss, _ = model.loss(X, Y)
        loss.realize_cached_data()
        held = nd.memory_stats(device)["current_bytes"] - start
        loss.backward()
    return held, nd.memory_stats(device)["peak_bytes"] - start


def as_policy(name):
    return checkpoint.Revolve(int(name[8:-1])) if name.startswith("Revolve(") else name


measured = {name: [held_and_peak(language_model(layers), as_policy(name)) for layers in DEPTHS] for name in POLICIES}
fig, axes = plt.subplots(1, 2, figsize=(11, 4))
for ax, which, title in zip(axes, (0, 1), ("M_act: held when backward starts", "M_peak: the step's peak")):
    for name, values in measured.items():
        mib = [v[which] / 2**20 for v in values]
        p = fitted_exponent(DEPTHS, mib) if which == 0 else None  # (M_peak's mixes terms: where the peak is moves)
        ax.plot(DEPTHS, mib, "o-", label=name if p is None else f"{name} (p = {p:.2f})")  # None: a step not up
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(DEPTHS, [str(d) for d in DEPTHS])
    ax.set_xlabel("Transformer layers")
    ax.set_ylabel("MiB")
    ax.set_title(title)
    ax.legend(fontsize=8)
plt.show()
