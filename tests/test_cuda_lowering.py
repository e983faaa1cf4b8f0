"""The XLA:CUDA lowering, checked without a GPU (jax lowers for "cuda" on this
CPU-only machine): allreduce_gradients emits a start and a done per bucket,
every done after every start; a direct reduction a start then its done; every
done pairs with exactly one start; reduce-scatters and all-gathers (and
sharded_optimizer's step) take the same pair, each done keyed as its start; the XLA:CPU lowering has one asynchronous
call per bucket, reducing in place, and one herring_join after them all (and
neither without the split). What the handlers do on a GPU is not tested here:
see xla_ffi/cuda_handlers.cc."""

from multiproc import assert_all_ok, launch


def test_cuda_lowering_splits_and_cpu_lowering_reduces_in_place_then_joins():
    run = launch("cuda_lowering_worker.py", [], nproc=1, timeout=240)
    assert_all_ok(run, expected_cases=5)
