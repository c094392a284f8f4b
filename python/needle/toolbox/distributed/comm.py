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

No hang, no garbage (notices.py says how): every collective first sends the other ranks an arrival notice (its
sequence number, kind, shape, dtype, op, root) and waits for theirs, polling, until `get_timeout()` seconds
(default 300; `set_timeout(seconds)`). Ranks that called different collectives, or passed different shapes or
dtypes, raise `CollectiveMismatch` on every rank, naming each rank's call, before any data moves; a rank that does
not come within the timeout is named by `CollectiveTimeout` ("rank 0 did not arrive"), and one that has exited
(a process sends an `exit` notice as it ends) at once. send/recv time out alike. The cost: one 128-byte message
to each other rank per collective.

After such an error the job cannot go on (the ranks no longer agree on what comes next): later collectives raise at
once, and the process ends with exit status 1 through MPI_Abort, whether or not the error was caught (a normal
exit would wait in MPI_Finalize for ranks that will never come). Likewise an uncaught exception on one rank,
which would leave the others waiting: as with `python -m mpi4py`, `init()` makes it print its traceback and abort
the whole job (exit status 1), when the world has more than one process.
"""
import atexit
import collections
import math
import os
import pickle
import shutil
import sys
import time

import ml_dtypes
import numpy as np

from ...backend_selection import array_api, device_of
from .notices import (
    KIND, KINDS, NOTICE_SIZE, OP, OPS, SEQ, SIZE, TAG, CollectiveError, CollectiveMismatch, CollectiveTimeout,
    describe, disagreement, dtype_name, make_notice,
)

__all__ = [
    "CollectiveError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "DEFAULT_TIMEOUT",
    "Group",
    "Pending",
    "all_gather",
    "all_gather_buffer",
    "all_gather_object",
    "all_reduce",
    "all_reduce_buffer",
    "announce",
    "barrier",
    "broadcast",
    "broadcast_buffer",
    "broadcast_object",
    "child_environment",
    "get_timeout",
    "init",
    "is_initialized",
    "launched_by_mpiexec",
    "launcher_rank_and_size",
    "mpiexec_path",
    "new_group",
    "rank",
    "recv",
    "reduce_scatter",
    "reduce_scatter_buffer",
    "send",
    "set_timeout",
    "shadow_until_all_joined",
    "traffic",
    "world_size",
]

# Environment variables a launcher sets in each process it starts: MPICH/Intel MPI/Slurm (PMI), Open MPI, PMIx.
LAUNCHER_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")
DEFAULT_TIMEOUT = 300.0  # seconds a rank waits for the others in one collective, send or recv
NOTICE_TAG = 0
SHADOWED = ("all_reduce", "barrier")  # what a rank that has joined (out of data) takes part in, with no data

_timeout = DEFAULT_TIMEOUT


def set_timeout(seconds):
    """How long (seconds, > 0) a rank waits in a collective, send or recv before it raises CollectiveTimeout.
    Every rank should set the same."""
    global _timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (math.isfinite(seconds) and
                                                                                 seconds > 0):
        raise ValueError(f"needle.distributed.set_timeout: seconds must be a positive finite number, got {seconds!r}")
    _timeout = float(seconds)


def get_timeout():
    """The timeout of collectives, send and recv, in seconds (DEFAULT_TIMEOUT unless set_timeout changed it)."""
    return _timeout


class _World:
    """The job as this process sees it: its rank, the size, the MPI communicators (None for a job of one), and the
    bookkeeping of arrival notices: collectives entered (`seq`), those announced but not started (`queue`, in call
    order, which is the order MPI must start them in), each peer's latest notice, and the error that ended the job."""

    def __init__(self, comm=None, MPI=None, notices=None, parent=None, ranks=None):
        self.comm, self.MPI, self.notices = comm, MPI, notices  # notices travel on their own communicator
        self.rank = 0 if comm is None else comm.Get_rank()
        self.size = 1 if comm is None else comm.Get_size()
        self.peers = [r for r in range(self.size) if r != self.rank]
        self.seq = 0
        self.queue = collections.deque()
        self.last = {}
        self.outgoing = []  # (request, buffer) of notice sends not known to be complete
        self.root = self if parent is None else parent  # the whole job's world: it holds the error and the groups
        self.ranks = list(range(self.size)) if ranks is None else list(ranks)  # members' ranks in the job
        self.groups = []  # (the job's world) the groups made by new_group that this rank is in
        self.traffic = collections.Counter()  # (kind, "calls" or "elements") -> count: what this rank took part in
        self._failed = None

    @property
    def failed(self):
        """The error that ended the job (the job's, for a group too: one failure ends every group), or None."""
        return self.root._failed

    @failed.setter
    def failed(self, message):
        self.root._failed = message

    def name(self, r):
        """How errors name this world's rank r: its rank in the job ("rank 2"), not its index in a group."""
        return f"rank {self.ranks[r]}"

    def advance(self):
        """Start the announced collectives whose notices are all in, in call order (raises their errors)."""
        while self.queue and self.queue[0].arrived():
            self.queue.popleft().begin()

    def sweep(self):
        self.outgoing = [(r, b) for r, b in self.outgoing if not r.Test()]

    def fail(self, error):
        """Record that `error` ended the job (later collectives raise, exit aborts); returns it to raise."""
        if self.failed is None:
            self.failed = str(error)
        return error


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
    world = _World(MPI.COMM_WORLD, MPI)
    if world.size > 1:
        _abort_on_uncaught_exception(world)
        notices, request = world.comm.Idup()  # a collective too: a rank that never starts must not hang the others
        _wait_until(request.Test, lambda: CollectiveTimeout(
            f"needle.distributed: init on rank {world.rank} timed out after {_timeout:g} s: not every rank of the "
            f"{world.size} started needle.distributed"))
        world.notices = notices
        atexit.register(_at_exit, world)
    _world = world


