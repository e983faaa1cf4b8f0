"""herring-jax bench: herring_jax's collectives against their peers, in one run.

  herring-jax bench -n 4 [--provider 'tcp;ofi_rxm'] [--sizes-mib 1,16,64] [--json out.json]
                    [--collective allreduce,reduce_scatter,all_gather]
  python -m herring_jax.bench -n 4 ...

A size S is the buffer of every collective (collectives.py): an all-reduce
and a reduce-scatter take S from each process, an all-gather gives S to each.

The driver (driver.py) starts n worker processes through herring-jax launch
(workers.py), or through mpirun when an MPI peer runs (mpirun.py); each worker
(worker.py) times every peer on the same float32 buffers in the same order,
checks the result of every run, and rank 0 gathers the timings through the
jax.distributed key-value store and prints the table (report.py); plot.py
draws it. Workers can also be started by any other launcher (SLURM, mpirun)
with `--worker`.

Peers, one module each under peers/: herring (herring_jax's collectives under
jax.jit), jax_psum (jax.lax.psum, psum_scatter, all_gather in shard_map over
one device per process, i.e. JAX's gloo CPU collectives), mpi4jax (allreduce,
allgather) and mpi4py (Open MPI's Allreduce, Reduce_scatter_block,
Allgather), torch_gloo (torch.distributed's gloo all_reduce,
reduce_scatter_single, all_gather_single; PyTorch DDP's CPU backend). A peer
whose package or launcher is missing is reported as missing, with how to
install it; one without a collective, as unsupported for it. A peer is a
class in peers.PEERS.
"""

from herring_jax._src.tools.bench.driver import add_arguments as add_arguments
from herring_jax._src.tools.bench.driver import main as main
from herring_jax._src.tools.bench.driver import run as run
from herring_jax._src.tools.bench.peers import PEERS as PEERS
from herring_jax._src.tools.bench.peers import missing_peers as missing_peers
from herring_jax._src.tools.bench.worker import worker_main as worker_main
