"""fully_sharded against optax.chain(allreduce_gradients(), inner): the same
training steps from the same parameters, the whole parameters (gathered)
compared bitwise (element-wise inner transformations) or within a tolerance
(a global-norm clip), on every process; and what each process holds between
steps. (A lossy codec's error feedback: fully_sharded_ef_worker.py.)"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.extend import core as jex_core  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402
from sharded_worker import (CLIPPED, INNERS, REFUSED, STEPS, batch, compare, flat,  # noqa: E402
                            loss_fn, make_params, state_bytes)
from sharded_worker import train as train_reference  # noqa: E402


def train_fully_sharded(fs, params, rank, jit_init: bool, loss_fn=loss_fn):
    state = (jax.jit(fs.init) if jit_init else fs.init)(params)

    @jax.jit
    def step(state, x):
        loss, grads = fs.value_and_grad(loss_fn)(state, x)
        return fs.apply_gradients(state, grads), loss

    for k in range(STEPS):
        state, _ = step(state, batch(rank, k))
    return jax.jit(fs.gather)(state), state


def flax_models():
    """(name, params, loss(params, x)) of a Flax Linen and a Flax NNX MLP
    (widths 2, 3 and 4 do not divide); NNX's loss rebuilds the model from its
    parameters with nnx.merge, as the guide shows."""
    import flax.linen as nn
    from flax import nnx

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = jnp.tanh(nn.Dense(29)(x))
            return nn.Dense(3)(jnp.tanh(nn.Dense(19)(x)))

    class NNX(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(37, 29, rngs=rngs)
            self.b = nnx.Linear(29, 3, rngs=rngs)

        def __call__(self, x):
            return self.b(jnp.tanh(self.a(x)))

    linen = Linen()
    linen_params = linen.init(jax.random.key(0), jnp.zeros((1, 37)))

    def linen_loss(params, x):
        return jnp.mean(linen.apply(params, x) ** 2)

    graphdef, nnx_params, rest = nnx.split(NNX(nnx.Rngs(0)), nnx.Param, ...)

    def nnx_loss(params, x):
        return jnp.mean(nnx.merge(graphdef, params, rest)(x) ** 2)

    class Attention(nn.Module):
        """examples/train_lm.py's block in small: layer norms, causal
        self-attention (a softmax, whose backward XLA compiles differently
        under jax.shard_map over several devices), gelu."""

        @nn.compact
        def __call__(self, x):
            x = x.reshape(x.shape[0], 1, -1)[:, :, :36].reshape(x.shape[0], 6, 6)
            h = nn.LayerNorm()(x)
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
            x = x + nn.MultiHeadDotProductAttention(num_heads=2)(h, h, mask=mask)
            return nn.Dense(3)(nn.gelu(nn.Dense(10)(nn.LayerNorm()(x))))

    attention = Attention()
    attention_params = attention.init(jax.random.key(1), jnp.zeros((1, 37)))

    def attention_loss(params, x):
        return jnp.mean(attention.apply(params, x) ** 2)

    return {"linen": (linen_params, linen_loss), "nnx": (nnx_params, nnx_loss),
            "attention": (attention_params, attention_loss)}


def model_case(case: str, rank: int) -> None:
    """model/<linen|nnx>/<inner>: fully_sharded on a Flax model against the
    unsharded chain, bitwise."""
    _, kind, name = case.split("/")
    params, loss = flax_models()[kind]
    make = INNERS[name]
    ref, _ = train_reference(optax.chain(herring_jax.allreduce_gradients(), make()), params,
                             rank, loss_fn=loss)
    got, _ = train_fully_sharded(herring_jax.fully_sharded(make()), params, rank, False,
                                 loss_fn=loss)
    a, b = flat(got), flat(ref)
    common.report(case, a.tobytes() == b.tobytes(), digest=common.digest(np.asarray(a)),
                  max_diff=float(np.max(np.abs(a - b))))


def saved_residuals_case(rank: int) -> None:
    """reshard_after_forward keeps nothing of a whole parameter's size for
    the backward pass: not the gathered weights, nor what is computed from
    them alone (a cast of a bfloat16 weight to float32, its transpose, what
    a nested jit computes from a weight and a cast of that, the sine of a
    weight), nor what the tangent of a nonlinear function of a weight needs
    (the cosine). What the backward pass's jax.checkpoint
    equations take in is what the forward pass saved for them."""
    rng = np.random.default_rng(5)
    params = {"w": jnp.asarray(rng.normal(size=(256, 256)) / 16, jnp.bfloat16),
              "v": jnp.asarray(rng.normal(size=(256, 96)) / 16, jnp.float32)}
    # (No whole size equals another's chunk, which the backward pass takes in.)
    whole = {int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params)}

    def loss(params, x):
        w = params["w"].astype(jnp.float32)
        u = jax.jit(lambda a: (a * 0.5).T)(params["w"]).astype(jnp.float32)
        # Layers after the first: their inputs' gradients need the weights.
        h = jnp.tanh(jnp.tanh(jnp.tanh(x @ w) @ w.T) @ u)
        g = jnp.einsum("bi,ij->bj", h, jnp.sin(params["v"]))
        return jnp.mean(h ** 2) + jnp.mean(g ** 2)

    x = jnp.asarray(rng.normal(size=(8, 256)), jnp.float32)
    fs = herring_jax.fully_sharded(optax.sgd(0.1), reshard_after_forward=True)
    state = fs.init(params)
    closed = jax.make_jaxpr(fs.value_and_grad(loss))(state, x)
    # The backward pass's jax.checkpoint equations (the only ones with a
    # remat policy) and what they take in.
    saved = [v.aval for e in closed.jaxpr.eqns if "policy" in e.params
             for v in e.invars if hasattr(v, "aval")]
    too_big = [a.str_short() for a in saved if int(np.prod(a.shape)) in whole]
    # The gradients are still right: jax.grad of the whole parameters (every
    # process has the same batch, so their mean is its gradient), within
    # 64 roundings of each leaf's dtype (the program is compiled otherwise;
    # a wrong term would be off by far more).
    _, grads = jax.jit(fs.value_and_grad(loss))(state, x)
    got = jax.jit(lambda g: fs.gather(dataclasses.replace(state, chunks=g)))(grads.chunks)
    want = jax.grad(loss)(params, x)
    errs = {}
    for k in params:
        a, b = np.asarray(got[k], np.float32), np.asarray(want[k], np.float32)
        errs[k] = float(np.max(np.abs(a - b)) / np.max(np.abs(b)) / jnp.finfo(got[k].dtype).eps)
    common.report("reshard/saved-residuals",
                  bool(saved) and not too_big and max(errs.values()) <= 64,
                  saved=[a.str_short() for a in saved], too_big=too_big, grad_err_in_eps=errs)


def _dependencies(jaxpr):
    """For each gather (herring_all_gather) and reduce-scatter equation of
    `jaxpr`'s top level, in program order: the gathers and the reduce-scatters
    whose results its operands depend on (through any equations)."""
    deps = {}  # var -> (gathers, reduce-scatters) it depends on
    gathers, scatters = [], []
    for eqn in jaxpr.eqns:
        g, r = set(), set()
        for v in eqn.invars:
            if not isinstance(v, jex_core.Literal):
                dg, dr = deps.get(v, ((), ()))
                g |= set(dg)
                r |= set(dr)
        name = eqn.primitive.name
        if name == "herring_all_gather":
            gathers.append((g, r))
            g = g | {len(gathers) - 1}
        elif name == "herring_allreduce" and eqn.params["collective"] == "reduce_scatter":
            scatters.append((g, r))
            r = r | {len(scatters) - 1}
        for v in eqn.outvars:
            deps[v] = (frozenset(g), frozenset(r))
    return gathers, scatters


def _count(jaxpr, name: str) -> int:
    """Equations of primitive `name` in `jaxpr`, nested ones included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == name
        for sub in jex_core.jaxprs_in_params(eqn.params):
            n += _count(sub, name)
    return n