def _abort(world):
    sys.stderr.flush()
    sys.stdout.flush()
    time.sleep(0.5)  # mpiexec forwards output asynchronously: an abort at once can lose the traceback's end
    world.comm.Abort(1)


def _abort_on_uncaught_exception(world):
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        _abort(world)  # the other ranks would wait in their next collective until the timeout

    sys.excepthook = hook


def _at_exit(world):
    """As the process ends: after a collective error, abort the job (MPI_Finalize would wait for ranks that will
    not come); otherwise tell the other ranks, so that one waiting for this rank in a collective raises at once."""
    if world.failed is not None:
        _abort(world)
    requests, goodbyes = [], []
    for w in [world] + world.groups:  # a peer waiting in a group's collective hears it on that group's notices
        goodbye = make_notice("exit")
        goodbye[SEQ] = w.seq
        goodbyes.append(goodbye)
        requests += [w.notices.Isend(goodbye, dest=r, tag=NOTICE_TAG) for r in w.peers]
    deadline = time.perf_counter() + 1.0  # a tiny message leaves at once; never delay the exit for it
    while not world.MPI.Request.Testall(requests) and time.perf_counter() < deadline:
        time.sleep(1e-3)


def is_initialized():
    return _world is not None


def _get(group=None):
    """The world a collective runs in: the job's (group None), or `group`'s, which this rank must belong to."""
    if _world is None:
        init()
    if group is None:
        return _world
    if not isinstance(group, Group):
        raise TypeError(f"needle.distributed: group must be a Group from new_group() or None, got {group!r}")
    if group.world is None:
        raise ValueError(f"needle.distributed: rank {_world.rank} is not in the group of ranks {group.ranks}: only "
                         f"its members call its collectives")
    return group.world


def rank(group=None):
    """This process's index in the job (or in `group`), 0 .. world_size(group) - 1."""
    return _get(group).rank


def world_size(group=None):
    """The number of processes in the job (1 without mpiexec), or in `group`."""
    return _get(group).size


