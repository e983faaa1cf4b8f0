""".ci/install.sh stops, with pip's error shown, when any pip step fails.

The script runs against stub commands (python3, apt-get, pkg-config, ...) that
record their calls and fail on request, so nothing is installed: a failed
rebuild must never leave the suite testing a stale herring_jax.
"""

import os
import shutil
import stat
import subprocess

import pytest

from multiproc import ROOT

# python3 stub: it is Python $STUB_PY to the version query; `-m pip install
# ARGS` prints a WARNING line (which the script filters) and fails with pip's
# wording when ARGS contain $FAIL_ON; any other call (the import checks)
# fails for mpi4jax, so its install step runs.
_PYTHON3 = r"""#!/bin/bash
echo "$* CUDA_ROOT=${CUDA_ROOT-}" >> "$STUB_LOG"
case "$*" in *"sys.version_info"*) echo "$STUB_PY"; exit 0;; esac
if [ "$1 $2 $3" = "-m pip install" ]; then
  if [ -n "${CUDA_ROOT-}" ] && [ -d "$CUDA_ROOT" ]; then echo "cuda_root_existed" >> "$STUB_LOG"; fi
  echo "WARNING: Running pip as the 'root' user can result in broken permissions"
  case " $* " in
    *" $FAIL_ON "*) echo "ERROR: No matching distribution found for $FAIL_ON" >&2; exit 1;;
  esac
  exit 0
fi
case "$*" in *"import mpi4jax"*) exit 1;; esac
echo "herring_jax (stub) installed"
"""


def _run(tmp_path, fail_on="<nothing>", python="3.11", purpose=None):
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in [("python3", _PYTHON3), ("apt-get", "#!/bin/sh\nexit 99\n")] + [
            (name, "#!/bin/sh\nexit 0\n")
            for name in ("pkg-config", "fi_info", "ip", "mpirun", "clang++", "dpkg")]:
        (stubs / name).write_text(text)
        (stubs / name).chmod(stat.S_IRWXU)
    log = tmp_path / "calls.log"
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "STUB_LOG": str(log), "FAIL_ON": fail_on,
           "HOME": str(tmp_path), "STUB_PY": python}
    proc = subprocess.run([shutil.which("bash"), str(ROOT / ".ci" / "install.sh")]
                          + ([purpose] if purpose else []), env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, [c for c in calls if c.startswith("-m pip install")], calls


def test_every_step_succeeds_and_warnings_are_filtered(tmp_path):
    proc, pips, _ = _run(tmp_path)
    # Every pip call printed only a WARNING line: grep filtered all of it
    # (its exit 1) and that is no failure.
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARNING" not in proc.stdout + proc.stderr
    assert len(pips) == 4, pips
    assert "herring_jax (stub) installed" in proc.stdout
    # Python 3.11: jax 0.10, the setup tested longest, and the local CPU torch.
    assert "jax>=0.10,<0.11" in pips[0] and "jaxlib>=0.10,<0.11" in pips[0], pips
    assert "torch==2.13.0" in pips[1], pips


@pytest.mark.parametrize("python", ["3.12", "3.13"])
def test_python_312_and_later_get_the_newest_supported_jax_and_no_torch(tmp_path, python):
    proc, pips, _ = _run(tmp_path, python=python)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"Python {python}: jax>=0.12,<0.13" in proc.stdout
    assert "jax>=0.12,<0.13" in pips[0] and "jaxlib>=0.12,<0.13" in pips[0], pips
    # mpi4jax builds without isolation, and a new venv has no setuptools.
    assert " setuptools " in pips[0], pips
    # The registry has only multi-GB CUDA builds of torch for 3.12.
    assert not any("torch" in p for p in pips), pips
    assert len(pips) == 4 and "herring_jax (stub) installed" in proc.stdout, pips


def test_an_unsupported_python_stops_before_any_install(tmp_path):
    proc, pips, _ = _run(tmp_path, python="3.10")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "python3 is Python 3.10; herring_jax needs Python 3.11" in proc.stderr
    assert pips == []


def test_a_failed_rebuild_stops_the_script_with_pips_error(tmp_path):
    proc, pips, calls = _run(tmp_path, fail_on=".")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    output = proc.stdout + proc.stderr
    assert "ERROR: No matching distribution found for ." in output
    assert "install.sh: error: pip install --no-build-isolation . failed (exit 1)" in output
    assert "installed" not in proc.stdout  # the stale package is not reported as the build
    assert not any(c.startswith("-P -c") for c in calls), calls


def test_a_failed_dependency_step_stops_before_the_next(tmp_path):
    proc, pips, _ = _run(tmp_path, fail_on="pytest-timeout")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "No matching distribution found for pytest-timeout" in proc.stdout
    assert len(pips) == 1, pips


def test_mpi4jax_failure_stops_the_script_and_keeps_the_cuda_root_trick(tmp_path):
    proc, pips, calls = _run(tmp_path, fail_on="mpi4jax")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "No matching distribution found for mpi4jax" in proc.stdout
    mpi4jax = [c for c in pips if " mpi4jax " in c + " "]
    assert len(mpi4jax) == 1 and len(pips) == 3, pips
    # pip saw an (empty) CUDA_ROOT directory, and it is gone afterwards.
    cuda_root = mpi4jax[0].rsplit("CUDA_ROOT=", 1)[1]
    assert cuda_root and "cuda_root_existed" in calls, calls
    assert not os.path.exists(cuda_root)


@pytest.mark.parametrize("purpose", ["demo", "tests"])
def test_the_demo_and_the_tests_install_only_what_they_need(tmp_path, purpose):
    # The demo: the library, jax, flax, optax, the digits and the plot; no
    # test tools, documentation tools or benchmark peers. The tests: those
    # tools too, still no peers (the extended part's, with `all`).
    proc, pips, _ = _run(tmp_path, purpose=purpose)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(pips) == 2, pips  # the dependencies, then herring_jax itself
    deps = pips[0].split()
    for needed in ("flax", "optax", "scikit-learn", "matplotlib"):
        assert needed in deps, deps
    tools = ("pytest", "sphinx", "orbax-checkpoint")
    assert all((t in deps) == (purpose == "tests") for t in tools), deps
    assert not any(p.startswith(("torch", "mpi4py", "mpi4jax")) for p in deps), deps
    assert "--no-build-isolation ." in pips[1], pips


def test_an_unknown_purpose_is_refused(tmp_path):
    proc, pips, _ = _run(tmp_path, purpose="everything")
    assert proc.returncode == 2 and not pips, proc.stdout + proc.stderr
    assert "unknown purpose 'everything'; use demo, tests or all" in proc.stderr