def prefetch_structure_case(rank: int) -> None:
    """prefetch=p: bucket k's gather waits for the arrival of buckets 0..k-p-1
    and no other's, so while the forward pass waits for bucket 0, buckets
    1..p (and no more) may be gathered too; the backward pass's reduce-scatters wait
    for none of each other, and it holds no barrier (jax's transpose of the
    forward pass's would tie bucket k-p-1's reduce-scatter to bucket k's
    through a whole-sized zero cotangent)."""
    del rank
    layers = 6
    rng = np.random.default_rng(7)
    params = {f"w{k}": jnp.asarray(rng.normal(size=(16, 16)) / 4, jnp.float32)
              for k in range(layers)}

    def loss(params, x):
        for k in range(layers):
            x = jnp.tanh(x @ params[f"w{k}"])
        return jnp.mean(x ** 2)

    x = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)
    # One parameter per bucket (each 1 KiB).
    for p in (0, 1, 2, None):
        fs = herring_jax.fully_sharded(optax.sgd(0.1), prefetch=p, fusion_bytes=1024,
                                       first_bucket_bytes=1024)
        closed = jax.make_jaxpr(fs.value_and_grad(loss))(fs.init(params), x)
        gathers, scatters = _dependencies(closed.jaxpr)
        waits = [sorted(g) for g, _ in gathers]
        want = [list(range(k - p)) if p is not None and k > p else [] for k in range(layers)]
        # The gathers that can be in flight while bucket 0's is awaited.
        before_first = sum(0 not in g for g, _ in gathers)
        zeros = [e.outvars[0].aval.str_short() for e in closed.jaxpr.eqns
                 if e.primitive.name == "broadcast_in_dim" and e.outvars[0].aval.shape == (16, 16)]
        barriers = _count(closed.jaxpr, "optimization_barrier")
        want_barriers = 0 if p is None else max(0, layers - p - 1)
        ok = (len(gathers) == layers and waits == want
              and before_first == (layers if p is None else min(layers, p + 1))
              and len(scatters) == layers and not any(r for _, r in scatters)
              and not any(r for _, r in gathers) and not zeros and barriers == want_barriers)
        common.report(f"prefetch/structure/{p}", ok, waits=waits, want=want,
                      before_first=before_first, barriers=barriers,
                      scatter_waits=[sorted(r) for _, r in scatters], zeros=zeros)