class Group:
    """Some ranks of the job that communicate among themselves (`new_group`): pass it as `group=` to a collective.

    `ranks`: the members' ranks in the job, in the group's rank order; `world`: this rank's view of the group (its
    own MPI communicator and arrival notices), None on a rank that is not a member."""

    def __init__(self, ranks, world):
        self.ranks, self.world = tuple(ranks), world

    def __contains__(self, job_rank):
        return job_rank in self.ranks

    def __repr__(self):
        return f"Group(ranks={list(self.ranks)})"


def new_group(ranks):
    """A process group of the job's `ranks` (a sub-communicator of MPI_COMM_WORLD), as torch.distributed's: every
    rank of the job calls new_group for every group, in the same order, members or not (one collective of the
    whole job each). A member passes the returned Group as `group=` to collectives, DataParallel and the
    tensor-parallel layers; its rank in the group is `rank(group)` (its position in `ranks`). The group's
    collectives send their own arrival notices, so mismatches and timeouts are caught within it as in the job."""
    world = _get()
    ranks = [int(r) for r in ranks]
    if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < world.size for r in ranks):
        raise ValueError(f"new_group: ranks must be distinct ranks of the job (0..{world.size - 1}), got {ranks}")
    if world.size == 1:
        return Group(ranks, _World())
    everyone = all_gather_object(ranks, label="new_group")  # checked: every rank must name the same group
    if any(theirs != ranks for theirs in everyone):
        raise ValueError("new_group: the ranks asked for different groups (every rank must call new_group with the "
                         "same ranks, in the same order): " + "; ".join(f"rank {r}: {g}" for r, g in
                                                                        enumerate(everyone)))
    member = world.rank in ranks
    color = 0 if member else world.MPI.UNDEFINED
    sub = world.comm.Split(color, key=ranks.index(world.rank) if member else 0)
    if not member:
        return Group(ranks, None)
    notices, request = sub.Idup()
    _wait_until(request.Test, lambda: CollectiveTimeout(f"needle.distributed: new_group({ranks}) timed out"))
    group_world = _World(sub, world.MPI, notices, parent=world, ranks=ranks)
    world.groups.append(group_world)
    return Group(ranks, group_world)


# ----- waiting ----------------------------------------------------------------------------------------------------
SPIN_SECONDS = 2e-3  # how long a wait polls without sleeping: MPI progresses only inside MPI calls


def _wait_until(ready, timeout_error):
    """Poll `ready()` for SPIN_SECONDS (a transfer moves only while MPI is called, so short waits stay fast), then
    with sleeps growing to 1 ms (MPICH's own Wait would spin on a core for as long as it takes: a pipeline stage in
    its bubble would hold a core another process needs); after the timeout raise `timeout_error()`."""
    start, delay = time.perf_counter(), 1e-5
    while not ready():
        waited = time.perf_counter() - start
        if waited > _timeout:
            error = timeout_error()
            raise error if _world is None else _world.fail(error)
        if waited > SPIN_SECONDS:
            time.sleep(delay)
            delay = min(2 * delay, 1e-3)


class Pending:
    """An operation in flight: `wait()` returns its result (raising CollectiveTimeout after the timeout); `done()`
    tests it without waiting (and lets MPI progress). `what`, `peer`: for the timeout's message."""

    def __init__(self, requests=(), finish=lambda: None, what="an operation", peer=None):
        self._requests, self._finish, self._what, self._peer = list(requests), finish, what, peer
        self._result, self._done = None, False

    def _ready(self):
        return not self._requests or _world.MPI.Request.Testall(self._requests)

    def _timeout_error(self):
        return CollectiveTimeout(f"needle.distributed: {self._what} on rank {_world.rank} timed out after "
                                 f"{_timeout:g} s: rank {self._peer} did not take part")

    def done(self):
        if not self._done and self._ready():
            self._result, self._done = self._finish(), True
        return self._done

    def wait(self):
        if not self._done:
            _wait_until(self._ready, self._timeout_error)
            self._result, self._done = self._finish(), True
        return self._result

    def then(self, fn):
        """A Pending for fn(this one's result)."""
        return _Then(self, fn)


