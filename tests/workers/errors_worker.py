"""Documented behaviour on bad input, in a real (single or multi) process job."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402


def expect(case: str, exc_type, fn, *needles: str) -> None:
    try:
        fn()
    except exc_type as e:
        text = str(e)
        missing = [n for n in needles if n not in text]
        common.report(case, not missing, message=text[:300], missing=missing)
        return
    except Exception as e:  # noqa: BLE001 - wrong type is a failure to report
        common.report(case, False, message=f"{type(e).__name__}: {e}"[:300])
        return
    common.report(case, False, message="no exception")


def main() -> int:
    # numpy input: a jnp array would start the XLA backend, after which
    # jax.distributed (and so herring_jax) can no longer be initialized.
    expect("before-initialize", herring_jax.HerringError,
           lambda: herring_jax.allreduce(np.ones(3, np.float32)), "initialize")
    herring_jax.initialize()
    n = herring_jax.process_count()
    expect("bad-dtype", TypeError,
           lambda: herring_jax.allreduce(jnp.ones(3, jnp.float8_e4m3fn)),
           "float8_e4m3fn", "float32", "bfloat16", "complex64", "uint8")
    expect("bad-dtype-in-psum", TypeError, lambda: herring_jax.psum(
        jnp.ones(3, jnp.float8_e5m2), "i"), "float8_e5m2", "supported")
    expect("bad-op", ValueError, lambda: herring_jax.allreduce(jnp.ones(3), op="prod"),
           "'prod'", "sum", "mean", "max", "min")
    expect("int-mean", TypeError, lambda: herring_jax.allreduce(jnp.ones(3, jnp.int32), op="mean"),
           "int32", "mean")
    expect("bad-op-in-jit", ValueError,
           lambda: jax.jit(lambda x: herring_jax.allreduce(x, op="prod"))(jnp.ones(2)), "prod")
    expect("reinitialize-different", ValueError,
           lambda: herring_jax.initialize(coordinator_address="127.0.0.1:1", num_processes=99,
                                          process_id=0), "already initialized")
    herring_jax.initialize()  # same (no) arguments: a no-op
    common.report("reinitialize-same", True)

    empty = herring_jax.allreduce({})
    common.report("empty-tree", empty == {})
    z = herring_jax.allreduce({"z": jnp.zeros((0, 3)), "x": jnp.ones(2)})
    common.report("zero-size-leaf", z["z"].shape == (0, 3) and
                  np.array_equal(np.asarray(z["x"]), np.full(2, float(n))))
    vals = jnp.array([np.nan, np.inf, -np.inf, 1.0], jnp.float32)
    got = np.asarray(herring_jax.allreduce(vals))
    want = np.sum(np.stack([np.asarray(vals)] * n), axis=0)
    common.report("non-finite", np.array_equal(got, want, equal_nan=True), got=str(got))
    scalar = herring_jax.allreduce(jnp.float32(2.5))
    common.report("scalar", float(scalar) == 2.5 * n and scalar.shape == ())
    herring_jax.shutdown()
    herring_jax.shutdown()  # twice is fine
    common.report("shutdown-twice", True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
