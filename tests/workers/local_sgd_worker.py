"""local_sgd / slowmo / diloco checked on every rank, bitwise.

Cases (every rank reports each):
  h1/vs-allreduce: local_sgd(sgd(2^-3), every=1) (outer sgd(1.0)) gives the
    parameters of optax.chain(allreduce_gradients(), sgd(2^-3)), bitwise, on
    an MLP. The learning rate is a power of two so that scaling commutes
    with rounding: the mean of the workers' lr * g is then exactly lr times
    the mean of their g, as synchronous training computes it.
  donated: a step that donates the parameters and the state (init outside
    jit) runs and equals the same steps without donation.
  <preset>/model: local_sgd (inner sgd with momentum), slowmo (inner sgd)
    and diloco (inner adamw), every=3, equal a numpy model of the algorithm
    at every step (the inner updates by optax on each modelled worker's own
    trajectory; the pseudo-gradients, their mean in the engine's order, the
    outer step and the move to the synced parameters in numpy), and herring
    reduces at the sync steps only (its reduction counter).
  int8/model: diloco(compression="int8") with error feedback, one leaf of
    5000 elements (one fusion buffer), against the codec's numpy model
    (codecs.reduce_np); the residual is not zero.
  nnx/vs-plain, nnx/checkpoint: diloco(adamw) inside nnx.Optimizer equals
    the same transformation on a plain pytree; saved mid-period by
    docs/guides/checkpoints.md's save_plain_nnx (each process its own row:
    the parameters differ between syncs), restored into a fresh model and
    optimizer and trained on: bitwise the run without a checkpoint.
  linen/vs-plain: slowmo inside a Linen TrainState (apply_gradients) equals
    the same transformation on a plain pytree.
With --mesh (every device a worker, inside jax.shard_map over axis 'd'):
  mesh/<preset>/model: as <preset>/model, axis_name="d".

Run with XLA_FLAGS=--xla_backend_optimization_level=0 and
HERRING_HOST_STAGE=0 (tests/test_local_sgd.py says why).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402
from herring_jax._src.collectives import codecs  # noqa: E402
from herring_jax._src.transforms.local_sgd import slow_momentum  # noqa: E402

EVERY = 3
STEPS = 7            # two periods and one step into the third
SAVE_AT = 4          # a step inside the second period
SHAPES = {"a": (37,), "b": (5, 7)}
GAMMA, BETA, ALPHA = 0.05, 0.6, 1.0     # SlowMo's base lr, slow momentum, slow lr
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9     # DiLoCo's outer Nesterov SGD
DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guides" / "checkpoints.md"

f32 = np.float32


# -- the presets and their outer steps in numpy ---------------------------------

def presets(**kw):
    """name -> (transformation, inner, numpy outer step (avg, state) -> (o, state))."""
    def sgd1(avg, state):
        return f32(-1.0) * avg, state

    def slow(avg, u):
        u = f32(BETA) * (0 if u is None else u) + avg * f32(1 / GAMMA)
        return f32(-(ALPHA * GAMMA)) * u, u

    def nesterov(avg, m):
        m = avg + f32(OUTER_MOMENTUM) * (0 if m is None else m)
        return f32(-OUTER_LR) * (avg + f32(OUTER_MOMENTUM) * m), m

    local_inner = optax.sgd(0.05, momentum=0.9)
    slow_inner = optax.sgd(GAMMA)
    diloco_inner = optax.adamw(1e-2)
    return {
        "localsgd": (herring_jax.local_sgd(local_inner, EVERY, **kw), local_inner, sgd1),
        "slowmo": (herring_jax.slowmo(slow_inner, EVERY, learning_rate=GAMMA, momentum=BETA,
                                      slow_learning_rate=ALPHA, **kw), slow_inner, slow),
        "diloco": (herring_jax.diloco(diloco_inner, EVERY, outer_learning_rate=OUTER_LR,
                                      outer_momentum=OUTER_MOMENTUM, **kw), diloco_inner,
                   nesterov),
    }


def grads_np(worker: int, step: int, x: dict) -> dict:
    """A worker's gradient at a step: its own data plus a pull towards zero
    (so it depends on the parameters the worker holds)."""
    return {k: (common.make_input("float32", int(np.prod(s)), worker, step * 3 + i)
                .reshape(s) + f32(0.5) * x[k])
            for i, (k, s) in enumerate(sorted(SHAPES.items()))}


def start_params(shapes=SHAPES) -> dict:
    rng = np.random.default_rng(7)
    return {k: rng.normal(size=s).astype(f32) for k, s in sorted(shapes.items())}


class Model:
    """The algorithm in numpy for `groups` (the workers of each process, in
    the order the engine sums them), from the same start on every worker.
    With `fragments` (lists of leaf names), fragment f syncs alone at the
    steps where count % every == f * every // F."""

    def __init__(self, inner, outer_np, groups, codec: str = "none", grads=grads_np,
                 params=None, every: int = EVERY, fragments=None, delay: int = 0,
                 mixing: float = 0.5):
        self.inner, self.outer_np, self.groups, self.codec = inner, outer_np, groups, codec
        self.every, self.delay, self.mixing = every, delay, mixing
        self.pending = {}  # fragment -> its average, sent and not yet arrived
        self.grads = grads
        self.workers = [w for g in groups for w in g]
        start = params if params is not None else start_params()
        self.x = {w: dict(start) for w in self.workers}
        self.synced = dict(start)
        self.inner_state = {w: inner.init(start) for w in self.workers}
        self.outer_state = {k: None for k in start}
        self.residual = {w: {k: np.zeros_like(v) for k, v in start.items()}
                         for w in self.workers}
        self.fragments = fragments or [sorted(start)]
        self.update = jax.jit(inner.update)
        self.count = 0

    def due(self, delay: int = 0) -> int | None:
        """The fragment that syncs (delay: arrives) at the current count."""
        n = len(self.fragments)
        for f in range(n):
            start = self.count - delay
            if start >= 1 and start % self.every == f * self.every // n:
                return f
        return None

    def delayed_step(self, u) -> str | None:
        """Delay >= 1: this step's start ("s<f>") or arrival ("a<f>")."""
        f, g = self.due(), self.due(self.delay)
        before = {w: dict(self.x[w]) for w in self.workers}
        for w in self.workers:
            self.x[w] = {n: v + u[w][n] for n, v in self.x[w].items()}
        if f is not None:
            self.pending[f] = {n: self.mean(n, {w: (self.synced[n] - before[w][n]) - u[w][n]
                                                for w in self.workers})
                               for n in self.fragments[f]}
            return f"s{f}"
        if g is not None:
            average = self.pending.pop(g)
            m = f32(self.mixing)
            for n in self.fragments[g]:
                s = self.synced[n]
                o, self.outer_state[n] = self.outer_np(average[n], self.outer_state[n])
                for w in self.workers:
                    p = before[w][n]
                    merged = ((s - p) + o if self.mixing == 0
                              else (m * (p + u[w][n]) + f32(1 - self.mixing) * (s + o)) - p)
                    self.x[w][n] = p + merged
                self.synced[n] = s + o
            return f"a{g}"
        return None

    def step(self, k: int) -> int | None:
        """One step of every worker; the fragment synced at it (or None)."""
        u = {}
        for w in self.workers:
            out, self.inner_state[w] = self.update(self.grads(w, k, self.x[w]),
                                                   self.inner_state[w], self.x[w])
            u[w] = {n: np.asarray(v) for n, v in out.items()}
        self.count += 1
        if self.delay:
            return self.delayed_step(u)
        f = self.due()
        names = self.fragments[f] if f is not None else []
        for w in self.workers:
            self.x[w] = {n: v if n in names else v + u[w][n] for n, v in self.x[w].items()}
        for n in names:
            s = self.synced[n]
            pseudo = {w: (s - self.x[w][n]) - u[w][n] for w in self.workers}
            avg = self.mean(n, pseudo)
            o, self.outer_state[n] = self.outer_np(avg, self.outer_state[n])
            for w in self.workers:
                self.x[w][n] = self.x[w][n] + ((s - self.x[w][n]) + o)
            self.synced[n] = s + o
        return f

    def mean(self, name, pseudo):
        if self.codec == "none":
            return common.reference("float32", "mean", [[pseudo[w] for w in g]
                                                        for g in self.groups])
        assert all(len(g) == 1 for g in self.groups)
        sent = [pseudo[g[0]] + self.residual[g[0]][name] for g in self.groups]
        for g, v in zip(self.groups, sent):
            self.residual[g[0]][name] = v - codecs.roundtrip_np(self.codec, v)
        return codecs.reduce_np(self.codec, "mean", sent, len(sent))