class _Then(Pending):
    def __init__(self, inner, fn):
        super().__init__(finish=lambda: fn(inner.wait()))
        self._inner = inner

    def _ready(self):
        return self._inner.done()

    def _timeout_error(self):
        return self._inner._timeout_error()


class _Collective(Pending):
    """A collective from its arrival notice to its result: announced (notice sent to every peer, theirs awaited),
    begun (every notice in and agreeing, and its data given: the MPI call started, `start(contributors, table)` ->
    (request, finish)), done. Only the oldest announced collective may begin: MPI needs the same order on every
    rank. `start` is None for one announced ahead of its data (`announce`), until `give_data` passes it."""

    def __init__(self, world, notice, label, start, tag_format=None, ahead=False):
        if world.failed is not None:
            what = label or KINDS[notice[KIND]]
            raise CollectiveError(f"needle.distributed: {what} on rank {world.rank}: an earlier collective failed "
                                  f"({world.failed}); the job cannot communicate any more")
        super().__init__()
        world.seq += 1
        notice[SEQ] = world.seq
        self.world, self.seq, self.start, self.tag_format = world, world.seq, start, tag_format
        kind = KINDS[notice[KIND]]
        world.traffic[kind, "calls"] += 1
        world.traffic[kind, "elements"] += int(notice[SIZE])
        self.name = f"{label} ({kind}, collective #{self.seq})" if label else f"{kind} (collective #{self.seq})"
        if world.root is not world:
            self.name += f" in the group of ranks {world.ranks}"
        self.table = np.empty((world.size, NOTICE_SIZE), np.int64)
        self.table[world.rank] = notice
        mine = self.table[world.rank]
        world.outgoing += [(world.notices.Isend(mine, dest=r, tag=NOTICE_TAG), mine) for r in world.peers]
        self.inbox = [world.notices.Irecv(self.table[r], source=r, tag=NOTICE_TAG) for r in world.peers]
        self.request, self.begun, self.ahead = None, False, ahead
        world.queue.append(self)

    def give_data(self, notice, start):
        """The data of a collective announced ahead: `notice` (what it turned out to be) must be what was announced."""
        announced = self.table[self.world.rank]
        if not np.array_equal(notice[KIND:], announced[KIND:]):
            raise ValueError(f"needle.distributed: {self.name} was announced as {describe(announced)} but is given "
                             f"{describe(notice)}")
        self.start, self.ahead = start, False
        return self

    def arrived(self):
        return not self.ahead and self.world.MPI.Request.Testall(self.inbox)

    def _error(self, kind, reason):
        return self.world.fail(kind(f"needle.distributed: {self.name} on rank {self.world.rank}: {reason}"))

    def begin(self):
        """Every notice is in: check them, then start the MPI call (or raise the same error on every rank)."""
        world, table = self.world, self.table
        world.sweep()
        for r in world.peers:
            if KINDS[table[r][KIND]] == "exit":
                raise self._error(CollectiveError, f"{world.name(r)} has exited ({_last_words(world, r)}) without "
                                                   f"calling this one")
            world.last[r] = table[r].copy()
        live = [r for r in range(world.size) if KINDS[table[r][KIND]] != "joined"]
        if not live:  # everyone is out of data: DataParallel.join ends; each rank's tag says when it joined
            self._finish, self.begun = (lambda: [int(t) for t in table[:, TAG]]), True
            return
        mismatch = disagreement(table, live, self.tag_format, world.ranks)
        if mismatch is not None:
            raise self._error(CollectiveMismatch, f"the ranks called different collectives or passed different "
                                                  f"arrays: {mismatch}")
        kind = KINDS[table[live[0]][KIND]]
        if len(live) < world.size and kind not in SHADOWED:
            joined = [r for r in range(world.size) if r not in live]
            raise self._error(CollectiveMismatch, f"rank {', '.join(map(str, joined))} has joined (out of data, "
                                                  f"DataParallel.join) and cannot take part in "
                                                  f"{describe(table[live[0]])}: only {' and '.join(SHADOWED)} are "
                                                  f"shadowed")
        if table[world.rank][KIND] == KINDS.index("joined"):
            self.request, self.shadow_buffer = _shadow(world, table[live[0]])
            self._finish = lambda: None
        else:
            self.request, self._finish = self.start(len(live), table)
        self.begun = True

    def _ready(self):
        self.world.advance()
        return self.begun and (self.request is None or self.request.Test())

    def _timeout_error(self):
        stuck = self.world.queue[0] if self.world.queue else self  # the oldest collective is what everyone waits on
        return stuck.timeout_error()

    def timeout_error(self):
        if self.begun:
            return self._error(CollectiveTimeout, f"timed out after {_timeout:g} s: every rank arrived, but the "
                                                  f"transfer did not complete")
        missing = [r for r, request in zip(self.world.peers, self.inbox) if not request.Test()]
        return self._error(CollectiveTimeout, f"timed out after {_timeout:g} s: " + "; ".join(
            f"{self.world.name(r)} did not arrive ({_last_words(self.world, r)})" for r in missing)
            + ". Every rank must call the same collectives in the same order (uneven data: DataParallel.join)")


