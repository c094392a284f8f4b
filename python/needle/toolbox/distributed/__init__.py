"""needle.distributed: training on several processes, MPI through mpi4py (`pip install -e ".[distributed]"`).

    mpiexec -n 2 python train.py

- `comm`: init, rank, world_size, barrier and the collectives (all_reduce, reduce_scatter, all_gather, broadcast,
  send/recv) on NDArrays; without mpiexec a job of one, where everything still works and mpi4py is not imported.
- `DataParallel(model, bucket_mb=25)`: gradients averaged across ranks in buckets while backward runs;
  `split_batch` / `batchify`: each rank's share of a batch.
- `ZeroRedundancyOptimizer(params, optimizer_class, stage=1|2|3, **kw)`: ZeRO, the optimizer state (stage 1),
  the gradients (stage 2) and the parameters (stage 3: `fully_sharded`) partitioned across the ranks.
- `Pipeline(stages, micro_batches)`: GPipe, one stage per rank, activations sent point-to-point.
- `new_group(ranks)`: a process group (an MPI sub-communicator); every collective, DataParallel and the
  tensor-parallel layers take `group=`, so one job holds 2-D layouts (tensor x data).
- `tensor_parallel`: Megatron-LM's tensor and sequence parallelism (parallelize_transformer, the parallel layers,
  the communication as graph ops with gradients).

No hang, no silent garbage (`notices`): every collective first sends each other rank an arrival notice (its
kind, shape, dtype, op, root) and checks everyone's before data moves. Ranks that called different collectives,
or passed different shapes or dtypes, raise `CollectiveMismatch` on every rank, naming each rank's call; a rank
that does not arrive within `get_timeout()` seconds (`set_timeout(seconds)`, default 300) is named in a
`CollectiveTimeout` ("rank 0 did not arrive"), one that has exited at once; send/recv time out alike. After such
an error the job ends with exit status 1 (MPI_Abort), caught or not. Uneven inputs: `with model.join(): ...`
(DataParallel), where ranks out of data shadow the others' collectives until every rank is done.

Importing this package imports no MPI; `init()` (called by everything that communicates) does, under mpiexec.
"""
from . import comm
from .comm import (
    Group, all_gather, all_gather_object, all_reduce, barrier, broadcast, broadcast_object, get_timeout, init,
    is_initialized, launched_by_mpiexec, new_group, rank, recv, reduce_scatter, send, set_timeout, traffic,
    world_size,
)
from .notices import CollectiveError, CollectiveMismatch, CollectiveTimeout
from .data_parallel import DataParallel, batchify, split_batch
from .pipeline import Pipeline, bubble_fraction
from .zero import ZeroRedundancyOptimizer
from . import fully_sharded, tensor_parallel

__all__ = [
    "CollectiveError", "CollectiveMismatch", "CollectiveTimeout", "DataParallel", "Group", "Pipeline",
    "ZeroRedundancyOptimizer",
    "all_gather", "all_gather_object", "all_reduce", "barrier", "batchify", "broadcast", "broadcast_object",
    "bubble_fraction", "comm", "fully_sharded", "get_timeout", "init", "is_initialized", "launched_by_mpiexec",
    "new_group", "rank",
    "recv", "reduce_scatter", "send", "set_timeout", "split_batch", "tensor_parallel", "traffic", "world_size",
]
