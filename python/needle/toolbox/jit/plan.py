"""A captured step's static memory plan: every transient buffer gets an offset in one arena, ahead of time.

At capture every buffer's size and lifetime (the first and last program entry that touches it) are known, so two
buffers whose lifetimes do not overlap may share bytes. Placing them is the offset-assignment problem XLA's buffer
assignment and TFLite's arena planner solve; this is their "greedy by size" heuristic: the largest buffer first,
each at the lowest offset where it overlaps no placed buffer that is alive at the same time. The optimum is at
least the most bytes alive at any one entry (`lower_bound_bytes`); the arena is usually within a few percent.

    lifetime  0 ─────────────── n        offset
    a (big)   ██████████                 0
    b              ████████████          |a|     (alive beside a)
    c                    ██████          0       (a is dead by then: c reuses its bytes)
"""
import bisect
from dataclasses import dataclass, field

ALIGNMENT = 64  # every offset a multiple of the backend's alignment (src/cpu/common.h)


@dataclass
class PlannedBuffer:
    """One transient buffer: its bytes, its lifetime [first, last] in program entries, and its offset."""
    nbytes: int
    first: int
    last: int
    escapes: bool  # still referenced when the step returns (its outputs, the gradients): alive to the end
    offset: int = 0


@dataclass
class MemoryPlan:
    """Where each transient buffer of a captured step lives in the one arena (`arena_bytes` in all)."""
    buffers: list = field(default_factory=list)
    arena_bytes: int = 0
    lower_bound_bytes: int = 0  # the most bytes alive at one entry: no arena can be smaller
    arena: object = None  # the backend's array holding them all, made when the first replay begins

    def alive_bytes(self, entry):
        """The (aligned) bytes of the buffers alive at program entry `entry`."""
        return sum(aligned(b.nbytes) for b in self.buffers if b.first <= entry <= b.last)

    def rows(self):
        """Each buffer as a dict: offset, bytes, first and last entry, whether it escapes the step."""
        return [{"offset": b.offset, "bytes": b.nbytes, "first": b.first, "last": b.last, "escapes": b.escapes}
                for b in self.buffers]

    def draw(self, ax, title=None):
        """Draw the plan on a matplotlib Axes: each buffer a box from its first to its last entry, at its offset
        (MiB); the ones that escape the step (its outputs, the gradients) in orange, the arena's top as a line."""
        from matplotlib.patches import Rectangle  # (matplotlib: an optional dependency, for drawing only)

        for b in self.buffers:
            ax.add_patch(Rectangle((b.first, b.offset / 2**20), b.last - b.first + 1, aligned(b.nbytes) / 2**20,
                                   facecolor="tab:orange" if b.escapes else "tab:blue", alpha=0.7, linewidth=0))
        ax.axhline(self.arena_bytes / 2**20, color="black", linewidth=0.8)
        ax.set_xlim(0, max((b.last + 1 for b in self.buffers), default=1))
        ax.set_ylim(0, self.arena_bytes / 2**20 * 1.08 or 1)
        ax.set_xlabel("program entry (backend call)")
        ax.set_ylabel("offset in the arena (MiB)")
        ax.set_title(title or f"{len(self.buffers)} buffers in an arena of {self.arena_bytes / 2**20:.1f} MiB",
                     fontsize=9)

    def __repr__(self):
        return (f"MemoryPlan({len(self.buffers)} buffers in an arena of {self.arena_bytes:,} bytes; the most alive "
                f"at once: {self.lower_bound_bytes:,})")


def aligned(nbytes):
    return max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)


def place(buffers):
    """Give each PlannedBuffer an offset (greedy by size, best fit among the gaps); return the MemoryPlan."""
    placed = []  # (offset, end, first, last) of the buffers placed so far, in order of offset
    for b in sorted(buffers, key=lambda b: (-b.nbytes, b.first)):
        size, best, cursor = aligned(b.nbytes), None, 0
        for start, end, first, last in placed:  # the gaps between the buffers alive beside b: the smallest that fits
            if first <= b.last and b.first <= last:
                if start - cursor >= size and (best is None or start - cursor < best[1]):
                    best = (cursor, start - cursor)
                cursor = max(cursor, end)
        b.offset = best[0] if best is not None else cursor
        bisect.insort(placed, (b.offset, b.offset + size, b.first, b.last))
    return MemoryPlan(buffers, max((e for _, e, _, _ in placed), default=0), lower_bound(buffers))


def lower_bound(buffers):
    """The most (aligned) bytes alive at any one program entry."""
    events = sorted([(b.first, aligned(b.nbytes)) for b in buffers] + [(b.last + 1, -aligned(b.nbytes))
                                                                       for b in buffers], key=lambda e: (e[0], e[1]))
    alive = most = 0
    for _, delta in events:
        alive += delta
        most = max(most, alive)
    return most
