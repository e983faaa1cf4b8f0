"""Flax NNX: herring_jax's transformations inside ``nnx.Optimizer(model, tx,
wrt=nnx.Param)``, each step one ``nnx.jit`` of ``nnx.value_and_grad`` and
``optimizer.update(model, grads)``, as Flax's documentation teaches.

Cases (every rank reports each; the driver compares digests across ranks):
  <tx>/nnx-vs-plain: the NNX step gives bitwise the parameters of the same
    transformation used the plain way (jax.jit, tx.update, apply_updates on
    the model's parameters as a pytree), for allreduce_gradients, bf16 with
    error feedback, PowerSGD, top-k and sharded_optimizer. The loss falls.
  allreduce/one-process: allreduce_gradients + adamw equal, bitwise, one
    process's training that averages every rank's gradients in numpy in rank
    order (the sum herring_jax promises) and runs adamw on the result.
  sharded/vs-chain: sharded_optimizer(adamw) equals, bitwise, the unsharded
    chain (allreduce_gradients + adamw), both inside nnx.Optimizer.
  bf16/vs-exact: the bf16 codec's parameters are within BF16_TOLERANCE of
    the uncompressed ones, and its error-feedback residual is not zero (the
    codec ran: the worker runs with HERRING_HOST_STAGE=0).
  resume/sharded, resume/plain (--resume, on another number of processes):
    those checkpoints restored and trained to STEPS; the driver checks that
    both kinds end with the same parameters on every process.
  checkpoint/sharded, checkpoint/plain: STEPS steps equal, bitwise, SAVE_AT
    steps, a checkpoint, a restore into a fresh model and optimizer, and the
    rest; by the recipes of docs/guides/checkpoints.md (executed from the
    page), the sharded one recording every file each process writes.

Comparisons are bitwise with XLA_FLAGS=--xla_backend_optimization_level=0
(see docs/guides/sharded.md, "Same results": it keeps XLA:CPU from fusing the
optimizer's last multiply with apply_updates' add in one program and not in
the other).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys
import warnings

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import common  # noqa: E402
import file_writes  # noqa: E402
import herring_jax  # noqa: E402

STEPS, SAVE_AT = 4, 2
# bf16 keeps 8 significant bits: each element of a contribution crosses the
# wire off by at most 2^-9 of itself, and error feedback adds that back at the
# next step. The parameters of bf16 training may differ from exact training's
# by BF16_TOLERANCE times the largest distance exact training moved any
# parameter (measured: 0.14% after 4 sgd steps with momentum); a gradient lost
# or counted twice moves them by far more.
BF16_TOLERANCE = 2.0 ** -5
DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guides" / "checkpoints.md"


class MLP(nnx.Module):
    """Widths that 2, 3 and 4 do not divide: padded chunks in sharded_optimizer."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(13, 37, rngs=rngs)
        self.middle = nnx.Linear(37, 29, rngs=rngs)
        self.out = nnx.Linear(29, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.middle(jnp.tanh(self.hidden(x)))))


def make_model() -> MLP:
    return MLP(nnx.Rngs(0))  # the same key: the same start on every process


def batch(rank: int, step: int):
    rng = np.random.default_rng(1000 * rank + step)
    x = rng.normal(size=(16, 13)).astype(np.float32)
    return x, np.sin(x[:, :3] * 2).astype(np.float32)


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


@nnx.jit
def nnx_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss


def params_of(model):
    return nnx.as_pure(nnx.state(model, nnx.Param))


def flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree_util.tree_leaves(tree)])


def nnx_train(tx, rank: int, first: int = 0, steps: int = STEPS, model=None, optimizer=None):
    model = model if model is not None else make_model()
    if optimizer is None:
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    losses = [float(nnx_step(model, optimizer, *batch(rank, k)))
              for k in range(first, first + steps)]
    return model, optimizer, losses


def plain_train(tx, rank: int):
    """The same steps without NNX's optimizer: a pytree of parameters."""
    graphdef, params = nnx.split(make_model(), nnx.Param)
    params = nnx.as_pure(params)

    @jax.jit
    def step(params, state, x, y):
        grads = jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p), x, y))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    for k in range(STEPS):
        params, state = step(params, state, *batch(rank, k))
    return params


def one_process(inner, nproc: int):
    """Every rank's gradients computed here, averaged in numpy in rank order
    (herring_jax's sum, then one division), and `inner` run on the average."""
    graphdef, params = nnx.split(make_model(), nnx.Param)
    params = nnx.as_pure(params)
    grad = jax.jit(jax.grad(lambda p, x, y: loss_fn(nnx.merge(graphdef, p), x, y)))

    @jax.jit
    def apply(params, state, grads):
        updates, state = inner.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = inner.init(params)
    for k in range(STEPS):
        each = [jax.tree_util.tree_map(np.asarray, grad(params, *batch(r, k)))
                for r in range(nproc)]
        mean = jax.tree_util.tree_map(
            lambda *g: common.reference("float32", "mean", [[x] for x in g]), *each)
        params, state = apply(params, state, mean)
    return params


