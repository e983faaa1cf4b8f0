"""What the build produced: the CPU handler always, the CUDA handler exactly
when a CUDA toolkit (nvcc) is on the build machine (.ci/cuda_compile.sh
also compile-checks it against CUDA 12's headers). (The knob table's check is in
test_docs.py, beside the page that holds it.)"""

import shutil

from herring_jax import _herring_ffi
from herring_jax._src.process import runtime


def test_cpu_handler_registered():
    assert sorted(_herring_ffi.registrations()) == [
        "herring_allreduce", "herring_async_done", "herring_async_known", "herring_async_start",
        # Tests: XLA:CUDA's handler code on the CPU double (test_device_double.py).
        "herring_double_allreduce_done", "herring_double_allreduce_start",
        "herring_join", "herring_simulated_compute"]


def test_cuda_handler_built_when_toolkit_present():
    has_toolkit = shutil.which("nvcc") is not None
    assert runtime.cuda_handler_built() == has_toolkit
    if has_toolkit:
        assert sorted(_herring_ffi.cuda_registrations()) == ["herring_allreduce_done",
                                                             "herring_allreduce_start"]

