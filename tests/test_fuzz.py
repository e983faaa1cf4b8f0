"""The wire-header parser under libFuzzer + ASan/UBSan: a short, fixed-seed run
of tests/fuzz/run_fuzzer.sh (build included) must finish without a crash,
sanitizer report or violated invariant.

The script installs clang and its libFuzzer runtime with apt-get when they are
missing; if that is impossible the test fails (it never skips): CI must fuzz.
For a longer run: bash tests/fuzz/run_fuzzer.sh 1000000
"""

import os
import re
import subprocess
import tempfile

RUNS = 20_000
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz", "run_fuzzer.sh")


def test_header_fuzzer_finds_nothing():
    with tempfile.TemporaryDirectory(prefix="herring_fuzz_") as build_dir:
        # Generous timeout: a first run may install clang (apt) before the
        # build (a few seconds) and the run itself (about a second).
        proc = subprocess.run(["bash", SCRIPT, str(RUNS), build_dir], capture_output=True,
                              text=True, timeout=280)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"run_fuzzer.sh exited {proc.returncode} (crash, sanitizer report, or clang/"
        f"libFuzzer could not be installed):\n{output[-6000:]}")
    done = re.search(r"^FUZZ_DONE runs=(\d+) crashes=(\d+)$", proc.stdout, re.MULTILINE)
    assert done, f"no FUZZ_DONE line in the output:\n{output[-6000:]}"
    runs, crashes = int(done.group(1)), int(done.group(2))
    assert crashes == 0 and runs >= RUNS, output[-6000:]
    print(proc.stdout)
