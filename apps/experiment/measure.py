"""What the OS and the driver see of a step, next to the allocator's exact byte counts
(needle.backend_ndarray.memory_stats, read in step.py): the process's peak resident memory, the GPU's used
memory, the CPU backend's thread count, and the memory the machine has at all; and what the step's peak is made
of, by category (one step recorded with ndl.memory.record)."""
import contextlib
import ctypes
import ctypes.util
import os

import needle as ndl
from needle.backend_ndarray.threads import physical_cores


def gpu_memory_bytes():
    """The GPU's used memory as the driver reports it (GPUtil), as the earlier project measured; None on CPU or
    where GPUtil (the `experiment` extra) is not installed."""
    try:
        import GPUtil
    except ImportError:
        return None
    gpus = GPUtil.getGPUs()
    return int(gpus[0].memoryUsed * 2**20) if gpus else None


def _proc_status():
    """{'VmRSS': bytes, 'VmHWM': bytes} of this process from /proc/self/status; {} where there is none."""
    try:
        with open("/proc/self/status") as f:
            return {line.split(":")[0]: int(line.split()[1]) * 1024
                    for line in f if line.startswith(("VmRSS:", "VmHWM:"))}
    except OSError:
        return {}


def _c_heap_trimmer():
    """glibc's malloc_trim, or a no-op where the C library has none (macOS, musl)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return lambda pad: 0


_trim_c_heap = _c_heap_trimmer()


class PeakRSS:
    """The resident memory a step uses at its peak beyond what it used at its start (bytes): the process's peak
    resident memory (the OS's figure) minus its resident memory at the start, where the allocator's cache of freed
    blocks — resident, but free for reuse — counts as unused at both ends (`cached_at_start`, and
    `cached_at_peak` given to growth(): memory_stats' cached_bytes and cached_bytes_at_peak). Without a cache it
    is the plain growth; with one, a step served from the cache still counts the bytes it uses, as M_peak does.

    Exact where the kernel's high-water mark can be reset (Linux: writing 5 to /proc/self/clear_refs resets
    VmHWM to VmRSS, about 50 us with the read); otherwise the largest VmRSS of the samples taken with sample(),
    a lower bound.  growth() is None where /proc/self/status does not exist (not Linux)."""

    def __init__(self, cached_at_start=0):
        # The C library keeps freed small blocks (the backend's buffers under 1 MiB, NumPy's) in its heap, where a
        # step's small buffers would reuse them unseen: giving them back first makes the step's own count, as
        # M_peak counts them (without it gc "all", whose many small buffers fit in that heap, read 5 MB low).
        _trim_c_heap(0)
        self.start = _proc_status().get("VmRSS")
        if self.start is not None:
            self.start -= cached_at_start
        self.peak, self.exact = self.start, False
        if self.start is not None:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # VmHWM := VmRSS
                self.exact = True
            except OSError:
                pass

    def sample(self):
        if self.start is not None and not self.exact:
            self.peak = max(self.peak, _proc_status().get("VmRSS", 0))

    def growth(self, cached_at_peak=0):
        if self.start is None:
            return None
        self.sample()
        peak = _proc_status().get("VmHWM", self.peak) if self.exact else self.peak
        return max(0, peak - cached_at_peak - self.start)


def threads():
    """The CPU backend's thread count, as the compiled module reports it (OMP_NUM_THREADS, which needle sets to
    the physical cores where it is unset: backend_ndarray/threads.py); the same rule without the module."""
    cpu = ndl.cpu()
    if cpu.enabled():
        return cpu.num_threads()
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(env) if env.isdigit() and int(env) > 0 else physical_cores()


def machine_memory_bytes(device):
    """(the memory a run on `device` can have at most, bytes; what that is, in words): the GPU's total memory on
    cuda (GPUtil; the host's where it is not installed), else the host's physical memory, or the cgroup's limit
    (memory.max) where that is lower, as in a container."""
    if device.name == "cuda":
        try:
            import GPUtil
            gpus = GPUtil.getGPUs()
        except ImportError:
            gpus = []
        if gpus:
            return int(gpus[0].memoryTotal * 2**20), "the GPU's memory"
    have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the machine's memory"
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
    except OSError:
        limit = "max"
    if limit.isdigit() and int(limit) < have:
        have, where = int(limit), "the container's memory limit (cgroup memory.max)"
    return have, where


@contextlib.contextmanager
def peak_split(device, on=True):
    """`with peak_split(device) as split:` around one training step records it (ndl.memory.record: every allocation
    and free, each with its category) and fills `split`, when the block ends, with what the step's peak of all live
    bytes was made of: {"peak_by_category": {category: bytes}, "peak_phase": the phase it fell in}. Recording costs
    Python time in every allocation, so gc.py records one step (the run's last) and leaves it out of T_step.
    `on=False`: nothing recorded, `split` stays empty."""
    split = {}
    if not on:
        yield split
        return
    with ndl.memory.record(device) as snapshot:
        yield split
    split.update(peak_by_category(snapshot))


def peak_by_category(snapshot):
    """{"peak_by_category": the device bytes alive at the recorded peak, by the recorder's categories (parameter,
    gradient, optimizer_state, activation_kept, activation_recomputed, workspace, input, other), "peak_phase"}.
    The values sum to the peak: bytes the allocator counted that no array held count as "other"; offloaded host
    copies are not device bytes and are not in it."""
    event = snapshot.peak["event"]
    split = dict.fromkeys((c for c in ndl.memory.CATEGORIES if c != "host"), 0)
    for block in snapshot.alive_at(event):
        if block["category"] in split:
            split[block["category"]] += block["bytes"]
    split["other"] += snapshot.data["baseline_bytes"]
    phase = None if event is None else next(
        (p["phase"] for p in snapshot.phases if p["start"] <= event < p["end"]), None)
    return {"peak_by_category": split, "peak_phase": phase}