def reductions() -> int:
    return int(herring_jax.stats()["reductions"])


def reduced_bytes() -> int:
    return int(herring_jax.stats()["bytes_reduced"])


def flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree_util.tree_leaves(tree)])


def train_step(tx):
    @jax.jit
    def step(g, state, p):
        updates, state = tx.update(g, state, p)
        return optax.apply_updates(p, updates), state
    return step


def against_model(case: str, tx, inner, outer_np, rank: int, nproc: int,
                  codec: str = "none", shapes=SHAPES, every: int = EVERY, fragments=None,
                  steps: int = STEPS, delay: int = 0, mixing: float = 0.5) -> None:
    params = start_params(shapes)
    grads = (lambda w, k, x: {n: common.make_input("float32", x[n].size, w, k).reshape(
        x[n].shape) + f32(0.5) * x[n] for n in x}) if shapes is not SHAPES else grads_np
    model = Model(inner, outer_np, [[r] for r in range(nproc)], codec, grads, params,
                  every, fragments, delay, mixing)
    p = jax.tree_util.tree_map(jnp.asarray, params)
    state = tx.init(p)
    step = train_step(tx)
    oks, reduced, synced_fragments = [], [], []
    run_bytes = reduced_bytes()
    for k in range(steps):
        before, bytes_before = reductions(), reduced_bytes()
        g = grads(rank, k, {n: np.asarray(v) for n, v in p.items()})
        p, state = step(g, state, p)
        f = model.step(k)
        synced_fragments.append(f)
        oks.append(common.bitwise_equal(flat(p), flat(model.x[rank])))
        if delay:
            # The reduction ends on herring's threads while later steps run:
            # its count is checked over the whole run below.
            reduced.append(True)
            continue
        # A sync reduces exactly its fragment's bytes (once), a step
        # without one nothing.
        want = 0 if f is None else 4 * sum(params[n].size for n in model.fragments[f])
        reduced.append((reductions() > before) == (f is not None)
                       and (codec != "none" or reduced_bytes() - bytes_before == want))
    extra = {}
    if delay:
        # Every start's bytes reduced once; each has arrived by the last step.
        sent = sum(4 * params[n].size for e in synced_fragments if e and e[0] == "s"
                   for n in model.fragments[int(e[1:])])
        extra["bytes_ok"] = codec != "none" or reduced_bytes() - run_bytes == sent
        oks.append(extra["bytes_ok"] and not model.pending)
    if codec != "none":
        residual = flat(state.reduce.residual)
        extra["residual_max"] = float(np.max(np.abs(residual)))
        oks.append(bool(np.any(residual != 0)))
    common.report(case, all(oks) and all(reduced), digest=common.digest(flat(p)),
                  steps_ok=oks, reduced_at_syncs_only=reduced, synced=synced_fragments,
                  max_diff=float(np.max(np.abs(flat(p) - flat(model.x[rank])))), **extra)


