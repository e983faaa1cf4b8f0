"""herring_jax: Herring's sharded parameter-server gradient reduction for JAX.

A process-local all-reduce that runs as an XLA FFI custom call over libfabric:
every process hosts a server shard, each buffer is cut into equal parts (one
per server), servers sum their part in rank order and send it back.

Examples:
  >>> import jax.numpy as jnp, herring_jax
  >>> herring_jax.initialize()                     # doctest: +SKIP
  >>> herring_jax.allreduce(jnp.ones(4), op="mean")  # doctest: +SKIP
"""

from herring_jax._src import fabric_env as _fabric_env

_fabric_env.prepare()  # before anything starts a thread; see fabric_env.py

from herring_jax._src.errors import HerringError as HerringError  # noqa: E402
from herring_jax._src.errors import herring_errors as herring_errors  # noqa: E402
from herring_jax._src.runtime import initialize as initialize  # noqa: E402
from herring_jax._src.runtime import shutdown as shutdown  # noqa: E402
from herring_jax._src.runtime import describe as describe  # noqa: E402
from herring_jax._src.runtime import stats as stats  # noqa: E402
from herring_jax._src.runtime import process_count as process_count  # noqa: E402
from herring_jax._src.runtime import process_index as process_index  # noqa: E402
from herring_jax._src.allreduce import allreduce as allreduce  # noqa: E402
from herring_jax._src.broadcast import broadcast as broadcast  # noqa: E402
from herring_jax._src.psum import pmean as pmean  # noqa: E402
from herring_jax._src.psum import psum as psum  # noqa: E402
from herring_jax._src.optax_transform import AllReduceGradientsState as AllReduceGradientsState  # noqa: E402
from herring_jax._src.optax_transform import CompressedGradientsState as CompressedGradientsState  # noqa: E402
from herring_jax._src.optax_transform import allreduce_gradients as allreduce_gradients  # noqa: E402
from herring_jax._src.powersgd import PowerSGDState as PowerSGDState  # noqa: E402
from herring_jax._src.powersgd import powersgd as powersgd  # noqa: E402
from herring_jax._src.topk import TopKState as TopKState  # noqa: E402
from herring_jax._src.topk import topk as topk  # noqa: E402

__version__ = "0.1.0"