VARIANTS = {"default": {}, "reshard": dict(reshard_after_forward=True), "jit-init": {},
            "prefetch1": dict(prefetch=1, fusion_bytes=256),
            "all": dict(prefetch=None, fusion_bytes=512)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="float32/adam/default",
                        help="comma-separated dtype/inner/variant[+variant...] (variants: "
                             f"{', '.join(VARIANTS)})")
    parser.add_argument("--saved-residuals", action="store_true",
                        help="also: what reshard_after_forward saves for the backward pass")
    parser.add_argument("--prefetch-structure", action="store_true",
                        help="also: what waits for what with each prefetch depth")
    parser.add_argument("--refused", action="store_true",
                        help="also: transformations that look at whole leaves are refused")
    args = parser.parse_args()
    herring_jax.initialize()
    rank = herring_jax.process_index()
    for case in [c for c in args.cases.split(",") if c]:
        if case.startswith("model/"):
            model_case(case, rank)
            continue
        dtype, name, variants = case.split("/")
        params = make_params(dtype)
        make = {**INNERS, **CLIPPED}[name]
        refs = {}
        for v in variants.split("+"):
            remat = v == "reshard"
            if remat not in refs:
                refs[remat] = train_reference(
                    optax.chain(herring_jax.allreduce_gradients(), make()), params, rank, remat)
            ref, ref_state = refs[remat]
            fs = herring_jax.fully_sharded(make(), **VARIANTS[v])
            got, got_state = train_fully_sharded(fs, params, rank, jit_init=v == "jit-init")
            common.report(f"{dtype}/{name}/{v}", **compare(name, dtype, got, ref),
                          held_bytes=state_bytes((got_state.chunks, got_state.inner)),
                          unsharded_bytes=state_bytes((ref, ref_state)))
    if args.refused:
        for name, make in REFUSED.items():
            try:
                herring_jax.fully_sharded(make()).init(make_params("float32"))
                common.report(f"refused/{name}", False, error="no error")
            except ValueError as e:
                common.report(f"refused/{name}", "element by element" in str(e), error=str(e))
        # Integer and bool leaves have no gradient: refused at init, named.
        params = {**make_params("float32"), "step": jnp.zeros((), jnp.int32),
                  "mask": jnp.ones(3, bool)}
        try:
            herring_jax.fully_sharded(optax.sgd(0.1)).init(params)
            common.report("refused/integer-leaves", False, error="no error")
        except TypeError as e:
            common.report("refused/integer-leaves", "['step'] (int32)" in str(e)
                          and "['mask'] (bool)" in str(e) and "fully_sharded" in str(e),
                          error=str(e))
    if args.saved_residuals:
        saved_residuals_case(rank)
    if args.prefetch_structure:
        prefetch_structure_case(rank)
    herring_jax.shutdown()


if __name__ == "__main__":
    main()