def same(case: str, a, b, **fields) -> None:
    a, b = flat(a), flat(b)
    common.report(case, a.tobytes() == b.tobytes(), digest=common.digest(a),
                  max_diff=float(np.max(np.abs(a - b))), **fields)


def docs_recipes() -> dict:
    """The NNX checkpoint recipes, as docs/guides/checkpoints.md gives them."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    namespace = {}
    for code in blocks:
        if "_nnx(directory, model, optimizer)" in code:
            exec(compile(code, str(DOCS), "exec"), namespace)
    return namespace


def checkpointed():
    return (("sharded", herring_jax.sharded_optimizer(optax.adamw(1e-2))),
            ("plain", optax.chain(herring_jax.allreduce_gradients(), optax.adamw(1e-2))))


def resume(rank: int, root: str) -> None:
    """Restores the checkpoints of another number of processes (the plain one:
    process 0's copy, the same on every process with adamw) and trains the
    rest of the STEPS; the driver compares the two kinds' digests."""
    recipes = docs_recipes()
    for kind, tx in checkpointed():
        model = MLP(nnx.Rngs(1))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        directory = os.path.join(root, kind, str(SAVE_AT))
        if kind == "plain":
            recipes["restore_plain_nnx"](directory, model, optimizer, row=0)
        else:
            recipes["restore_sharded_nnx"](directory, model, optimizer)
        step = int(optimizer.step[...])
        nnx_train(tx, rank, first=step, steps=STEPS - step, model=model, optimizer=optimizer)
        a = flat(params_of(model))
        common.report(f"resume/{kind}", step == SAVE_AT, digest=common.digest(a), step=step)


def checkpoints(rank: int, root: str) -> None:
    recipes = docs_recipes()
    for kind, tx in checkpointed():
        whole, _, _ = nnx_train(tx, rank)
        model, optimizer, _ = nnx_train(tx, rank, steps=SAVE_AT)
        directory = os.path.join(root, kind, str(SAVE_AT))
        with file_writes.recording() as seen:
            recipes[f"save_{kind}_nnx"](directory, model, optimizer)
        model = MLP(nnx.Rngs(1))  # other values: the restore must replace them all
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        recipes[f"restore_{kind}_nnx"](directory, model, optimizer)
        step = int(optimizer.step[...])
        model, optimizer, _ = nnx_train(tx, rank, first=step, steps=STEPS - step, model=model,
                                        optimizer=optimizer)
        same(f"checkpoint/{kind}", params_of(model), params_of(whole),
             step=step, final_step=int(optimizer.step[...]), **seen)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--resume", action="store_true",
                        help="only restore --dir's checkpoints (saved by another number of "
                             "processes) and train on")
    args = parser.parse_args()
    herring_jax.initialize()
    rank, n = herring_jax.process_index(), herring_jax.process_count()
    if args.resume:
        resume(rank, args.dir)
        herring_jax.shutdown()
        return
    adamw = optax.adamw(1e-2)
    sgd = optax.sgd(0.05, momentum=0.9)
    txs = {
        "allreduce": optax.chain(herring_jax.allreduce_gradients(), adamw),
        "bf16": optax.chain(herring_jax.allreduce_gradients(compression="bf16"), sgd),
        "powersgd": optax.chain(herring_jax.powersgd(2), sgd),
        "topk": optax.chain(herring_jax.topk(0.1), sgd),
        "sharded": herring_jax.sharded_optimizer(adamw),
    }
    trained = {}
    for name, tx in txs.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, optimizer, losses = nnx_train(tx, rank)
        trained[name] = (params_of(model), optimizer)
        # herring_jax warns where a compressor would send everything exactly.
        said = [str(w.message) for w in caught if "herring_jax" in str(w.message)]
        same(f"{name}/nnx-vs-plain", trained[name][0], plain_train(tx, rank),
             loss_falls=losses[-1] < losses[0], losses=losses, warnings=said)
    same("allreduce/one-process", trained["allreduce"][0], one_process(adamw, n))
    same("sharded/vs-chain", trained["sharded"][0], trained["allreduce"][0])
    a, b = flat(trained["bf16"][0]), flat(one_process(sgd, n))
    moved = float(np.max(np.abs(b - flat(params_of(make_model())))))
    residual = flat(nnx.as_pure(trained["bf16"][1].opt_state)[0].residual)
    diff = float(np.max(np.abs(a - b)))
    common.report("bf16/vs-exact", diff <= BF16_TOLERANCE * moved and np.any(residual != 0),
                  digest=common.digest(a), max_diff=diff, relative=diff / moved,
                  residual_max=float(np.max(np.abs(residual))))
    checkpoints(rank, args.dir)
    herring_jax.shutdown()


if __name__ == "__main__":
    main()
