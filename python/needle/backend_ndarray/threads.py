"""How many threads the C++ CPU backend runs and how they wait, chosen before OpenMP starts.

OpenMP reads its settings from the environment once, when the compiled module loads, so `configure_openmp` runs
just before that import (ndarray.py) and only fills in what the user left unset:

- OMP_NUM_THREADS: the physical cores this process may run on. A second hardware thread of a core shares its
  floating-point units, so it adds little to a matmul and doubles the threads that can be preempted.
- OMP_WAIT_POLICY=PASSIVE: a thread that reaches the end of a parallel loop first sleeps instead of spinning.
  libgomp's default spins, which on a shared machine burns the core the late thread needs: with one other busy
  process on 2 cores, the demo took 66 s spinning and 32 s passive (`OMP_WAIT_POLICY= python gc.py` against
  `OMP_WAIT_POLICY=PASSIVE python gc.py`, one run each, at 60c559b on
  this 2-core machine, 2026-11-24).

`busy_machine_note` is the line gc.py prints in its header when other work shares the machine, since step times
are then neither fast nor repeatable.
"""
import os

SYSFS_CPU = "/sys/devices/system/cpu"


def usable_cpus():
    """The logical CPUs this process may run on (its affinity mask, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def physical_cores(cpus=None, sysfs=SYSFS_CPU):
    """How many physical cores the logical CPUs `cpus` (default: this process's) belong to: hyperthreads of one
    core (the same package and core id in sysfs) count once. Without sysfs topology, every logical CPU counts."""
    cpus = usable_cpus() if cpus is None else cpus
    cores = set()
    for cpu in cpus:
        topology = os.path.join(sysfs, f"cpu{cpu}", "topology")
        try:
            with open(os.path.join(topology, "physical_package_id")) as f:
                package = f.read().strip()
            with open(os.path.join(topology, "core_id")) as f:
                core = f.read().strip()
        except OSError:
            return len(cpus)
        cores.add((package, core))
    return max(1, len(cores))


def configure_openmp(environ=os.environ):
    """Fill in OMP_NUM_THREADS (the physical cores) and OMP_WAIT_POLICY (PASSIVE) where `environ` has none.
    Must run before the compiled CPU module is imported: OpenMP reads them once, when it starts."""
    if not environ.get("OMP_NUM_THREADS", "").strip():
        environ["OMP_NUM_THREADS"] = str(physical_cores())
    if not environ.get("OMP_WAIT_POLICY", "").strip():
        environ["OMP_WAIT_POLICY"] = "PASSIVE"


def busy_machine_note(load_average=None, cpus=None):
    """A line saying the machine is busy when the 1-minute load average is at least half its usable CPUs (other
    work is running: step times will be slower and noisier than on a quiet machine); None when it is quiet."""
    cpus = len(usable_cpus()) if cpus is None else cpus
    if load_average is None:
        if not hasattr(os, "getloadavg"):
            return None
        load_average = os.getloadavg()[0]
    if load_average < 0.5 * cpus:
        return None
    return (f"note: the machine is busy (load average {load_average:.1f} over the last minute on {cpus} CPUs): "
            "step times will be slower and noisier than on a quiet machine")
