"""The memory timeline as one self-contained HTML page: `write_html(snapshots, path)`.

The page is PyTorch memory_viz's "active memory timeline" for needle's snapshots: x is the event index (or time),
y is live bytes, and every allocation is one SVG shape stacked in allocation order, falling when a block below it
is freed, coloured by what the buffer is (parameter, gradient, kept or recomputed activation, ...). Hovering a
shape tells its op, module, shape, dtype, bytes, category, phase and why it was kept; clicking an instant lists
every block alive then.

Everything lives in the one file: the snapshots as JSON inside a `<script type="application/json">` tag, the
viewer's plain JavaScript (viewer.js, beside this file) and its skeleton and CSS (viewer.html). No network, no
server, no JavaScript library: the page opens from file:// years later exactly as it did the day it was written.

Several snapshots (gc off and gc on, say) are drawn side by side on one shared y axis:

    write_html([("gc off", off.to_dict()), ("gc on", on.to_dict())], "results/timeline.html")
"""
import html
import json
import os
import re
import stat
import tempfile
from pathlib import Path

__all__ = ["write_html", "write_text_atomically"]

SNAPSHOT_FORMAT = "needle-memory-snapshot"
# What the page reads from a snapshot; anything else in it travels along untouched.
REQUIRED_KEYS = ("baseline_bytes", "blocks", "events", "peak", "phases")
REQUIRED_BLOCK_KEYS = ("id", "bytes", "alloc", "free", "category")

VIEWER_DIR = Path(__file__).parent
# The skeleton's three holes, filled in one pass so that text put into one hole is never read as another hole.
HOLE = re.compile(r"__NEEDLE_(TITLE|SNAPSHOTS_JSON|VIEWER_JS)__")


def write_html(snapshots, path, title=None):
    """Write the memory timeline of `snapshots` to `path` as one self-contained HTML page; return the path.

    `snapshots` is one snapshot (a `Snapshot`, its `to_dict()`, or the JSON `snap.save` wrote, loaded) or a list
    of (label, snapshot) pairs, drawn side by side on one shared y axis. `title` heads the page (default:
    "needle memory timeline").
    """
    labelled = labelled_snapshots(snapshots)
    title = title or "needle memory timeline"
    page = HOLE.sub(lambda hole: {
        "TITLE": html.escape(title),
        "SNAPSHOTS_JSON": script_safe_json({"title": title, "snapshots": labelled}),
        "VIEWER_JS": viewer_js(),
    }[hole.group(1)], (VIEWER_DIR / "viewer.html").read_text(encoding="utf-8"))
    return write_text_atomically(path, page, "write_html")


def write_text_atomically(path, text, who):
    """Write `text` to `path` so that a failed write never destroys the file there: into a temporary file beside
    it, then renamed over it. A path that exists and is not a regular file is not replaced: a character device
    (/dev/null) is written through, anything else (a folder, a FIFO) refused with a ValueError naming `who`. A
    symbolic link is followed: its target is replaced, the link kept. Returns the path."""
    path = Path(path)
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_file():
        if stat.S_ISCHR(target.stat().st_mode):
            target.write_text(text, encoding="utf-8")
            return path
        raise ValueError(f"{who}: {path} exists and is not a regular file (a folder, a FIFO?): give a file path")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(temporary, target)
    except BaseException:
        os.unlink(temporary)
        raise
    return path


def labelled_snapshots(snapshots):
    """[{"label": ..., "snapshot": dict}, ...] from one snapshot dict or a list of (label, dict) pairs, checked."""
    one = isinstance(snapshots, dict) or hasattr(snapshots, "to_dict")
    pairs = [("", snapshots)] if one else list(snapshots)
    if not pairs:
        raise ValueError("write_html: no snapshots to draw (an empty list)")
    labelled = []
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2
                and (isinstance(pair[1], dict) or hasattr(pair[1], "to_dict"))):
            raise TypeError(f"write_html: snapshots[{i}] is {type(pair).__name__}, not a (label, snapshot dict) pair")
        label, snapshot = pair
        snapshot = snapshot.to_dict() if hasattr(snapshot, "to_dict") else snapshot
        check_snapshot(snapshot, f"snapshot {label!r}" if label else "the snapshot")
        labelled.append({"label": str(label), "snapshot": snapshot})
    return labelled


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _index(value, n):
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= n)


