"""A reduction across processes that starts in one execution of a jitted step
and ends in a later one: ``start_reduction`` / ``finish_reduction``
(xla_ffi/async_pair.cc has the handlers).

Every other herring reduction starts and ends inside one XLA execution. These
two let a step hand buffers to herring's threads and go on (the next steps
compute while the bytes move), and a later step collect the result: local_sgd's
streaming fragments with ``delay >= 1``. A runtime int32 ``ticket`` (the step
count of the start: the same on every process) names the reduction across
processes; the start's token, which the caller keeps (in the optimizer state)
and hands to the done, finds it in this process. A done whose token names no
start of this process fails with an error that says so; ``started`` tells
beforehand whether a token names one (a caller that kept a copy of what it
sent can then start it again). XLA:CPU only: on
XLA:CUDA they raise NotImplementedError when lowered.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import mlir

from herring_jax._src.collectives import codecs
from herring_jax._src.process import jax_compat
from herring_jax._src.collectives import lowering
from herring_jax._src.process import runtime

_NOT_ON_CUDA = (
    "herring_jax's reductions across steps (local_sgd with delay >= 1) run on XLA:CPU only "
    "for now: their XLA:CUDA handlers do not exist yet. Use delay=0, or place the optimizer "
    "step on CPU devices")


def start_reduction(buffers, ticket, *, op: str = "mean", codec: str = "none",
                    feedback: bool = False):
    """Starts reducing `buffers` (arrays, one device per process) across the
    processes under `ticket` (an int32 scalar, the same on every process);
    returns its token (uint8[8]) at once. ``finish_reduction`` with the same
    ticket, that token, the buffers' shapes, op, codec and feedback in a later
    step gives the result. `feedback` (float32 buffers, a lossy codec): the
    done also gives what this process's encoding lost (allreduce.py's
    feedback). Inside jax.jit only."""
    if op not in ("sum", "mean"):
        raise ValueError(f"start_reduction: op must be 'sum' or 'mean', got {op!r}")
    codecs.check_codec(codec)
    buffers = [jnp.asarray(b) for b in buffers]
    return start_p.bind(jnp.asarray(ticket, jnp.int32), *buffers, op=op, codec=codec,
                        feedback=feedback)


def finish_reduction(ticket, token, like, *, op: str = "mean", codec: str = "none",
                     feedback: bool = False) -> list:
    """Waits for the reduction whose start returned `token` under `ticket`,
    of buffers shaped as `like` (arrays or ShapeDtypeStructs), and returns
    its results (with `feedback`, then one loss per buffer)."""
    avals = tuple((tuple(x.shape), np.dtype(x.dtype).name) for x in like)
    return done_p.bind(jnp.asarray(ticket, jnp.int32), jnp.asarray(token, jnp.uint8),
                       avals=avals, op=op, codec=codec, feedback=feedback)


def started(token):
    """Whether `token` names a start of this process whose result no done
    has collected yet (int32 scalar, 1 or 0): not so for a token restored
    from a checkpoint that an earlier process saved, nor for one whose done
    ran. Inside jax.jit only."""
    return known_p.bind(jnp.asarray(token, jnp.uint8))


# Both change what the engine holds (a start that nothing reads would
# otherwise be dropped by jax's dead-code elimination, and a done's results
# may go unused): they carry an effect.

def _start_abstract(ticket, *buffers, op, codec, feedback):
    del ticket, buffers, op, codec, feedback
    return lowering.TOKEN, {jax_compat.HOST_STATE_EFFECT}


def _done_abstract(ticket, token, *, avals, op, codec, feedback):
    del ticket, token, op, codec
    outs = [jax.core.ShapedArray(shape, np.dtype(dtype)) for shape, dtype in avals]
    return outs + (outs if feedback else []), {jax_compat.HOST_STATE_EFFECT}


def _known_abstract(token):
    del token
    # An effect: it reads the engine's table, which starts and dones change.
    return jax.core.ShapedArray((), np.int32), {jax_compat.HOST_STATE_EFFECT}


def _outside_jit(*args, **params):
    raise NotImplementedError("herring_jax's reductions across steps run inside jax.jit only")


def _lower_start(ctx, ticket, *buffers, platform, op, codec, feedback):
    if platform != "cpu":
        raise NotImplementedError(_NOT_ON_CUDA)
    avals = ctx.avals_in[1:]
    attrs = lowering._attributes(ctx, avals, platform="cpu", op=op, axes=None, groups=None,
                                 root=None, codec=codec, feedback=feedback)
    return lowering._call("herring_async_start", ctx, [ticket, *buffers], ctx.avals_in,
                          [lowering.TOKEN], attrs)


def _lower_done(ctx, ticket, token, *, platform, avals, op, codec, feedback):
    if platform != "cpu":
        raise NotImplementedError(_NOT_ON_CUDA)
    del feedback
    # The start's key describes the reduced buffers (not the losses after them).
    attrs = dict(comm=np.int64(runtime.state().handle),
                 key=np.int64(lowering.key(op, ctx.avals_out[:len(avals)], codec)))
    return lowering._call("herring_async_done", ctx, [ticket, token], ctx.avals_in,
                          ctx.avals_out, attrs)


def _lower_known(ctx, token, *, platform):
    if platform != "cpu":
        raise NotImplementedError(_NOT_ON_CUDA)
    return lowering._call("herring_async_known", ctx, [token], ctx.avals_in, ctx.avals_out,
                          dict(comm=np.int64(runtime.state().handle)))


start_p = jex_core.Primitive("herring_async_start")
start_p.def_effectful_abstract_eval(_start_abstract)
start_p.def_impl(_outside_jit)
done_p = jex_core.Primitive("herring_async_done")
done_p.multiple_results = True
done_p.def_effectful_abstract_eval(_done_abstract)
done_p.def_impl(_outside_jit)
known_p = jex_core.Primitive("herring_async_known")
known_p.def_effectful_abstract_eval(_known_abstract)
known_p.def_impl(_outside_jit)
for _platform in ("cpu", "cuda"):
    mlir.register_lowering(start_p, functools.partial(_lower_start, platform=_platform),
                           platform=_platform, cacheable=False)
    mlir.register_lowering(done_p, functools.partial(_lower_done, platform=_platform),
                           platform=_platform, cacheable=False)
    mlir.register_lowering(known_p, functools.partial(_lower_known, platform=_platform),
                           platform=_platform, cacheable=False)