# -- Streaming: fragments synced in turn ----------------------------------------

# 148, 140, 80 and 48 bytes: two fragments of about 208 cut nearest at a | b c d.
FRAGMENT_SHAPES = {"a": (37,), "b": (5, 7), "c": (20,), "d": (3, 4)}
FRAGMENTS = [["a"], ["b", "c", "d"]]
FRAGMENT_EVERY, FRAGMENT_STEPS = 4, 9     # fragment 1 at counts 2 and 6, 0 at 4 and 8
INT8_SHAPES = {"a": (3000,), "b": (2000,), "c": (1000,)}


def fragment_cases(rank: int, nproc: int) -> None:
    for name, (_, inner, outer_np) in presets().items():
        outer = {"localsgd": None,
                 "slowmo": slow_momentum(GAMMA, BETA, ALPHA),
                 "diloco": optax.sgd(OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)}[name]
        tx = herring_jax.local_sgd(inner, FRAGMENT_EVERY, outer, fragments=2)
        against_model(f"fragments/{name}/model", tx, inner, outer_np, rank, nproc,
                      shapes=FRAGMENT_SHAPES, every=FRAGMENT_EVERY, fragments=FRAGMENTS,
                      steps=FRAGMENT_STEPS)
    _, inner, outer_np = presets()["diloco"]
    tx = herring_jax.diloco(inner, 3, outer_learning_rate=OUTER_LR,
                            outer_momentum=OUTER_MOMENTUM, compression="int8", fragments=3)
    against_model("fragments/int8/model", tx, inner, outer_np, rank, nproc, codec="int8",
                  shapes=INT8_SHAPES, every=3, fragments=[["a"], ["b"], ["c"]])