def _last_words(world, peer):
    """What this rank last heard of `peer`'s collectives: "its last collective: #4, barrier"."""
    last = world.last.get(peer)
    return "it has called no collective" if last is None else f"its last collective: #{last[SEQ]}, {describe(last)}"


def _collective(world, notice, label, start, tag_format=None, announced=None):
    """Announce (unless `announced` did) and, when its turn comes, run a collective in `world` (the job's or a
    group's); a job of one runs it at once. Returns a Pending."""
    if world.size == 1:
        world.traffic[KINDS[notice[KIND]], "calls"] += 1
        world.traffic[KINDS[notice[KIND]], "elements"] += int(notice[SIZE])
        request, finish = start(1, notice[None])
        return Pending(finish=finish)
    if announced is not None:
        return announced.give_data(notice, start)
    return _Collective(world, notice, label, start, tag_format)


def announce(kind, size, dtype, op, counts=None, label=None, tag=0, tag_format=None, group=None):
    """Send the arrival notice of a 1-D buffer's all_reduce or reduce_scatter before its data exists, so that the
    other ranks' notices are in by the time it does, and the collective starts the moment its data is given (pass
    the returned ticket as `announced=` to all_reduce_buffer / reduce_scatter_buffer). DataParallel announces all
    its buckets at a backward pass's first gradient: checking the notices then costs no time at each bucket.
    Collectives start in the order they were announced. None in a job of one."""
    world = _get(group)
    if world.size == 1:
        return None
    notice = make_notice(kind, dtype, op, size=size, shape=(size,), counts=counts, tag=tag)
    return _Collective(world, notice, label, None, tag_format, ahead=True)


def _shadow(world, notice):
    """Take part, with no data, in the collective of `notice` (a rank that has joined: DataParallel.join); returns
    the MPI request and the buffer MPI works on until it completes."""
    if KINDS[notice[KIND]] == "barrier":
        return world.comm.Ibarrier(), None
    op = OPS[notice[OP]]
    dtype = _arith(np.empty(0, _numpy_dtype(dtype_name(notice)))).dtype
    identity = 0  # sum, mean: zeros (and the mean divides by the ranks that contributed)
    if op in ("max", "min"):  # the value every contribution beats
        low, high = (-np.inf, np.inf) if dtype.kind == "f" else (np.iinfo(dtype).min, np.iinfo(dtype).max)
        identity = low if op == "max" else high
    buffer = np.full(int(notice[SIZE]), identity, dtype)
    return world.comm.Iallreduce(world.MPI.IN_PLACE, buffer, _op(world, op)), buffer


