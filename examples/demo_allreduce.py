"""Demo: every process reduces a few buffers with herring_jax and checks the
result against numpy. Run with `herring-jax launch -n 4 -- python examples/demo_allreduce.py`."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import herring_jax


def contribution(rank: int, count: int, dtype) -> np.ndarray:
    return (np.sin(np.arange(count) * 0.01 + rank) * (rank + 1)).astype(dtype)


def main() -> None:
    herring_jax.initialize()
    rank, n = herring_jax.process_index(), herring_jax.process_count()
    print(f"{herring_jax.describe()}", flush=True)
    reduce_mean = jax.jit(lambda t: herring_jax.allreduce(t, op="mean"))
    for name, dtype, count in [("float32", np.float32, 4 << 20), ("bfloat16", ml_dtypes.bfloat16,
                                                                   1 << 20),
                               ("float32", np.float32, 16 << 20)]:
        x = jnp.asarray(contribution(rank, count, dtype))
        jax.block_until_ready(reduce_mean({"x": x}))  # compile and warm up
        start = time.perf_counter()
        got = np.asarray(reduce_mean({"x": x})["x"])
        ms = (time.perf_counter() - start) * 1e3
        # numpy reference: rank-order sum (float32 accumulation), then / n.
        acc = contribution(0, count, dtype).astype(np.float32)
        for r in range(1, n):
            acc = acc + contribution(r, count, dtype).astype(np.float32)
        want = (acc / np.float32(n)).astype(dtype)
        exact = got.tobytes() == want.tobytes()
        mib = count * np.dtype(dtype).itemsize / 2**20
        print(f"mean of {name}[{count}] ({mib:.0f} MiB) over {n} processes: "
              f"{'matches numpy bitwise' if exact else 'MISMATCH'}, {ms:.1f} ms, "
              f"first values {got[:3].astype(np.float32)}", flush=True)
        if not exact:
            raise SystemExit(f"rank {rank}: result differs from numpy")
    print(f"stats: {herring_jax.stats()}", flush=True)
    herring_jax.shutdown()


if __name__ == "__main__":
    main()
