"""herring_jax makes ofi_rxm send every chunk eagerly (FI_OFI_RXM_EAGER_LIMIT =
chunk + header) unless the user set the variable: with rxm's rendezvous, a
connection busy in both directions carried half its rate each way. The
header's size comes from the engine (sizeof(WireHeader)), never a copy."""

import os
import subprocess
import sys
import textwrap

from herring_jax._herring_ffi import WIRE_HEADER_BYTES

_PROBE = textwrap.dedent("""
    import ctypes, numpy as np, herring_jax
    herring_jax.initialize()
    out = np.asarray(herring_jax.allreduce(np.ones(300_000, np.float32)))
    assert (out == 2).all()
    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p
    print("EAGER", getenv(b"FI_OFI_RXM_EAGER_LIMIT").decode(), flush=True)
""")


def _eager_limits(extra_env: dict) -> list[str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", HERRING_FI_PROVIDER="tcp;ofi_rxm",
               HERRING_HOST_STAGE="0", **extra_env)
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "herring_jax.launch", "-n", "2", "--timeout", "240", "--",
         sys.executable, "-P", "-c", _PROBE],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return sorted(line.split()[-1] for line in proc.stdout.splitlines() if "EAGER" in line)


def test_chunks_are_sent_eagerly_unless_the_user_says_otherwise():
    # 256 KiB chunks (300,000 floats make parts of 600 KB: several chunks).
    assert _eager_limits({"HERRING_CHUNK_BYTES": "262144"}) == [str(262144 + WIRE_HEADER_BYTES)] * 2
    assert _eager_limits({"FI_OFI_RXM_EAGER_LIMIT": "32768"}) == ["32768"] * 2


def test_import_sets_the_variables_before_any_thread():
    """The variables are in the environment right after `import herring_jax`
    (no setenv later, while jax's threads may read the environment)."""
    probe = ("import os, herring_jax; print(os.environ['FI_OFI_RXM_EAGER_LIMIT'], "
             "os.environ.get('FI_TCP_IFACE'))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FI_")}
    out = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True,
                         env=dict(env, HERRING_CHUNK_BYTES="65536", HERRING_FI_IFACE="lo"),
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(65536 + WIRE_HEADER_BYTES), "lo"]
    out = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True,
                         env=dict(env, HERRING_FI_IFACE="127.0.0.1"), timeout=120)
    assert out.stdout.split() == [str((1 << 20) + WIRE_HEADER_BYTES), "None"], out.stderr[-2000:]


def test_header_size_is_the_engines():
    assert WIRE_HEADER_BYTES == 104  # wire versions 2 and 3 (engine/wire.h static_assert)
