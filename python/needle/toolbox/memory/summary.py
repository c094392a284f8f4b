"""`ndl.memory.summary(snap)`: the bytes alive at a snapshot's peak, per module and category — which layer holds
what, when it matters (an allocator's own summary can say how much, not whose)."""
from .recorder import CATEGORIES


class Summary:
    """`rows`: (module, category, bytes, blocks) at the peak, largest first; `str()` is a table, modules down,
    categories across, in MiB (KiB for a peak under 1 MiB): binary units, named as such."""

    def __init__(self, snapshot):
        self.peak = snapshot.peak
        totals = {}
        for block in snapshot.alive_at(self.peak["event"]):
            key = (block["module"] or "(no module)", block["category"])
            nbytes, count = totals.get(key, (0, 0))
            totals[key] = (nbytes + block["bytes"], count + 1)
        self.rows = sorted(((m, c, b, n) for (m, c), (b, n) in totals.items()), key=lambda r: -r[2])
        self.baseline_bytes = snapshot.data["baseline_bytes"]

    def __str__(self):
        modules = sorted({r[0] for r in self.rows}, key=lambda m: -sum(r[2] for r in self.rows if r[0] == m))
        used = [c for c in CATEGORIES if any(r[1] == c for r in self.rows)]
        cell = {(r[0], r[1]): r[2] for r in self.rows}
        width = max([len("module")] + [len(m) for m in modules])
        unit, scale = ("MiB", 2**20) if self.peak["bytes"] >= 2**20 else ("KiB", 2**10)
        lines = [f"peak: {self.peak['bytes'] / scale:.2f} {unit} at event {self.peak['event']}"
                 + (f" ({self.baseline_bytes / scale:.2f} {unit} of it held by no NDArray)"
                    if self.baseline_bytes else ""),
                 "module".ljust(width) + "".join(f"{c:>22}" for c in used) + f"{'total':>12}"]
        for m in modules:
            values = [cell.get((m, c), 0) for c in used]
            lines.append(m.ljust(width) + "".join(f"{v / scale:>18.2f} {unit}" if v else f"{'':>22}" for v in values)
                         + f"{sum(values) / scale:>8.2f} {unit}")
        return "\n".join(lines)

    __repr__ = __str__


def summary(snapshot):
    """The bytes alive at `snapshot`'s peak per module x category (a `Summary`: print it, or read `.rows`)."""
    return Summary(snapshot)
