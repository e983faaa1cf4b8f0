"""One rank of `herring-jax train-bench --simulated-accelerator`: data-parallel
training as a GPU host's CPU sees it.

Each layer's compute is a wait that uses no CPU (the `herring_simulated_compute`
call: like a kernel, it completes after a set time), while the gradients are
real buffers of a BERT-base-like layer structure (embeddings, then per layer
the attention projections, the feed-forward pair, two layer norms, biases),
produced layer by layer in backward order and reduced by
optax.chain(herring_jax.allreduce_gradients(), optax.sgd(...)) inside the jitted
step, as a user writes it. Forward takes `--layer-ms` per layer, backward twice
that. Prints `SIMULATED_RESULT {json}` on rank 0: the median step, and on more
than one process the reduction alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=384, help="BERT-base: 768")
    p.add_argument("--ff", type=int, default=1536, help="feed-forward width (BERT-base: 3072)")
    p.add_argument("--vocab", type=int, default=8192, help="embedding rows (BERT: 30522)")
    p.add_argument("--layer-ms", type=float, default=20.0,
                   help="forward time per layer; backward takes twice as long")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--fusion-mib", type=float, default=None)
    return p.parse_args(argv)


def shapes(args) -> list[dict]:
    """Parameter shapes, embeddings first (its gradient is ready last)."""
    h, ff = args.hidden, args.ff
    out = [{"embedding": (args.vocab, h), "position": (512, h)}]
    for _ in range(args.layers):
        out.append({"qkv": (h, 3 * h), "qkv_b": (3 * h,), "proj": (h, h), "proj_b": (h,),
                    "ln1": (2, h), "ff1": (h, ff), "ff1_b": (ff,), "ff2": (ff, h),
                    "ff2_b": (h,), "ln2": (2, h)})
    return out


def main(argv=None) -> int:
    args = _parse(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import herring_jax

    herring_jax.initialize()
    n = herring_jax.process_count()
    us = int(args.layer_ms * 1000)

    def compute(x, factor):
        return jax.ffi.ffi_call("herring_simulated_compute",
                                jax.ShapeDtypeStruct(x.shape, x.dtype),
                                has_side_effect=True)(x, us=np.int64(us * factor))

    params = [{k: jnp.full(s, 0.01, jnp.float32) for k, s in layer.items()}
              for layer in shapes(args)]
    nbytes = sum(int(np.prod(v.shape)) * 4 for v in jax.tree.leaves(params))

    def grads_of(params, x):
        """Forward through every layer, then backward in reverse: each layer's
        gradients exist once its backward "kernel" has run."""
        acts = [x]
        for _ in params:
            acts.append(compute(acts[-1], 1))
        ct = acts[-1]
        grads = [None] * len(params)
        for i in reversed(range(len(params))):
            ct = compute(ct, 2)
            scale = ct[0] * 1e-3  # the gradient depends on this layer's backward
            grads[i] = jax.tree.map(lambda p: p * scale, params[i])
        return grads

    kwargs = {} if args.fusion_mib is None else {"fusion_bytes": int(args.fusion_mib * 2**20)}
    reducer = herring_jax.allreduce_gradients(**kwargs)
    sgd = optax.sgd(1e-3)
    tx = optax.chain(reducer, sgd) if n > 1 else sgd

    @jax.jit
    def step(p, s, x):
        u, s = tx.update(grads_of(p, x), s, p)
        return optax.apply_updates(p, u), s

    x = jnp.ones((1024,), jnp.float32)
    s = tx.init(params)
    p = params
    p, s = jax.block_until_ready(step(p, s, x))  # compile
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        p, s = jax.block_until_ready(step(p, s, x))
        times.append((time.perf_counter() - t0) * 1e3)
    result = {"processes": n, "gradient_bytes": nbytes, "layer_ms": args.layer_ms,
              "compute_ms": 3 * args.layer_ms * len(params), "step_ms": statistics.median(times)}
    if n > 1:
        grads = jax.jit(grads_of)(params, x)
        reduce_only = jax.jit(lambda g: reducer.update(g, reducer.init(g))[0])
        jax.block_until_ready(reduce_only(grads))
        red = []
        for _ in range(max(2, args.steps // 2)):
            t0 = time.perf_counter()
            jax.block_until_ready(reduce_only(grads))
            red.append((time.perf_counter() - t0) * 1e3)
        result["reduction_ms"] = statistics.median(red)
    if herring_jax.process_index() == 0:
        print("SIMULATED_RESULT " + json.dumps(result), flush=True)
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
