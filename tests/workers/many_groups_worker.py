"""More groups in one psum than the wire has streams (63): psum over 'model'
with 65 data replicas inside one process (groups that never travel are not
limited) matches lax; with 2 processes, each 'data' group spans both
processes and reduces over the wire too."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import common  # noqa: E402
import herring_jax  # noqa: E402


def main() -> int:
    herring_jax.initialize()
    devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    # 'model' pairs inside a process, 'data' across everything.
    mesh = jax.sharding.Mesh(devices.reshape(-1, 2), ("data", "model"))
    spec = P("data", "model")
    shape = (mesh.devices.shape[0], 2 * 8)
    full = common.make_input("int32", int(np.prod(shape)), 0, 1).reshape(shape)
    x = jax.device_put(full, NamedSharding(mesh, spec))
    for axes in ("model", "data"):
        groups = mesh.devices.shape[0] if axes == "model" else 2
        f = {lib: jax.jit(jax.shard_map(lambda v, lib=lib: lib.psum(v, axes), mesh=mesh,
                                        in_specs=spec, out_specs=spec, check_vma=False))
             for lib in (herring_jax, jax.lax)}
        a, b = f[herring_jax](x), f[jax.lax](x)
        ok = all(np.array_equal(np.asarray(s.data), np.asarray(t.data))
                 for s, t in zip(a.addressable_shards, b.addressable_shards))
        common.report(f"psum-over-{axes}/{groups}-groups", ok)
    herring_jax.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
