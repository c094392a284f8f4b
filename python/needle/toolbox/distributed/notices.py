"""Arrival notices: what a rank tells every other rank as it enters a collective, and what is concluded from them.

MPI matches collectives by order alone: if rank 0 calls all_reduce of 3 floats while rank 1 calls all_reduce of 5,
or barrier, MPI may return garbage, hang, or crash, and a rank that never comes leaves the others waiting forever.
So before its data moves, each collective sends every other rank a notice, 16 int64s (one tiny message):

    seq    this rank's count of collectives so far (1 for its first)
    kind   barrier, all_reduce, ... (KINDS), or `exit` (the process is ending) or `joined` (out of data: it
           shadows the others' collectives, DataParallel.join)
    dtype, op, root, size, counts, tag, ndim, shape[7]
           what the collective was given: the array's dtype (DTYPES), the reduction, the broadcast's root, the
           element count, a checksum of reduce-scatter/all-gather counts, the caller's tag (DataParallel: backward
           passes since the forward), the shape

and waits for everyone's. With all notices in, every rank holds the same table, so every rank reaches the same
verdict: run the collective, or raise the same CollectiveMismatch naming each rank's call. A notice that does
not come names the rank that did not arrive (CollectiveTimeout).
"""
import zlib

import numpy as np

__all__ = [
    "CollectiveError", "CollectiveMismatch", "CollectiveTimeout", "DTYPES", "KINDS", "NOTICE_SIZE", "counts_checksum",
    "describe", "disagreement", "dtype_name", "make_notice",
]

KINDS = ("barrier", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_gather_object",
         "broadcast_object", "exit", "joined")
DTYPES = ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
          "uint64", "bool")
OPS = ("sum", "mean", "max", "min")
SEQ, KIND, DTYPE, OP, ROOT, SIZE, COUNTS, TAG, NDIM, SHAPE = range(10)
MAX_DIMS = 7
NOTICE_SIZE = SHAPE + MAX_DIMS
# kinds whose ranks pass different amounts by design: all_gather's buffers (rank r its counts[r]), pickled objects
VARIABLE_SIZE = (KINDS.index("all_gather_object"), KINDS.index("broadcast_object"))
UNSET = -1


class CollectiveError(RuntimeError):
    """A collective that cannot complete: the job cannot go on (it ends with exit status 1, see comm)."""


class CollectiveTimeout(CollectiveError):
    """A rank did not arrive (or a transfer did not complete) within the timeout."""


class CollectiveMismatch(CollectiveError):
    """The ranks called different collectives, or passed arrays of different shapes or dtypes."""


def make_notice(kind, dtype=None, op=None, root=None, size=0, shape=None, counts=None, tag=0):
    if op is not None and op not in OPS:
        raise ValueError(f"needle.distributed: op must be one of {', '.join(OPS)}, got {op!r}")
    notice = np.full(NOTICE_SIZE, UNSET, np.int64)
    notice[KIND] = KINDS.index(kind)
    notice[DTYPE] = UNSET if dtype is None else DTYPES.index(dtype) if dtype in DTYPES else len(DTYPES)
    notice[OP] = UNSET if op is None else OPS.index(op)
    notice[ROOT] = UNSET if root is None else root
    notice[SIZE] = size
    notice[COUNTS] = UNSET if counts is None else counts_checksum(counts)
    notice[TAG] = tag
    if shape is not None and len(shape) <= MAX_DIMS:
        notice[NDIM] = len(shape)
        notice[SHAPE:SHAPE + len(shape)] = shape
    return notice


def counts_checksum(counts):
    """A checksum of a list of per-rank counts: ranks that pass different lists get different numbers."""
    return zlib.crc32(np.asarray(counts, np.int64).tobytes())


def dtype_name(notice):
    code = int(notice[DTYPE])
    return None if code == UNSET else DTYPES[code] if code < len(DTYPES) else "another dtype"


def describe(notice, tag_format=None):
    """A notice in words: "all_reduce of shape (3,) float32 (sum)", "barrier", "exit"."""
    kind = KINDS[int(notice[KIND])]
    if kind in ("barrier", "exit"):
        return kind
    if kind == "joined":
        return "nothing (joined: out of data)"
    ndim = int(notice[NDIM])
    what = f"{kind} of shape {tuple(int(d) for d in notice[SHAPE:SHAPE + ndim])}" if ndim != UNSET else \
        f"{kind} of {int(notice[SIZE])} {'bytes' if notice[KIND] in VARIABLE_SIZE else 'elements'}"
    if notice[DTYPE] != UNSET:
        what += f" {dtype_name(notice)}"
    if notice[OP] != UNSET:
        what += f" ({OPS[int(notice[OP])]})"
    if notice[ROOT] != UNSET:
        what += f" from rank {int(notice[ROOT])}"
    if notice[COUNTS] != UNSET:
        what += f" (counts checksum {int(notice[COUNTS])})"
    if tag_format is not None:
        what += ", " + tag_format.format(int(notice[TAG]))
    elif notice[TAG]:
        what += f", tag {int(notice[TAG])}"
    return what


def _essence(notice):
    """The fields every rank must agree on: all but the sequence number (and sizes, where they may differ)."""
    fields = notice[KIND:].copy()
    if notice[KIND] in VARIABLE_SIZE:
        fields[SIZE - KIND] = UNSET
    return fields.tobytes()


def disagreement(table, ranks, tag_format=None, job_ranks=None):
    """None if the notices of `ranks` (rows of `table`) agree; else "rank 0: ...; rank 1: ..." naming every call
    (by the rank in the job, `job_ranks[r]`, when the table is a group's)."""
    if len({_essence(table[r]) for r in ranks}) <= 1:
        return None
    job_ranks = job_ranks or range(len(table))
    return "; ".join(f"rank {job_ranks[r]}: {describe(table[r], tag_format)}" for r in ranks)