def check_snapshot(snapshot, name):
    """Raise a ValueError naming what is missing or of the wrong type, instead of a page that draws nothing (or one
    that shows markup a snapshot carried: the page escapes every value it shows, and numbers are checked here)."""
    if snapshot.get("format") != SNAPSHOT_FORMAT:
        raise ValueError(f"write_html: {name} has format {snapshot.get('format')!r}, not {SNAPSHOT_FORMAT!r} "
                         "(pass Snapshot.to_dict() or the JSON snap.save wrote)")
    missing = [key for key in REQUIRED_KEYS if key not in snapshot]
    if missing:
        raise ValueError(f"write_html: {name} lacks the keys {missing}")
    n_events, ids = len(snapshot["events"]), set()
    for block in snapshot["blocks"]:
        missing = [key for key in REQUIRED_BLOCK_KEYS if key not in block]
        if missing:
            raise ValueError(f"write_html: {name}: block {block.get('id')!r} lacks the keys {missing}")
        free = n_events if block["free"] is None else block["free"]
        alloc = 0 if block["alloc"] is None else block["alloc"]  # None: alive before recording began
        if not 0 <= alloc <= free <= n_events:
            raise ValueError(f"write_html: {name}: block {block['id']} has alloc {block['alloc']} and free "
                             f"{block['free']}, outside the {n_events} events")
        ids.add(block["id"])
    for i, event in enumerate(snapshot["events"]):
        if event.get("block") not in ids:
            raise ValueError(f"write_html: {name}: event {i} ({event.get('action')}) names block "
                             f"{event.get('block')!r}, which is not in its blocks")
    _check_numbers(snapshot, name, n_events)


def _check_numbers(snapshot, name, n_events):
    """The fields the page computes with are numbers of the right range (a string there would be drawn as text)."""
    peak, bad = snapshot["peak"], []
    if not (peak is None or (isinstance(peak, dict) and _number(peak.get("bytes"))
                             and _index(peak.get("event"), n_events - 1))):
        bad.append(f"peak {peak!r} (bytes a number, event an index of its events or null)")
    if not _number(snapshot["baseline_bytes"]):
        bad.append(f"baseline_bytes {snapshot['baseline_bytes']!r} (a number)")
    for phase in snapshot["phases"]:
        if not (isinstance(phase, dict) and isinstance(phase.get("phase"), str)
                and _index(phase.get("start"), n_events) and _index(phase.get("end"), n_events)):
            bad.append(f"phase {phase!r} (a name, and start and end indices of its events)")
            break
    for block in snapshot["blocks"]:
        if not (_number(block["bytes"]) and _index(block["alloc"], n_events) and _index(block["free"], n_events)):
            bad.append(f"block {block['id']!r} (bytes a number, alloc and free indices of its events or null)")
            break
    for i, event in enumerate(snapshot["events"]):
        if event.get("live_bytes") is not None and not _number(event["live_bytes"]):
            bad.append(f"event {i}'s live_bytes {event['live_bytes']!r} (a number)")
            break
    if bad:
        raise ValueError(f"write_html: {name}: wrong " + "; ".join(bad))


def script_safe_json(payload):
    """JSON that cannot end the <script> tag it sits in: every <, > and & is written as a \\u escape."""
    try:
        text = json.dumps(payload, allow_nan=False, separators=(",", ":"))
    except ValueError as error:  # NaN or infinity: JSON.parse in the page would reject the whole file
        raise ValueError(f"write_html: a snapshot holds a NaN or infinite number ({error})") from None
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def viewer_js():
    js = (VIEWER_DIR / "viewer.js").read_text(encoding="utf-8")
    # The script is inlined, so the text "</script" inside it would end it early.
    assert "</script" not in js.lower(), "viewer.js must not contain '</script'"
    return js
