"""The processes of a job and the collectives between them: MPI through mpi4py, on NumPy copies of NDArrays.

    mpiexec -n 2 python train.py            # MPICH from wheels: pip install -e ".[distributed]"

    import needle as ndl
    from needle import distributed as dist
    dist.init()                              # optional: every function below calls it first
    dist.rank(), dist.world_size()           # 0, 2 (0, 1 without mpiexec)
    total = dist.all_reduce(ndl.cpu().full((3,), 1.0))   # [2, 2, 2] on every rank

A process started without mpiexec (no PMI_SIZE / OMPI_COMM_WORLD_SIZE / PMIX_RANK in its environment) is a job of
one: `world_size()` is 1, every collective returns its input's values, and mpi4py is never imported. Under mpiexec
mpi4py is imported by `init()` (never by `import needle`) and is required.

Arrays travel as NumPy buffers: an NDArray is copied to a host NumPy array (on CUDA this stages through host
memory; MPICH's wheel is not CUDA-aware), MPI works on that buffer, and the result is a new NDArray of the input's
dtype on its device. Sums of float16/bfloat16 arrays are computed in float32 (MPI has no 16-bit float type) and
rounded once. Blocking calls poll for 2 ms and then sleep between polls rather than spin as MPICH's Wait does, so
a rank that waits long (a pipeline stage in its bubble) leaves the CPU to processes that compute.

Reduction order: MPI_Allreduce's order is MPICH's choice (for two ranks it is a + b, which is b + a in IEEE
arithmetic, so every rank gets the same bits); `reduce_scatter` gives each rank its own chunk, reduced once.

An uncaught exception on one rank would leave the others waiting in their next collective forever, so, like
`python -m mpi4py`, `init()` makes an uncaught exception print its traceback and abort the whole job (exit
status 1), when the world has more than one process.
"""
import os
import shutil
import sys
import time

import ml_dtypes
import numpy as np

from ..backend_selection import array_api, device_of

__all__ = [
    "Pending",
    "all_gather",
    "all_gather_buffer",
    "all_gather_object",
    "all_reduce",
    "all_reduce_buffer",
    "barrier",
    "broadcast",
    "broadcast_buffer",
    "broadcast_object",
    "init",
    "is_initialized",
    "child_environment",
    "launched_by_mpiexec",
    "launcher_rank_and_size",
    "mpiexec_path",
    "rank",
    "recv",
    "reduce_scatter",
    "reduce_scatter_buffer",
    "send",
    "world_size",
]

# Environment variables a launcher sets in each process it starts: MPICH/Intel MPI/Slurm (PMI), Open MPI, PMIx.
LAUNCHER_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")
OPS = ("sum", "mean", "max", "min")


class _World:
    """The job as this process sees it: its rank, the size, and the MPI communicator (None for a job of one)."""

    def __init__(self, comm=None, MPI=None):
        self.comm, self.MPI = comm, MPI
        self.rank = 0 if comm is None else comm.Get_rank()
        self.size = 1 if comm is None else comm.Get_size()


_world = None


def launched_by_mpiexec():
    """Whether a launcher (mpiexec, srun) started this process: one of LAUNCHER_VARIABLES is set."""
    return any(name in os.environ for name in LAUNCHER_VARIABLES)


def launcher_rank_and_size():
    """(rank, world size) as the launcher's environment gives them, without initializing MPI; (0, 1) outside one.
    For a process that only needs to know where it stands (gc.py ablate), not to communicate."""
    for rank_name, size_name in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                                 ("PMIX_RANK", "PMIX_SIZE")):
        if size_name in os.environ:
            return int(os.environ.get(rank_name, 0)), int(os.environ[size_name])
    return 0, 1


