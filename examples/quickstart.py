"""A first training script: a Flax MLP whose gradients herring_jax averages
across processes (each process trains on its own share of the data).

  herring-jax launch -n 2 -- python examples/quickstart.py
"""

import flax.linen as nn
import jax
import numpy as np
import optax
from sklearn.datasets import load_digits

import herring_jax

herring_jax.initialize()  # joins the job that herring-jax launch (or mpirun, srun) started
rank, n = herring_jax.process_index(), herring_jax.process_count()
digits = load_digits()
x = (digits.data / 16.0).astype(np.float32)[rank::n]  # this process's share
y = digits.target[rank::n]

model = nn.Sequential([nn.Dense(128), nn.relu, nn.Dense(10)])
params = model.init(jax.random.key(0), x[:1])  # the same key: the same start everywhere
tx = optax.chain(herring_jax.allreduce_gradients(), optax.adam(1e-3))
opt_state = tx.init(params)


@jax.jit
def step(params, opt_state, xb, yb):
    def loss_fn(p):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, xb), yb).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)  # averaged over the processes
    return optax.apply_updates(params, updates), opt_state, loss


for i in range(101):
    rows = np.random.default_rng([rank, i]).integers(0, len(x), 32)
    params, opt_state, loss = step(params, opt_state, x[rows], y[rows])
    if rank == 0 and i % 20 == 0:
        print(f"step {i:3d}  loss {float(loss):.3f}", flush=True)
herring_jax.shutdown()
