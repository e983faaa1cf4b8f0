""".ci/install.sh stops, with pip's error shown, when any pip step fails.

The script runs against stub commands (python3, apt-get, pkg-config, ...) that
record their calls and fail on request, so nothing is installed: a failed
rebuild must never leave the suite testing a stale herring_jax.
"""

import os
import shutil
import stat
import subprocess

from multiproc import ROOT

# python3 stub: `-m pip install ARGS` prints a WARNING line (which the script
# filters) and fails with pip's wording when ARGS contain $FAIL_ON; any other
# call (the import checks) fails for mpi4jax, so its install step runs.
_PYTHON3 = r"""#!/bin/bash
echo "$* CUDA_ROOT=${CUDA_ROOT-}" >> "$STUB_LOG"
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


def _run(tmp_path, fail_on="<nothing>"):
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in [("python3", _PYTHON3), ("apt-get", "#!/bin/sh\nexit 99\n")] + [
            (name, "#!/bin/sh\nexit 0\n")
            for name in ("pkg-config", "fi_info", "ip", "mpirun", "clang++", "dpkg")]:
        (stubs / name).write_text(text)
        (stubs / name).chmod(stat.S_IRWXU)
    log = tmp_path / "calls.log"
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "STUB_LOG": str(log), "FAIL_ON": fail_on,
           "HOME": str(tmp_path)}
    proc = subprocess.run([shutil.which("bash"), str(ROOT / ".ci" / "install.sh")], env=env,
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