def mpiexec_path():
    """The `mpiexec` to start a job with: the one next to this Python (MPICH's wheel installs it into the
    environment's bin/), else the first on PATH; None if there is none."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return here
    return shutil.which("mpiexec")


def child_environment(environ=None):
    """`environ` (default: this process's) without the variables a launcher set for this process, so that a
    child started from a rank (a nested mpiexec, or a plain process) does not take itself for one of its ranks."""
    environ = dict(os.environ if environ is None else environ)
    prefixes = ("PMI_", "PMIX_", "OMPI_COMM_WORLD_", "MPI_LOCAL")
    return {k: v for k, v in environ.items() if not k.startswith(prefixes)}


def init():
    """Join the job: under mpiexec initialize MPI (mpi4py) on COMM_WORLD; otherwise a job of one. Idempotent."""
    global _world
    if _world is not None:
        return
    if not launched_by_mpiexec():
        _world = _World()
        return
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise ImportError("needle.distributed: this process was started by mpiexec, but mpi4py is not installed: "
                          'pip install -e ".[distributed]" (mpi4py and MPICH from wheels)') from err
    _world = _World(MPI.COMM_WORLD, MPI)
    if _world.size > 1:
        _abort_on_uncaught_exception(_world)


def _abort_on_uncaught_exception(world):
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        sys.stderr.flush()
        sys.stdout.flush()
        time.sleep(0.5)  # mpiexec forwards output asynchronously: an abort at once can lose the traceback's end
        world.comm.Abort(1)  # the other ranks would wait in their next collective forever

    sys.excepthook = hook


def is_initialized():
    return _world is not None


def _get():
    if _world is None:
        init()
    return _world


def rank():
    """This process's index in the job, 0 .. world_size() - 1."""
    return _get().rank


def world_size():
    """The number of processes in the job (1 without mpiexec)."""
    return _get().size


def barrier():
    """Wait until every rank has called barrier()."""
    world = _get()
    if world.size > 1:
        _wait(world.comm.Ibarrier())


# ----- waiting ----------------------------------------------------------------------------------------------------
SPIN_SECONDS = 2e-3  # how long a wait polls without sleeping: MPI progresses only inside MPI calls


def _wait(request):
    """Wait for an MPI request: poll it for SPIN_SECONDS (a transfer moves only while MPI is called, so short
    waits stay fast), then with sleeps growing to 1 ms (MPICH's own Wait would spin on a core for as long as it
    takes: a pipeline stage in its bubble would hold a core another process needs)."""
    _poll(request.Test)


def _poll(done):
    start, delay = time.perf_counter(), 1e-5
    while not done():
        if time.perf_counter() - start > SPIN_SECONDS:
            time.sleep(delay)
            delay = min(2 * delay, 1e-3)


class Pending:
    """A non-blocking collective in flight: `wait()` returns its result; `done()` tests it (and lets MPI progress)."""

    def __init__(self, request, finish):
        self._request, self._finish, self._result, self._done = request, finish, None, False

    def done(self):
        if not self._done and (self._request is None or self._request.Test()):
            self._result, self._done = self._finish(), True
        return self._done

    def wait(self):
        if not self._done:
            if self._request is not None:
                _wait(self._request)
            self._result, self._done = self._finish(), True
        return self._result

    def then(self, fn):
        """A Pending for fn(this one's result)."""
        return Pending(self._request, lambda: fn(self.wait()))


# ----- NDArray <-> NumPy buffers ------------------------------------------------------------------------------------
def _host(array):
    """A contiguous NumPy copy of `array` (an NDArray, or a NumPy array under NEEDLE_BACKEND=np)."""
    return np.ascontiguousarray(array_api.to_numpy(array))


def _like(buffer, array, shape=None):
    """A NumPy buffer as an array of `array`'s backend, dtype and device (and `shape`)."""
    buffer = buffer if shape is None else buffer.reshape(shape)
    return array_api.array(buffer, dtype=str(array.dtype), device=device_of(array))


def _wire(buffer):
    """The buffer as MPI sees it: 16-bit floats as their raw bits (uint16), to move them unchanged."""
    return buffer.view(np.uint16) if buffer.dtype.itemsize == 2 and buffer.dtype.kind not in "iu" else buffer


def _arith(buffer):
    """The buffer in a dtype MPI can add: 16-bit floats widened to float32."""
    return buffer.astype(np.float32) if buffer.dtype.itemsize == 2 and buffer.dtype.kind not in "iu" else buffer


def _op(world, op):
    """MPI's reduction for `op` ("mean" is a sum, divided afterwards); None in a job of one."""
    if op not in OPS:
        raise ValueError(f"needle.distributed: op must be one of {', '.join(OPS)}, got {op!r}")
    if world.MPI is None:
        return None
    return {"sum": world.MPI.SUM, "mean": world.MPI.SUM, "max": world.MPI.MAX, "min": world.MPI.MIN}[op]


# ----- collectives ------------------------------------------------------------------------------------------------
def all_reduce(array, op="sum", async_op=False):
    """The elementwise reduction ("sum", "mean", "max", "min") of `array` over all ranks, on every rank.

    Returns a new array of `array`'s shape, dtype and device; with `async_op=True` a `Pending` whose `wait()`
    returns it (MPI_Iallreduce: the caller computes meanwhile)."""
    pending = all_reduce_buffer(_arith(_host(array)), op, async_op=True).then(lambda buffer: _like(buffer, array))
    return pending if async_op else pending.wait()


def reduce_scatter(array, op="sum"):
    """This rank's chunk of the reduction of `array` over all ranks: the flattened result cut into world_size()
    equal chunks, chunk `rank()` (1-D). `array.size` must divide by world_size()."""
    world = _get()
    buffer = _arith(_host(array)).reshape(-1)
    if buffer.size % world.size:
        raise ValueError(f"reduce_scatter: {buffer.size} elements do not split evenly over {world.size} ranks")
    counts = [buffer.size // world.size] * world.size
    return _like(reduce_scatter_buffer(buffer, counts, op).wait(), array)


def all_gather(array):
    """Every rank's `array` stacked along a new first axis, rank order: shape (world_size(), *array.shape).
    Each rank's array must have the same shape and dtype."""
    world = _get()
    buffer = _host(array)
    out = all_gather_buffer(buffer.reshape(-1), [buffer.size] * world.size)
    return _like(out, array, (world.size,) + buffer.shape)


def broadcast(array, root=0):
    """Rank `root`'s `array` on every rank (every rank passes an array of the same shape and dtype)."""
    return _like(broadcast_buffer(_host(array), root), array)


def send(array, dest, tag=0):
    """Send `array` to rank `dest` without waiting for it to arrive; returns a `Pending` (wait() before exit).

    A small header (shape, dtype) goes first, so `recv` needs to know nothing in advance."""
    world = _get()
    _check_peer(world, dest, "send to")
    buffer = _host(array)
    world.comm.send((buffer.shape, str(buffer.dtype)), dest=dest, tag=tag)
    return Pending(world.comm.Isend(_wire(buffer), dest=dest, tag=tag), lambda: None)


def recv(source, tag=0, device=None, dtype=None):
    """The array that rank `source` sends with `send(array, rank(), tag)`, as an array on `device` (default:
    the default device)."""
    world = _get()
    _check_peer(world, source, "receive from")
    request, header = world.comm.irecv(source=source, tag=tag), []

    def arrived():
        done, message = request.test()
        if done:
            header.append(message)
        return done

    _poll(arrived)
    shape, name = header[0]
    buffer = np.empty(shape, _numpy_dtype(name))
    _wait(world.comm.Irecv(_wire(buffer), source=source, tag=tag))
    return array_api.array(buffer, dtype=dtype or name, device=device)


def all_gather_object(obj):
    """Every rank's `obj` (a small picklable Python value), as a list in rank order."""
    world = _get()
    return [obj] if world.size == 1 else world.comm.allgather(obj)


def broadcast_object(obj, root=0):
    """Rank `root`'s `obj` (a small picklable Python value) on every rank."""
    world = _get()
    return obj if world.size == 1 else world.comm.bcast(obj, root=root)


def _check_peer(world, peer, what):
    if not (isinstance(peer, int) and 0 <= peer < world.size and peer != world.rank):
        raise ValueError(f"needle.distributed: rank {world.rank} cannot {what} rank {peer!r} in a job of "
                         f"{world.size} (ranks 0..{world.size - 1}, not itself)")


def _numpy_dtype(name):
    if name == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# ----- NumPy buffers: what DataParallel, ZeRO and Pipeline move -----------------------------------------------------
def all_reduce_buffer(buffer, op="sum", async_op=False):
    """Reduce a contiguous NumPy `buffer` over all ranks in place (MPI_Iallreduce); "mean" divides by the world
    size after the sum. Returns the buffer, or with `async_op` a Pending whose wait() returns it."""
    world = _get()
    mpi_op = _op(world, op)
    request = None if world.size == 1 else world.comm.Iallreduce(world.MPI.IN_PLACE, buffer, mpi_op)

    def finish():
        if op == "mean" and world.size > 1:
            buffer[...] *= 1.0 / world.size
        return buffer

    pending = Pending(request, finish)
    return pending if async_op else pending.wait()


def reduce_scatter_buffer(buffer, counts, op="sum"):
    """Reduce a 1-D NumPy `buffer` over all ranks and give rank r only elements [sum(counts[:r]), sum(counts[:r+1]))
    of the result (MPI_Ireduce_scatter: counts may differ, and be 0). Returns a Pending whose wait() gives this
    rank's part, a new NumPy array of counts[rank()] elements."""
    world = _get()
    mpi_op = _op(world, op)
    if len(counts) != world.size or sum(counts) != buffer.size:
        raise ValueError(f"reduce_scatter: counts {list(counts)} must have one entry per rank ({world.size}) and sum "
                         f"to the buffer's {buffer.size} elements")
    out = np.empty(counts[world.rank], buffer.dtype)
    request = None
    if world.size == 1:
        out[...] = buffer
    else:
        request = world.comm.Ireduce_scatter(buffer, out, list(counts), mpi_op)

    def finish():
        if op == "mean" and world.size > 1:
            out[...] *= 1.0 / world.size
        return out

    return Pending(request, finish)


def broadcast_buffer(buffer, root=0):
    """Rank `root`'s contiguous NumPy `buffer` written into every rank's (same shape and dtype); returns it."""
    world = _get()
    if world.size > 1:
        _wait(world.comm.Ibcast(_wire(buffer), root=root))
    return buffer


def all_gather_buffer(buffer, counts):
    """Every rank's 1-D NumPy `buffer` (rank r's of counts[r] elements), concatenated in rank order on every rank
    (MPI_Allgatherv)."""
    world = _get()
    if len(counts) != world.size or counts[world.rank] != buffer.size:
        raise ValueError(f"all_gather: counts {list(counts)} must have one entry per rank ({world.size}), this "
                         f"rank's ({world.rank}) equal to its {buffer.size} elements")
    if world.size == 1:
        return buffer.copy()
    out = np.empty(sum(counts), buffer.dtype)
    _wait(world.comm.Iallgatherv(_wire(buffer), [_wire(out), list(counts)]))
    return out
