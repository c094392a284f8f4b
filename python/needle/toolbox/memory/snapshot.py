"""A recorded step as data: `Snapshot` (blocks, events, phases, the peak), its JSON file, and the per-module summary.

The JSON file (`snap.save(path)`, read back by `ndl.memory.load(path)`) is one object:

    {"format": "needle-memory-snapshot", "version": 1, "device": "cpu()",
     "baseline_bytes": 0,          # bytes the allocator counted when recording began that no NDArray held
     "blocks": [{"id", "bytes", "shape", "dtype", "category", "phase", "op", "module", "name", "reason",
                 "alloc", "free"}, ...],
                 # alloc/free: event indices (alloc null: alive when recording began; free null: alive at its end);
                 # name: a parameter's ("blocks.0.attn.q.weight"), its gradient's (".grad") or its state's (": m")
     "events": [{"action": "alloc" | "free", "block", "bytes", "category", "phase", "op", "module", "name",
                 "shape", "dtype", "reason", "live_bytes", "time", "backend_bytes", "host_bytes",
                 "reserved_bytes"}, ...],
     "peak": {"bytes", "event"},           # the most live bytes, and the first event that reached them
     "phases": [{"phase", "start", "end"}, ...],   # event index ranges [start, end)
     "backend_peak_bytes": null}           # the allocator's peak_bytes when recording ended (record(check=True))

`live_bytes` is every device byte live after the event, those of the blocks alive when recording began included;
`host_bytes` the bytes of offloaded values' host copies (category "host": outside the device allocator, so not in
`live_bytes`; a host copy's free is recorded at the next event after offload.py gives it back);
`backend_bytes` is the allocator's `current_bytes` read right after the event (record(check=True) only, else
null): the two are equal at every event, which is what the tests check. `reserved_bytes` is the allocator's
`reserved_bytes` after the event (live + what it keeps resident for reuse; null on a backend without it): the
timeline draws it as a line above the live bands, and the gap between them is the allocator's cache and
fragmentation. `category` is one of
`recorder.CATEGORIES`, `phase` one of "forward", "backward", "recompute", "optimizer"; `op` and `module` name what
made the buffer (null where no op or module did).
"""
import io
import json

from .html import write_html, write_text_atomically
from .plot import plot_snapshot
from .recorder import CATEGORIES, module_names

FORMAT, VERSION = "needle-memory-snapshot", 1
EVENT_FIELDS = ("category", "phase", "op", "module", "name", "shape", "dtype", "reason")


