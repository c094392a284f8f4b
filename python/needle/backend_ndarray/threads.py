"""How many threads the C++ CPU backend runs and how they wait, chosen before OpenMP starts.

OpenMP reads its settings from the environment once, when the compiled module loads, so `configure_openmp` runs
just before that import (ndarray.py) and only fills in what the user left unset:

- OMP_NUM_THREADS: the physical cores this process may run on. A second hardware thread of a core shares its
  floating-point units, so it adds little to a matmul and doubles the threads that can be preempted. Under
  mpiexec the ranks on one machine share its cores: each gets its share (2 ranks on 2 cores: 1 thread each,
  not 2 each on 2 cores, which made every rank's threads wait on the other's).
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


# The ranks a launcher started on this machine (MPICH's hydra, Open MPI), else in the whole job (PMI, PMIx): an
# over-count on several machines gives a rank fewer threads, never more than its cores.
LOCAL_RANKS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")


def local_ranks(environ=os.environ):
    """How many processes of an MPI job share this machine (1 outside one)."""
    for name in LOCAL_RANKS:
        if environ.get(name, "").strip().isdigit():
            return max(1, int(environ[name]))
    return 1


def configure_openmp(environ=os.environ, cores=None):
    """Fill in OMP_NUM_THREADS (the physical cores, shared among an MPI job's ranks on this machine) and
    OMP_WAIT_POLICY (PASSIVE) where `environ` has none. Must run before the compiled CPU module is imported: OpenMP
    reads them once, when it starts."""
    if not environ.get("OMP_NUM_THREADS", "").strip():
        cores = physical_cores() if cores is None else cores
        environ["OMP_NUM_THREADS"] = str(max(1, cores // local_ranks(environ)))
    if not environ.get("OMP_WAIT_POLICY", "").strip():
        environ["OMP_WAIT_POLICY"] = "PASSIVE"


def busy_load(load_average=None, cpus=None):
    """(the 1-minute load average, the usable CPUs) when the load is at least half the CPUs (other work is running:
    step times will be slower and noisier than on a quiet machine); None when the machine is quiet."""
    cpus = len(usable_cpus()) if cpus is None else cpus
    if load_average is None:
        if not hasattr(os, "getloadavg"):
            return None
        load_average = os.getloadavg()[0]
    return None if load_average < 0.5 * cpus else (load_average, cpus)


def busy_machine_note(load_average=None, cpus=None):
    """A line saying the machine is busy (busy_load); None when it is quiet."""
    busy = busy_load(load_average, cpus)
    if busy is None:
        return None
    return (f"note: the machine is busy (load average {busy[0]:.1f} over the last minute on {busy[1]} CPUs): "
            "step times will be slower and noisier than on a quiet machine")