def shadow_until_all_joined(group=None):
    """This rank is out of data (DataParallel.join): take part in the other ranks' collectives, contributing
    nothing (all_reduce: zeros, and a mean divides by the ranks that contributed), until every rank has joined.
    Returns the rank that joined last (the one that trained longest; the lowest such rank)."""
    world = _get(group)
    if world.size == 1:
        return 0
    joined_at = world.seq + 1
    while True:
        notice = make_notice("joined", tag=joined_at)
        result = _Collective(world, notice, "DataParallel.join", None).wait()
        if result is not None:
            return max(range(world.size), key=lambda r: (result[r], -r))


def barrier(label=None, group=None):
    """Wait until every rank (of `group`) has called barrier()."""
    world = _get(group)
    if world.size > 1:
        _collective(world, make_notice("barrier"), label, lambda n, table: (world.comm.Ibarrier(), lambda: None)).wait()


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


def _numpy_dtype(name):
    if name == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# ----- collectives ------------------------------------------------------------------------------------------------
def all_reduce(array, op="sum", async_op=False, group=None):
    """The elementwise reduction ("sum", "mean", "max", "min") of `array` over all ranks (of `group`), on every one.

    Returns a new array of `array`'s shape, dtype and device; with `async_op=True` a `Pending` whose `wait()`
    returns it (MPI_Iallreduce: the caller computes meanwhile)."""
    buffer = _host(array)
    notice = make_notice("all_reduce", str(array.dtype), op, size=buffer.size, shape=buffer.shape)
    pending = _all_reduce(_get(group), _arith(buffer), op, notice).then(lambda result: _like(result, array))
    return pending if async_op else pending.wait()


