"""What the build produced: the CPU handler always, the CUDA handler exactly
when a CUDA toolkit (nvcc) is on the build machine (.ci/cuda_compile.sh
also compile-checks it against CUDA 12's headers); and the README's knob table is the one the
code documents."""

import pathlib
import shutil

from herring_jax import _herring_ffi
from herring_jax._src import knobs, runtime


def test_cpu_handler_registered():
    assert sorted(_herring_ffi.registrations()) == ["herring_allreduce", "herring_join",
                                                    "herring_simulated_compute"]


def test_cuda_handler_built_when_toolkit_present():
    has_toolkit = shutil.which("nvcc") is not None
    assert runtime.cuda_handler_built() == has_toolkit
    if has_toolkit:
        assert sorted(_herring_ffi.cuda_registrations()) == ["herring_allreduce_done",
                                                             "herring_allreduce_start"]


def test_readme_knob_table_is_current():
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    table = knobs.markdown_table()
    assert table in readme, (
        "README.md's 'Environment knobs' table differs from herring_jax/_src/knobs.py; "
        "paste the output of `python3 -c 'from herring_jax._src import knobs; "
        "print(knobs.markdown_table())'` over it")