def delay_cases(rank: int, nproc: int) -> None:
    """Delay 1 with every preset (2 fragments, mixing 0.5), and delay 2 with
    int8 and error feedback (mixing 0: replace)."""
    for name, (_, inner, outer_np) in presets().items():
        outer = {"localsgd": None,
                 "slowmo": slow_momentum(GAMMA, BETA, ALPHA),
                 "diloco": optax.sgd(OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)}[name]
        tx = herring_jax.local_sgd(inner, FRAGMENT_EVERY, outer, fragments=2, delay=1,
                                   mixing=0.5)
        against_model(f"delay/{name}/model", tx, inner, outer_np, rank, nproc,
                      shapes=FRAGMENT_SHAPES, every=FRAGMENT_EVERY, fragments=FRAGMENTS,
                      steps=FRAGMENT_STEPS, delay=1, mixing=0.5)
    _, inner, outer_np = presets()["diloco"]
    tx = herring_jax.diloco(inner, 6, outer_learning_rate=OUTER_LR, outer_momentum=OUTER_MOMENTUM,
                            compression="int8", fragments=2, delay=2, mixing=0.0)
    against_model("delay/int8/model", tx, inner, outer_np, rank, nproc, codec="int8",
                  shapes=INT8_SHAPES, every=6, fragments=[["a"], ["b", "c"]], steps=14,
                  delay=2, mixing=0.0)


# -- H = 1 against the synchronous chain ---------------------------------------

def mlp_params():
    rng = np.random.default_rng(3)
    return {"w1": jnp.asarray(rng.normal(size=(13, 21)) * 0.3, jnp.float32),
            "b1": jnp.zeros(21, jnp.float32),
            "w2": jnp.asarray(rng.normal(size=(21, 3)) * 0.3, jnp.float32)}


def mlp_loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)


def batch(rank: int, step: int):
    rng = np.random.default_rng(1000 * rank + step)
    x = rng.normal(size=(16, 13)).astype(f32)
    return x, np.sin(x[:, :3] * 2).astype(f32)


def train_mlp(tx, rank: int, steps: int = STEPS):
    @jax.jit
    def step(p, state, x, y):
        updates, state = tx.update(jax.grad(mlp_loss)(p, x, y), state, p)
        return optax.apply_updates(p, updates), state

    p = mlp_params()
    state = tx.init(p)
    for k in range(steps):
        p, state = step(p, state, *batch(rank, k))
    return p


def donated(rank: int) -> None:
    """init outside jit, then steps that donate both the parameters and the
    state: the synced copy must be a buffer of its own."""
    tx = herring_jax.local_sgd(optax.sgd(0.1), every=2)

    def step(p, state, x, y):
        updates, state = tx.update(jax.grad(mlp_loss)(p, x, y), state, p)
        return optax.apply_updates(p, updates), state

    fast = jax.jit(step, donate_argnums=(0, 1))
    p = mlp_params()
    state = tx.init(p)
    for k in range(3):
        p, state = fast(p, state, *batch(rank, k))
    want = flat(train_mlp(tx, rank, steps=3))
    common.report("donated", flat(p).tobytes() == want.tobytes(), digest=common.digest(want))