def reduce_scatter(array, op="sum", group=None):
    """This rank's chunk of the reduction of `array` over all ranks: the flattened result cut into world_size()
    equal chunks, chunk `rank()` (1-D). `array.size` must divide by world_size()."""
    world = _get(group)
    host = _host(array)
    if host.size % world.size:
        raise ValueError(f"reduce_scatter: {host.size} elements do not split evenly over {world.size} ranks")
    counts = [host.size // world.size] * world.size
    notice = make_notice("reduce_scatter", str(array.dtype), op, size=host.size, shape=host.shape, counts=counts)
    return _like(_reduce_scatter(world, _arith(host).reshape(-1), counts, op, notice).wait(), array)


def all_gather(array, group=None):
    """Every rank's `array` stacked along a new first axis, rank order: shape (world_size(), *array.shape).
    Each rank's array must have the same shape and dtype."""
    world = _get(group)
    buffer = _host(array)
    counts = [buffer.size] * world.size
    notice = make_notice("all_gather", str(array.dtype), size=buffer.size, shape=buffer.shape, counts=counts)
    out = _all_gather(world, buffer.reshape(-1), counts, notice).wait()
    return _like(out, array, (world.size,) + buffer.shape)


def broadcast(array, root=0, group=None):
    """Rank `root`'s `array` on every rank (every rank passes an array of the same shape and dtype)."""
    buffer = _host(array)
    notice = make_notice("broadcast", str(array.dtype), root=root, size=buffer.size, shape=buffer.shape)
    return _like(_broadcast(_get(group), buffer, root, notice).wait(), array)


def all_gather_object(obj, label=None, group=None):
    """Every rank's `obj` (a small picklable Python value), as a list in rank order."""
    world = _get(group)
    if world.size == 1:
        return [obj]
    mine = np.frombuffer(pickle.dumps(obj), np.uint8)

    def start(contributors, table):
        sizes = [int(s) for s in table[:, SIZE]]
        out = np.empty(sum(sizes), np.uint8)
        request = world.comm.Iallgatherv(mine, [out, sizes])
        starts = np.cumsum([0] + sizes)
        return request, lambda: [pickle.loads(out[starts[r]:starts[r + 1]].tobytes()) for r in range(world.size)]

    return _collective(world, make_notice("all_gather_object", size=mine.size), label, start).wait()


def broadcast_object(obj, root=0, label=None, group=None):
    """Rank `root`'s `obj` (a small picklable Python value) on every rank."""
    world = _get(group)
    if world.size == 1:
        return obj
    mine = np.frombuffer(pickle.dumps(obj), np.uint8) if world.rank == root else np.zeros(0, np.uint8)

    def start(contributors, table):
        buffer = mine.copy() if world.rank == root else np.empty(int(table[root][SIZE]), np.uint8)
        return world.comm.Ibcast(buffer, root=root), lambda: pickle.loads(buffer.tobytes())

    return _collective(world, make_notice("broadcast_object", root=root, size=mine.size), label, start).wait()


# ----- point to point ---------------------------------------------------------------------------------------------
def send(array, dest, tag=0):
    """Send `array` to rank `dest` without waiting for it to arrive; returns a `Pending` (wait() before exit; it
    raises CollectiveTimeout if `dest` does not receive it within the timeout).

    A small header (shape, dtype) goes first, so `recv` needs to know nothing in advance."""
    world = _get()
    _check_peer(world, dest, "send to")
    buffer = _host(array)
    header = world.comm.isend((buffer.shape, str(buffer.dtype)), dest=dest, tag=tag)
    data = world.comm.Isend(_wire(buffer), dest=dest, tag=tag)
    pending = Pending([header, data], what=f"send to rank {dest} (tag {tag})", peer=dest)
    pending.buffer = buffer  # MPI reads it until the send completes
    return pending


def recv(source, tag=0, device=None, dtype=None):
    """The array that rank `source` sends with `send(array, rank(), tag)`, as an array on `device` (default:
    the default device). Raises CollectiveTimeout if nothing comes within the timeout."""
    world = _get()
    _check_peer(world, source, "receive from")
    request, header = world.comm.irecv(source=source, tag=tag), []

    def arrived():
        done, message = request.test()
        if done:
            header.append(message)
        return done

    what = f"recv from rank {source} (tag {tag})"
    _wait_until(arrived, lambda: CollectiveTimeout(f"needle.distributed: {what} on rank {world.rank} timed out "
                                                   f"after {_timeout:g} s: rank {source} sent nothing"))
    shape, name = header[0]
    buffer = np.empty(shape, _numpy_dtype(name))
    Pending([world.comm.Irecv(_wire(buffer), source=source, tag=tag)], what=what, peer=source).wait()
    return array_api.array(buffer, dtype=dtype or name, device=device)


def _check_peer(world, peer, what):
    if not (isinstance(peer, int) and 0 <= peer < world.size and peer != world.rank):
        raise ValueError(f"needle.distributed: rank {world.rank} cannot {what} rank {peer!r} in a job of "
                         f"{world.size} (ranks 0..{world.size - 1}, not itself)")


# ----- NumPy buffers: what DataParallel, ZeRO and Pipeline move -----------------------------------------------------
def all_reduce_buffer(buffer, op="sum", async_op=False, label=None, tag=0, tag_format=None, announced=None,
                      group=None):
    """Reduce a contiguous NumPy `buffer` over all ranks in place (MPI_Iallreduce); "mean" divides by the ranks
    that contributed (the world size, less ranks that have joined) after the sum. Returns the buffer, or with
    `async_op` a Pending whose wait() returns it. `label` names the collective in errors; `tag` is an integer the
    ranks must agree on, `tag_format` ("backward pass {}") says what it is; `announced`: the ticket of `announce`."""
    notice = make_notice("all_reduce", str(buffer.dtype), op, size=buffer.size, shape=buffer.shape, tag=tag)
    pending = _all_reduce(_get(group), buffer, op, notice, label, tag_format, announced)
    return pending if async_op else pending.wait()


def _all_reduce(world, buffer, op, notice, label=None, tag_format=None, announced=None):
    mpi_op = _op(world, op)

    def start(contributors, table):
        request = None if world.size == 1 else world.comm.Iallreduce(world.MPI.IN_PLACE, buffer, mpi_op)

        def finish():
            if op == "mean" and contributors > 1:
                buffer[...] *= 1.0 / contributors
            return buffer

        return request, finish

    return _collective(world, notice, label, start, tag_format, announced)


def reduce_scatter_buffer(buffer, counts, op="sum", label=None, tag=0, tag_format=None, announced=None,
                          group=None):
    """Reduce a 1-D NumPy `buffer` over all ranks and give rank r only elements [sum(counts[:r]), sum(counts[:r+1]))
    of the result (MPI_Ireduce_scatter: counts may differ, and be 0). Returns a Pending whose wait() gives this
    rank's part, a new NumPy array of counts[rank()] elements. `label`, `tag`, `announced`: as for all_reduce_buffer."""
    notice = make_notice("reduce_scatter", str(buffer.dtype), op, size=buffer.size, shape=buffer.shape,
                         counts=counts, tag=tag)
    return _reduce_scatter(_get(group), buffer, counts, op, notice, label, tag_format, announced)


def _reduce_scatter(world, buffer, counts, op, notice, label=None, tag_format=None, announced=None):
    mpi_op = _op(world, op)
    if len(counts) != world.size or sum(counts) != buffer.size:
        raise ValueError(f"reduce_scatter: counts {list(counts)} must have one entry per rank ({world.size}) and sum "
                         f"to the buffer's {buffer.size} elements")
    out = np.empty(counts[world.rank], buffer.dtype)

    def start(contributors, table):
        request = None
        if world.size == 1:
            out[...] = buffer
        else:
            request = world.comm.Ireduce_scatter(buffer, out, list(counts), mpi_op)

        def finish():
            if op == "mean" and contributors > 1:
                out[...] *= 1.0 / contributors
            return out

        return request, finish

    return _collective(world, notice, label, start, tag_format, announced)


def broadcast_buffer(buffer, root=0, label=None, group=None):
    """Rank `root`'s contiguous NumPy `buffer` written into every rank's (same shape and dtype); returns it."""
    notice = make_notice("broadcast", str(buffer.dtype), root=root, size=buffer.size, shape=buffer.shape)
    return _broadcast(_get(group), buffer, root, notice, label).wait()


def _broadcast(world, buffer, root, notice, label=None):
    if not (isinstance(root, int) and 0 <= root < world.size):
        raise ValueError(f"broadcast: root must be a rank, 0..{world.size - 1}, got {root!r}")
    return _collective(world, notice, label, lambda n, table: (
        None if world.size == 1 else world.comm.Ibcast(_wire(buffer), root=root), lambda: buffer))


def all_gather_buffer(buffer, counts, label=None, async_op=False, group=None):
    """Every rank's 1-D NumPy `buffer` (rank r's of counts[r] elements), concatenated in rank order on every rank
    (MPI_Allgatherv); with `async_op` a Pending whose wait() returns it (ZeRO-3's prefetch)."""
    notice = make_notice("all_gather", str(buffer.dtype), size=sum(counts), counts=counts)
    pending = _all_gather(_get(group), buffer, counts, notice, label)
    return pending if async_op else pending.wait()


def _all_gather(world, buffer, counts, notice, label=None):
    if len(counts) != world.size or counts[world.rank] != buffer.size:
        raise ValueError(f"all_gather: counts {list(counts)} must have one entry per rank ({world.size}), this "
                         f"rank's ({world.rank}) equal to its {buffer.size} elements")
    out = buffer.copy() if world.size == 1 else np.empty(sum(counts), buffer.dtype)
    return _collective(world, notice, label, lambda n, table: (
        None if world.size == 1 else world.comm.Iallgatherv(_wire(buffer), [_wire(out), list(counts)]),
        lambda: out))


def traffic(group=None, reset=False):
    """What this rank's collectives (in `group`, or in the job) have moved so far: {kind: (calls, elements)},
    elements counted as each call's notice gives them (all_reduce, reduce_scatter: the buffer; all_gather: the
    gathered result). `reset=True` starts the count again (after reading it). For the benchmarks and the tests
    that count the collectives of a step."""
    world = _get(group)
    counts = {kind: (world.traffic[kind, "calls"], world.traffic[kind, "elements"])
              for kind in KINDS if world.traffic[kind, "calls"]}
    if reset:
        world.traffic.clear()
    return counts
