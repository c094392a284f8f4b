"""needle.memory: every byte of a step on a timeline.

    with ndl.memory.record() as snap:        # off by default; costs nothing when off
        loss = model.loss(x, y); loss.backward(); opt.step()
    snap.plot("step.png")                    # stacked live bytes by category, phases, the peak labelled
    snap.to_html("step.html")                # one self-contained page: zoom, hover an allocation, click an instant
    snap.save("step.json"); ndl.memory.load("step.json")
    print(ndl.memory.summary(snap))          # the peak's bytes per module x category
    ndl.memory.predict(train_step, X, y)     # the step's whole peak, by category, before it runs (a dry run)
    print(ndl.memory.explain(train_step, X, y))  # the step run once: where its peak is, and why

Each event is one buffer of the device allocator made or given back (`recorder.py` says how it is recorded and
how its category is decided; `snapshot.py` documents the JSON). The recorded live bytes equal the allocator's
`memory_stats()["current_bytes"]` after every event (`record(check=True)` stores the allocator's count beside
each event, which is how the tests check it).
"""
from .explain import Explanation, explain
from .predict import Prediction, predict
from .recorder import CATEGORIES, PHASES
from .recording import record
from .snapshot import Snapshot, load
from .summary import Summary, summary

__all__ = ["CATEGORIES", "PHASES", "Explanation", "Prediction", "Snapshot", "Summary", "explain", "load", "predict",
           "record", "summary"]