def h1(rank: int) -> None:
    lr = 2.0 ** -3
    got = flat(train_mlp(herring_jax.local_sgd(optax.sgd(lr), every=1), rank))
    want = flat(train_mlp(optax.chain(herring_jax.allreduce_gradients(), optax.sgd(lr)), rank))
    moved = float(np.max(np.abs(want - flat(mlp_params()))))
    common.report("h1/vs-allreduce", got.tobytes() == want.tobytes() and moved > 0,
                  digest=common.digest(got), moved=moved,
                  max_diff=float(np.max(np.abs(got - want))))


# -- Flax: nnx.Optimizer with the docs' checkpoints, Linen's TrainState ----------

def docs_recipes() -> dict:
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    namespace: dict = {}
    for code in blocks:
        if "_nnx(directory, model, optimizer)" in code:
            exec(compile(code, str(DOCS), "exec"), namespace)
    return namespace


def flax_cases(rank: int, root: str) -> None:
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(13, 21, rngs=rngs)
            self.out = nnx.Linear(21, 3, rngs=rngs)

        def __call__(self, x):
            return self.out(jnp.tanh(self.hidden(x)))

    def loss_fn(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    @nnx.jit
    def nnx_step(model, optimizer, x, y):
        grads = nnx.grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)

    tx = herring_jax.diloco(optax.adamw(1e-2), EVERY)

    def nnx_train(first, steps, model=None, optimizer=None):
        model = model if model is not None else MLP(nnx.Rngs(0))
        optimizer = optimizer if optimizer is not None else nnx.Optimizer(model, tx, wrt=nnx.Param)
        for k in range(first, first + steps):
            nnx_step(model, optimizer, *batch(rank, k))
        return model, optimizer

    def params_of(model):
        return nnx.as_pure(nnx.state(model, nnx.Param))

    whole, _ = nnx_train(0, STEPS)
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    params = nnx.as_pure(params)

    @jax.jit
    def plain_step(params, state, x, y):
        grads = jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p), x, y))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    for k in range(STEPS):
        params, state = plain_step(params, state, *batch(rank, k))
    a, b = flat(params_of(whole)), flat(params)
    common.report("nnx/vs-plain", a.tobytes() == b.tobytes(), digest=common.digest(a))

    recipes = docs_recipes()
    model, optimizer = nnx_train(0, SAVE_AT)
    directory = os.path.join(root, "nnx", str(SAVE_AT))
    recipes["save_plain_nnx"](directory, model, optimizer)
    model = MLP(nnx.Rngs(1))  # other values: the restore must replace them all
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    recipes["restore_plain_nnx"](directory, model, optimizer)
    step = int(optimizer.step[...])
    count = int(nnx.as_pure(optimizer.opt_state).count)
    model, optimizer = nnx_train(step, STEPS - step, model, optimizer)
    b = flat(params_of(model))
    common.report("nnx/checkpoint", a.tobytes() == b.tobytes() and step == SAVE_AT
                  and count == SAVE_AT, digest=common.digest(b), step=step, count=count)

    import flax.linen as nn
    from flax.training import train_state

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(jnp.tanh(nn.Dense(21)(x)))

    net = Linen()
    variables = net.init(jax.random.key(0), jnp.zeros((1, 13)))
    tx = herring_jax.slowmo(optax.sgd(GAMMA), EVERY, learning_rate=GAMMA, momentum=BETA)
    ts = train_state.TrainState.create(apply_fn=net.apply, params=variables["params"], tx=tx)

    def linen_loss(p, x, y):
        return jnp.mean((net.apply({"params": p}, x) - y) ** 2)

    @jax.jit
    def linen_step(ts, x, y):
        return ts.apply_gradients(grads=jax.grad(linen_loss)(ts.params, x, y))

    @jax.jit
    def pytree_step(p, state, x, y):
        updates, state = tx.update(jax.grad(linen_loss)(p, x, y), state, p)
        return optax.apply_updates(p, updates), state

    p, state = variables["params"], tx.init(variables["params"])
    for k in range(STEPS):
        ts = linen_step(ts, *batch(rank, k))
        p, state = pytree_step(p, state, *batch(rank, k))
    a, b = flat(ts.params), flat(p)
    common.report("linen/vs-plain", a.tobytes() == b.tobytes() and int(ts.step) == STEPS,
                  digest=common.digest(a))


