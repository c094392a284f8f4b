"""What predict and explain return: a step's peak, where it is, what makes it, and why (`causes`), in plain words.

`Prediction` (predict.py, from a dry run) and `Explanation` (explain.py, from a recorded run) share this class's
fields: `peak_bytes`, `phase` ("forward", "backward", "recompute", "optimizer"), `by_category` (every byte of the
peak in one of CATEGORIES: its values sum to `peak_bytes`), `top(n)` (the largest values alive at the peak, as
dicts with `op`, `module`, `shape`, `dtype`, `bytes`, `category`, `reason`) and `causes` (codes from CAUSES).
"""
import contextlib

from ...checkpoint_budget import InfeasibleBudget

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "inputs", "other")

CAUSES = {
    "no-interior": "checkpointing is on, but no region has an interior to drop: every value it would free is a "
                   "region's output or input, which are kept (give each layer more than one op, or checkpoint "
                   "larger modules)",
    "optimizer-phase": "the peak is in the optimizer phase, made of gradients and the optimizer's state: the "
                       "optimizer in backward or 8-bit state (Adam8bit, Adafactor) lower it, checkpointing does not",
    "logits": "the largest value is the LM head's logits (tokens x vocabulary): the fused head "
              "(model.loss, ops.linear_cross_entropy) never holds them whole; checkpointing cannot drop them",
    "attention-matrix": "the largest value is an attention matrix (T x T per head): a fused attention kernel "
                        "never holds it; checkpointing drops it only inside a region",
    "below-floor": "the Budget is below the least peak any plan reaches (its floor): no choice of what to drop "
                   "meets it; raise the budget to the floor, or lower the floor with another lever",
}


class Account:
    """A step's peak and what makes it (see the module docstring)."""
    measured = True  # Explanation: read from the allocator; Prediction: from a dry run

    def __init__(self, peak_bytes, phase, by_category, values, causes=(), floor_bytes=None):
        self.peak_bytes, self.phase, self.by_category = int(peak_bytes), phase, dict(by_category)
        self.values = sorted(values, key=lambda v: -v["bytes"])
        self.causes = list(causes)
        self.floor_bytes = floor_bytes  # below-floor: the least peak the Budget can reach

    def top(self, n=5):
        """The `n` largest values alive at the peak, largest first (dicts: op, module, shape, dtype, bytes,
        category, reason)."""
        return [dict(v) for v in self.values[:n]]

    def __repr__(self):
        return (f"<{type(self).__name__}: peak {self.peak_bytes / 2**20:.1f} MB in {self.phase}, causes "
                f"{self.causes}>")

    def __str__(self):
        verb = "is" if self.measured else "will be"
        lines = [f"The step's peak {verb} {self.peak_bytes / 2**20:.1f} MB, in the {self.phase} phase."]
        total = max(self.peak_bytes, 1)
        shares = sorted(((b, c) for c, b in self.by_category.items() if b >= 0.005 * total), reverse=True)
        lines.append("It is made of " + ", ".join(f"{c.replace('_', ' ')} {100 * b / total:.0f}%"
                                                  for b, c in shares) + ".")
        activations = self.by_category.get("activations", 0)
        lines.append(f"Activations are {100 * activations / total:.0f}% of this peak: checkpointing can lower at "
                     f"most that share; the rest is {'; '.join(_rest(self.by_category, total))}.")
        if self.values:
            v = self.values[0]
            where = f" in {v['module']}" if v["module"] else ""
            lines.append(f"The largest value alive then is {v['op'] or 'a value'}{where}, shape {tuple(v['shape'])} "
                         f"{v['dtype']}, {v['bytes'] / 2**20:.1f} MB ({v['category']}: {v['reason']}).")
        if self.floor_bytes is not None:
            lines.append(f"The Budget's floor is {self.floor_bytes / 2**20:.1f} MB.")
        for code in self.causes:
            lines.append(f"[{code}] {CAUSES[code]}.")
        return "\n".join(lines)


def _rest(by_category, total):
    rest = [(b, c) for c, b in by_category.items() if b >= 0.005 * total and c != "activations"]
    return [f"{c.replace('_', ' ')} {b / 2**20:.1f} MB" for b, c in sorted(rest, reverse=True)] or ["nothing"]


def value_row(node, nbytes, category, reason, module_of, module_names=None):
    """A value alive at the peak as top(n)'s dict; `node` the graph value behind it (None: no value)."""
    module = module_of.get(id(node)) if node is not None else None
    name = (module_names or {}).get(id(module)) if module is not None else None
    return {"op": type(node.op).__name__ if node is not None and node.op is not None else None,
            "module": name if name is not None else (type(module).__name__ if module is not None else None),
            "shape": tuple(node.shape) if node is not None else (), "dtype": str(node.dtype) if node else None,
            "bytes": int(nbytes), "category": category, "reason": reason}


def by_category_of(rows, total, existing):
    """{category: bytes} at the peak: the values alive (rows), what existed before the step (existing), and the
    rest of `total` as `other`, so that the values sum to `total` exactly."""
    out = dict.fromkeys(CATEGORIES, 0)
    for category, nbytes in existing.items():
        out[category] += nbytes
    for row in rows:
        out[row["category"]] += row["bytes"]
    out["other"] += total - sum(out.values())
    return out


def causes_of(account, gc_on, dropped_any, head_width, floor=False):
    """The cause codes an account shows: `gc_on` checkpointing was enabled, `dropped_any` some value was dropped,
    `head_width` the widest Linear output that widens (the LM head's vocabulary; None if none)."""
    causes = []
    if gc_on and not dropped_any:
        causes.append("no-interior")
    if account.phase == "optimizer":
        causes.append("optimizer-phase")
    activations = [v for v in account.values if v["category"] in ("activations", "gradients")]
    largest = activations[0] if activations else None
    if largest is not None and head_width and len(largest["shape"]) == 2 and largest["shape"][-1] == head_width:
        causes.append("logits")
    if largest is not None and len(largest["shape"]) >= 3 and largest["shape"][-1] == largest["shape"][-2]:
        causes.append("attention-matrix")
    if floor:
        causes.append("below-floor")
    return causes


def at_the_floor_if_infeasible(account_of):
    """account_of(); where a Budget is below its floor (InfeasibleBudget), account_of() again with the Budget raised
    to its floor, the account's `floor_bytes` set and `below-floor` among its causes."""
    try:
        return account_of()
    except InfeasibleBudget as err:
        if err.budget is None:
            raise
        with at_floor(err.budget) as floor:
            account = account_of()
        account.floor_bytes = floor
        account.causes.append("below-floor")
        return account


@contextlib.contextmanager
def at_floor(budget):
    """The Budget raised to its floor (the least peak it can reach) inside the block; yields the floor. Afterwards
    the Budget is as it was: its bound, and no plan made at the floor (its next step raises again)."""
    bound, planned = budget.bytes, dict(budget.planned)
    budget.bytes = budget.minimum_peak
    try:
        yield budget.minimum_peak
    finally:
        budget.bytes = bound
        budget.planned.clear()
        budget.planned.update(planned)