class Snapshot:
    """What `ndl.memory.record()` recorded: `events` (a list of dicts, see the module docstring), `blocks`, `peak`
    and `phases`; `save`, `plot`, `to_html`; in a notebook it shows itself as its plot."""

    def __init__(self, data):
        self._data = data

    @property
    def data(self):
        """The snapshot as a dict (what `save` writes)."""
        if self._data is None:
            raise RuntimeError("ndl.memory: the snapshot is still being recorded; read it after the record() block")
        return self._data

    @data.setter
    def data(self, data):
        self._data = data

    @classmethod
    def from_recorder(cls, recorder):
        names = module_names(recorder.roots.values())
        blocks = [{"id": b.id, "bytes": b.bytes, "shape": list(b.shape), "dtype": b.dtype, "category": b.category,
                   "phase": b.phase, "op": b.op, "module": module_name(b, names), "name": b.name,
                   "reason": b.reason, "alloc": b.alloc, "free": b.free} for b in recorder.blocks]
        fields = [{k: b[k] for k in EVENT_FIELDS} for b in blocks]  # what an event repeats of its block
        events = [{"action": action, "block": block.id, "bytes": block.bytes, **fields[block.id], "live_bytes": live,
                   "time": seconds, "backend_bytes": backend, "host_bytes": host, "reserved_bytes": reserved}
                  for action, block, live, seconds, backend, host, reserved in recorder.events]
        return cls({"format": FORMAT, "version": VERSION, "device": str(recorder.device),
                    "baseline_bytes": recorder.baseline_bytes, "blocks": blocks, "events": events,
                    "peak": peak_of(events, recorder.baseline_bytes + sum(b["bytes"] for b in blocks
                                                                          if b["alloc"] is None)),
                    "phases": phase_ranges(recorder.phase_changes, len(events)),
                    "backend_peak_bytes": recorder.backend_peak_bytes})

    # ----- the data --------------------------------------------------------------------------------------------
    def to_dict(self):
        """The snapshot as a dict: what `save` writes as JSON (the schema is this module's docstring)."""
        return self.data

    @property
    def events(self):
        return self.data["events"]

    @property
    def blocks(self):
        return self.data["blocks"]

    @property
    def phases(self):
        return self.data["phases"]

    @property
    def peak(self):
        """{"bytes": the most live bytes, "event": the first event index that reached them (None: at the start)}."""
        return self.data["peak"]

    def alive_at(self, event):
        """The blocks alive just after event `event` (None: when recording began), largest first."""
        alive = [b for b in self.blocks if (b["alloc"] is None or (event is not None and b["alloc"] <= event))
                 and (b["free"] is None or (event is not None and b["free"] > event) or
                      (event is None and b["alloc"] is None))]
        return sorted(alive, key=lambda b: -b["bytes"])

    def bytes_by_category(self):
        """{category: [live bytes of that category after each event]}, the baseline blocks included; for plots."""
        series = {c: [] for c in CATEGORIES}
        live = dict.fromkeys(CATEGORIES, 0)
        for b in self.blocks:
            if b["alloc"] is None:
                live[b["category"]] += b["bytes"]
        for e in self.events:
            live[e["category"]] += e["bytes"] if e["action"] == "alloc" else -e["bytes"]  # ("host": its own series)
            for c in CATEGORIES:
                series[c].append(live[c])
        return series

    # ----- files -------------------------------------------------------------------------------------------------
    def save(self, path):
        """Write the snapshot as JSON (the schema is this module's docstring), never destroying the file there if
        the write fails (html.write_text_atomically); returns the path."""
        write_text_atomically(path, json.dumps(self.data, separators=(",", ":")), "Snapshot.save")
        return path

    def plot(self, path=None, ax=None, title=None, x="event"):
        """Stacked live bytes by category over the events (`x="time"`: over seconds), phase bands, the peak
        labelled with the largest tensors alive then; saved as a PNG at `path` if given. Returns the figure."""
        return plot_snapshot(self, path=path, ax=ax, title=title, x=x)

    def to_html(self, path, title=None):
        """One self-contained HTML page to explore the snapshot in a browser (no network needed)."""
        return write_html(self, path, title=title)

    def _repr_png_(self):
        """A notebook shows a snapshot as its plot."""
        buffer = io.BytesIO()
        self.plot().savefig(buffer, format="png", dpi=100)
        return buffer.getvalue()

    def __repr__(self):
        return (f"<needle memory Snapshot: {len(self.events)} events, {len(self.blocks)} blocks, peak "
                f"{self.peak['bytes'] / 2**20:.1f} MB on {self.data['device']}>")


def module_name(block, names):
    """The module that made a block (its dotted path), or for a parameter, its gradient or state, the module that
    holds the parameter ("blocks.0.attn" for "blocks.0.attn.q.weight: m")."""
    if block.module is not None:
        return names.get(id(block.module))
    if block.name and "." in block.name.split(":")[0]:
        return block.name.split(":")[0].removesuffix(".grad").rsplit(".", 1)[0]
    return None


def load(path):
    """A Snapshot read back from `snap.save(path)`'s JSON; ValueError naming the path if it is not one."""
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"ndl.memory.load: {path} is not JSON ({err})") from err
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"ndl.memory.load: {path} is not a needle memory snapshot (no \"format\": \"{FORMAT}\")")
    if data.get("version") != VERSION:
        raise ValueError(f"ndl.memory.load: {path} has snapshot version {data.get('version')}; this needle reads "
                         f"version {VERSION}")
    return Snapshot(data)


def peak_of(events, start_bytes):
    best = {"bytes": start_bytes, "event": None}
    for i, e in enumerate(events):
        if e["live_bytes"] > best["bytes"]:
            best = {"bytes": e["live_bytes"], "event": i}
    return best


def phase_ranges(changes, n_events):
    """[(phase, first event)] -> [{"phase", "start", "end"}], empty ranges dropped, neighbours of one phase merged."""
    ranges = []
    for (phase, start), (_, end) in zip(changes, changes[1:] + [(None, n_events)]):
        if end <= start:
            continue
        if ranges and ranges[-1]["phase"] == phase and ranges[-1]["end"] == start:
            ranges[-1]["end"] = end
        else:
            ranges.append({"phase": phase, "start": start, "end": end})
    return ranges