# -- inside shard_map: every device a worker ---------------------------------------

def mesh_case(name: str, rank: int) -> None:
    from jax.sharding import NamedSharding, PartitionSpec as P

    tx, inner, outer_np = presets(axis_name="d")[name]
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    devices = list(mesh.devices.flat)
    spec = NamedSharding(mesh, P("d"))
    groups = [[w for w, d in enumerate(devices) if d.process_index == r]
              for r in range(jax.process_count())]
    mine = groups[rank]
    model = Model(inner, outer_np, groups)

    def stacked(per_worker):
        """{name: (W, ...)} global arrays from this process's workers' trees."""
        return {n: jax.make_array_from_callback(
            (len(devices), *SHAPES[n]), spec,
            lambda index, n=n: per_worker[index[0].start][n][None]) for n in SHAPES}

    def local(tree):
        out = {w: {} for w in mine}
        for n, arr in tree.items():
            for shard in arr.addressable_shards:
                out[shard.index[0].start][n] = np.asarray(shard.data)[0]
        return out

    def one(tree):
        return jax.tree_util.tree_map(lambda x: x[0], tree)

    def stack(tree):
        return jax.tree_util.tree_map(lambda x: x[None], tree)

    def body(g, state, p):
        updates, state = tx.update(one(g), one(state), one(p))
        return stack(optax.apply_updates(one(p), updates)), stack(state)

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                                 check_vma=False))
    p = stacked({w: start_params() for w in mine})
    state = jax.jit(jax.shard_map(lambda p: stack(tx.init(one(p))), mesh=mesh,
                                  in_specs=P("d"), out_specs=P("d"), check_vma=False))(p)
    oks = []
    for k in range(STEPS):
        held = local(p)
        p, state = step(stacked({w: grads_np(w, k, held[w]) for w in mine}), state, p)
        model.step(k)
        held = local(p)
        oks.append(all(common.bitwise_equal(flat(held[w]), flat(model.x[w])) for w in mine))
    common.report(f"mesh/{name}/model", all(oks), steps_ok=oks,
                  digest=common.digest(np.concatenate([flat(held[w]) for w in mine])))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=None, help="checkpoints (the Flax cases)")
    parser.add_argument("--mesh", action="store_true",
                        help="only the presets inside shard_map, every device a worker")
    parser.add_argument("--cases", default="h1,presets,int8,flax,fragments,delay")
    args = parser.parse_args()
    herring_jax.initialize()
    rank, n = herring_jax.process_index(), herring_jax.process_count()
    cases = args.cases.split(",")
    if args.mesh:
        for name in presets():
            mesh_case(name, rank)
        herring_jax.shutdown()
        return
    if "h1" in cases:
        h1(rank)
        donated(rank)
    if "presets" in cases:
        for name, (tx, inner, outer_np) in presets().items():
            against_model(f"{name}/model", tx, inner, outer_np, rank, n)
    if "int8" in cases:
        _, inner, outer_np = presets()["diloco"]
        tx = herring_jax.diloco(inner, EVERY, outer_learning_rate=OUTER_LR,
                                outer_momentum=OUTER_MOMENTUM, compression="int8")
        against_model("int8/model", tx, inner, outer_np, rank, n, codec="int8",
                      shapes={"w": (5000,)})
    if "fragments" in cases:
        fragment_cases(rank, n)
    if "delay" in cases:
        delay_cases(rank, n)
    if "flax" in cases:
        flax_cases(rank, args.dir)
    herring_jax.shutdown()


if __name__ == "__main__":
    main()
