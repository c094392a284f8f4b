"""ndl.memory.explain: "why didn't my memory go down?" — a step run once under `record()`, and its peak explained.

    explanation = ndl.memory.explain(train_step, X, y)
    print(explanation)          # where the peak is, what makes it, what checkpointing can and cannot do about it
    explanation.causes          # e.g. ["optimizer-phase"]: account.CAUSES says what each code means

The same fields as `predict`'s Prediction, measured: the recorded live bytes at the peak, split by category (the
recorder's categories, folded into account.CATEGORIES), its phase and the largest values alive then. A Budget
below its floor (InfeasibleBudget) is explained at the floor: the step runs once with the Budget raised to the
least peak it can reach (`below-floor` among the causes, `floor_bytes` set), then the Budget is set back.
"""
from ...backend_selection import default_device
from .recording import record
from .account import Account, at_the_floor_if_infeasible, by_category_of, causes_of
from .predict import head_width

__all__ = ["Explanation", "explain"]

# The recorder's categories, as account.CATEGORIES names them.
FOLDED = {"parameter": "parameters", "gradient": "gradients", "optimizer_state": "optimizer_state",
          "activation_kept": "activations", "activation_recomputed": "activations", "workspace": "temporaries",
          "input": "inputs", "other": "other"}


class Explanation(Account):
    """What `explain` measured: `peak_bytes`, `phase`, `by_category`, `top(n)`, `causes`; `str()` explains it."""
    measured = True


def explain(step, *args, **kwargs):
    """Run `step(*args, **kwargs)` once under ndl.memory.record() and return its `Explanation`."""
    device = kwargs.pop("device", None) or default_device()
    return at_the_floor_if_infeasible(lambda: _explained(device, step, args, kwargs))


def _explained(device, step, args, kwargs):
    recording = record(device)
    with recording as snap:
        step(*args, **kwargs)
    peak = snap.peak
    blocks = snap.alive_at(peak["event"])
    rows = [{"op": b["op"], "module": b["module"], "shape": tuple(b["shape"]), "dtype": b["dtype"],
             "bytes": b["bytes"], "category": FOLDED.get(b["category"], "other"), "reason": _reason(b)}
            for b in blocks]
    explanation = Explanation(peak["bytes"], _phase_at(snap, peak["event"]), by_category_of(rows, peak["bytes"], {}),
                              rows)
    modules = [m for root in recording.recorder.roots.values() for _, m in root.named_modules()]
    dropped = any(b["category"] == "activation_recomputed" or "dropped" in (b["reason"] or "") for b in snap.blocks)
    explanation.causes = causes_of(explanation, any(m.checkpoint_policy is not None for m in modules), dropped,
                                   head_width(modules))
    return explanation


def _phase_at(snap, event):
    if event is None:
        return "forward"
    for phase in snap.phases:
        if phase["start"] <= event < phase["end"]:
            return phase["phase"]
    return snap.phases[-1]["phase"] if snap.phases else "forward"


def _reason(block):
    if block["reason"]:
        return block["reason"]
    return {"parameter": "a parameter", "optimizer_state": "kept by the optimizer between steps",
            "gradient": "made by backward", "workspace": "a temporary", "input": "a leaf that is not a Parameter",
            }.get(block["category"], "alive before the step, or not recognised")
