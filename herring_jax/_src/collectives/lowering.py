"""How a reduction becomes custom calls: the lowering of allreduce.py's
primitives on each platform (lower, lower_start).

XLA:CPU: one asynchronous call per reduction, ``herring_allreduce``; its
handler returns a future at once and herring's threads reduce. The buckets of
allreduce_gradients are reduced in place and then pass through one
``herring_join`` (join_cpu says why).

XLA:CUDA: a start and a done (xla_ffi/cuda_handlers.cc says why, and which of
XLA's rules they rely on). ``herring_allreduce_start`` takes the operands,
enqueues their copies to the host and returns a small token buffer;
``herring_allreduce_done`` takes that token first (the handler pairs the two
by the token's device address, so XLA must pass the very buffer: the done
reads it straight from the start, never through a copy), then any other
tokens it must wait for, and returns the reduced buffers. A reduction lowered
on its own emits its start and, right after it, its done; allreduce_gradients
emits every bucket's start first and makes every done take every start's
token (see allreduce.split_reductions), so that no done can be scheduled
before the last bucket's start. Reduce-scatters and all-gathers take the
same pair, their collective attribute saying which: the done returns results
of another size than the start's operands (1/G or G times them), which the
start's handler sizes its staging by.

Tests: under HERRING_TEST_DEVICE_DOUBLE=1 the XLA:CPU lowering is XLA:CUDA's,
to ``herring_double_allreduce_start`` / ``_done``: the same handler code
(xla_ffi/device_handlers.cc) with the device layer's CPU double as its device
(xla_ffi/double_handlers.cc). Their done also takes its start's operands
after the tokens, so that XLA:CPU keeps them while the double's stream may
still copy them (on XLA:CUDA the stream's order does that).
"""

from __future__ import annotations

import functools
import hashlib
import struct

import jax
import numpy as np
from jax.interpreters import mlir

from herring_jax._src.collectives import local_sum
from herring_jax._src.process import jax_compat
from herring_jax._src.process import knobs
from herring_jax._src.process import layout
from herring_jax._src.process import runtime
from herring_jax._src.process import timeline

OPS = {"sum": 0, "mean": 1, "max": 2, "min": 3}
# Wire codecs (engine/codec.h), in bits 24..31 of the op attribute
# (handler_common.h): how float32 data crosses between processes.
CODECS = {"none": 0, "bf16": 1, "fp16": 2, "int8": 3}
_OP_CODEC_SHIFT = 24
# Bit 32 of the op attribute asks for error feedback's losses (handler_common.h).
_OP_FEEDBACK_SHIFT = 32
_OP_BROADCAST = 4  # the op attribute of a broadcast from rank r is 4 + r (handler_common.h)
# The collective attribute (handler_common.h): what each device gets back.
COLLECTIVES = {"allreduce": 0, "reduce_scatter": 1, "all_gather": 2}
# The primitive's collectives that differ from these in their type only.
_ON_THE_WIRE = {"all_gather_invariant": "all_gather"}

# What a start returns for its done. Its bytes are never read (XLA:CUDA: the
# done uses only its address; XLA:CPU: it is a constant nobody uses); it is
# not empty, so that XLA gives every token its own address.
TOKEN = jax.core.ShapedArray((8,), np.uint8)


def key(op: str, avals, codec: str = "none", collective: str = "allreduce") -> int:
    """A stable 63-bit description of the call, compared across processes."""
    what = op if codec == "none" else f"{op}@{codec}"
    if collective != "allreduce":
        what = f"{collective}:{what}"
    text = what + ";" + ";".join(f"{np.dtype(a.dtype).name}{tuple(a.shape)}" for a in avals)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return struct.unpack("<q", digest)[0] & 0x3FFFFFFFFFFFFFFF


def next_slot(ctx) -> int:
    """Numbers the call sites of one lowered module: 0, 1, 2, ...

    XLA runs independent custom calls concurrently, in a different order on
    every process, so the engine matches reductions by what they are: the run
    (XLA's run id: the executable and its launch; or, under the launch identity,
    the instruction and its launch count, see xla_ffi/call_identity.cc), the
    call site (slot), the inlined copy
    of it (instance, numbered by the handler's instantiate stage: jax lowers a
    nested jitted function once per module and calls it from each of its call
    sites, so its copies share the slot), how often that ran before in the run
    (occurrence: loops) and the buffer. Lowering visits the call sites in
    program order, which is the same on every process. The primitives are
    registered uncacheable so that every call site gets here. Every attribute
    must be the same on every process (no process-local counter): XLA's run id
    derives from the executable's fingerprint (see layout.py), and the launch
    identity hashes the attributes.
    """
    return jax_compat.take_module_counter(ctx, "herring_jax.slot", 1)


def nonempty(avals) -> list[int]:
    """Operands the handlers see: zero-size ones need no reduction."""
    return [i for i, a in enumerate(avals) if np.prod(a.shape) > 0]


def zeros_for_empty(avals_out, kept) -> list:
    """The results of the operands left out: zero constants (None for the kept)."""
    return [None if i in kept else mlir.ir_constant(np.zeros(a.shape, a.dtype))
            for i, a in enumerate(avals_out)]


def _attributes(ctx, avals_in, *, platform, op, axes, groups, root, codec,
                collective="allreduce", feedback=False) -> dict:
    """The attributes every reducing call takes (handler_common.h's CallAttrs)."""
    state = runtime.state()
    plan = layout.plan(ctx, axes, groups, root is not None or collective != "allreduce",
                       platform)
    i64 = functools.partial(np.asarray, dtype=np.int64)
    call_key, slot = key(op, avals_in, codec, collective), next_slot(ctx)
    # For stall reports and errors only: the process's own table, never an
    # attribute (attributes must be the same on every process, see layout.py).
    site = jax_compat.user_call_site(ctx)
    if site:
        runtime.note_call_site(call_key, slot, site)
    timeline.note(call_key, slot, timeline.describe(op, avals_in, codec, collective, root), site)
    return dict(
        comm=np.int64(state.handle),
        op=np.int64((OPS[op] if root is None else _OP_BROADCAST + root)
                    | CODECS[codec] << _OP_CODEC_SHIFT | int(feedback) << _OP_FEEDBACK_SHIFT),
        key=np.int64(call_key),
        slot=np.int64(slot),
        device_procs=i64(plan.device_procs),
        device_locals=i64(plan.device_locals),
        device_groups=i64(plan.device_groups),
        group_streams=i64(plan.group_streams),
        group_ranks=i64(plan.group_ranks),
        group_offsets=i64(plan.group_offsets),
        collective=np.int64(COLLECTIVES[collective]),
        device_blocks=i64(plan.device_blocks))


def _call(name, ctx, operands, avals_in, avals_out, attrs, aliases=None):
    sub_ctx = ctx.replace(avals_in=list(avals_in), avals_out=list(avals_out))
    return jax.ffi.ffi_lowering(name, has_side_effect=True, operand_output_aliases=aliases)(
        sub_ctx, *operands, **attrs)


def reduce_cpu(ctx, operands, avals_in, avals_out, *, in_place=False, **params):
    """XLA:CPU: the one asynchronous call (operands all non-empty).

    in_place: each result takes its operand's buffer (the buckets of
    allreduce_gradients): see join_cpu for why. Where the operand is read
    again after the call (error feedback reads a bucket to find what its
    encoding lost), XLA copies it first. The engine reduces in place safely:
    each part's result arrives only after this process's contribution to it
    has been sent (or read), results are received apart and copied in after
    their header check (Job::results_staged), and the host stage overwrites a
    slice of its buffer only after the process that reads that slice has said
    it is done (host_stage.cc).
    """
    attrs = _attributes(ctx, avals_in, platform="cpu", **params)
    aliases = {i: i for i in range(len(operands))} if in_place else None
    return _call("herring_allreduce", ctx, operands, avals_in, avals_out, attrs, aliases)


def join_cpu(ctx, *args):
    """XLA:CPU: split.join_p, one call whose results alias its operands.

    XLA:CPU treats a custom call as synchronous when it schedules and assigns
    buffers, but runs it asynchronously, and its executor makes any later
    computation that writes a buffer an unfinished call reads or writes wait
    for that call. Left alone, XLA schedules each bucket's update right after
    its reduction, frees the bucket's buffer there and gives it to the rest of
    the backward pass, which then waits for that reduction: the buckets were
    reduced one after another with the backward pass held up behind each
    (BENCHMARKS.md, train_lm pinned). Reducing in place (reduce_cpu's
    in_place) and passing every bucket through this one call keeps each
    bucket's buffer live until every reduction has ended, so nothing the
    backward pass computes is placed in it. Zero-size operands pass around it.
    """
    kept = nonempty(ctx.avals_in)
    outs = list(args)
    if not kept:
        return outs
    avals = [ctx.avals_in[i] for i in kept]
    results = _call("herring_join", ctx, [args[i] for i in kept], avals, avals, {},
                    {j: j for j in range(len(kept))})
    for i, r in zip(kept, results):
        outs[i] = r
    return outs


def _double(platform) -> bool:
    """Whether `platform`'s reductions lower to XLA:CUDA's start and done run
    against the CPU double (tests, HERRING_TEST_DEVICE_DOUBLE)."""
    return platform == "cpu" and knobs.get("HERRING_TEST_DEVICE_DOUBLE")


def start_cuda(ctx, operands, avals_in, platform="cuda", **params):
    """XLA:CUDA (or the CPU double): the start of a reduction (operands all
    non-empty); its token."""
    attrs = _attributes(ctx, avals_in, platform=platform, **params)
    target = "herring_double_allreduce_start" if platform == "cpu" else "herring_allreduce_start"
    [token] = _call(target, ctx, operands, avals_in, [TOKEN], attrs)
    return token


def done_cuda(ctx, tokens, avals_out, *, op, codec, described, collective,
              platform="cuda", operands=(), avals_in=()):
    """XLA:CUDA: the done of the reduction whose start returned tokens[0], after
    every start that returned the other tokens. `described`: the start's
    operands, which its key describes (avals_out are the results: another size
    for a reduce-scatter or all-gather, and with error feedback the losses
    follow). On the CPU double (platform "cpu"), the start's operands follow
    the tokens."""
    attrs = dict(comm=np.int64(runtime.state().handle),
                 key=np.int64(key(op, described, codec, collective)))
    if platform != "cpu":
        return _call("herring_allreduce_done", ctx, tokens, [TOKEN] * len(tokens), avals_out,
                     attrs)
    return _call("herring_double_allreduce_done", ctx, [*tokens, *operands],
                 [TOKEN] * len(tokens) + list(avals_in), avals_out, attrs)


def token_constant():
    """A start that emitted nothing (XLA:CPU, or nothing to reduce)."""
    return mlir.ir_constant(np.zeros(TOKEN.shape, TOKEN.dtype))


# -- the primitives' lowering rules (registered by allreduce.py) --------------


def _on_the_wire(collective) -> str:
    """The collective attribute's name: XLA:CUDA's start and done run all
    three as XLA:CPU's call does (xla_ffi/device_handlers.cc)."""
    return _ON_THE_WIRE.get(collective, collective)


def _lower_transposed(ctx, *args, op):
    """The transpose of an allreduce: the identity, or 1/N for a mean."""
    n = layout.contributors(ctx)
    if op == "sum":
        return list(args)
    return mlir.lower_fun(lambda *xs: [x / np.asarray(n, x.dtype) for x in xs],
                          multiple_results=True)(ctx, *args)


def lower(ctx, *args, platform, reduction, axes, groups, transpose, root, codec, tokens, collective,
          feedback):
    """herring_allreduce on `platform` (allreduce.py's parameters)."""
    op = reduction
    own_tokens, args = args[:tokens], args[tokens:]
    avals_in, avals_out = ctx.avals_in[tokens:], ctx.avals_out
    if transpose:
        return _lower_transposed(ctx.replace(avals_in=avals_in), *args, op=op)
    wire = _on_the_wire(collective)
    num = len(avals_in)
    kept = nonempty(avals_in)
    # With error feedback the losses follow the results, one per operand.
    kept_all = kept + [num + i for i in kept] if feedback else kept
    outs = zeros_for_empty(avals_out, kept_all)
    if not kept:
        return outs
    operands = [args[i] for i in kept]
    kept_in = [avals_in[i] for i in kept]
    kept_out = [avals_out[i] for i in kept_all]
    params = dict(op=op, axes=axes, groups=groups, root=root, codec=codec, collective=wire,
                  feedback=feedback)
    split = local_sum.split_for(ctx, kept_in, on_device=platform != "cpu" or _double(platform),
                                **params)
    if split is not None:
        results = _lower_local_sum(ctx, split, operands, kept_in, kept_out, own_tokens,
                                   platform, params)
        for i, r in zip(kept_all, results):
            outs[i] = r
        return outs
    # The CPU double's done keeps its start's operands alive (see the top).
    double = dict(platform="cpu", operands=operands, avals_in=kept_in) if _double(platform) else {}
    if platform == "cpu" and not double:
        # Tokens order nothing here: XLA:CPU's one call is already asynchronous.
        # A bucket of allreduce_gradients (own tokens) is reduced in place
        # (join_cpu says why); a reduce-scatter or all-gather cannot be (its
        # result has another size).
        results = reduce_cpu(ctx, operands, kept_in, kept_out,
                             in_place=bool(own_tokens) and wire == "allreduce", **params)
    else:
        tokens = own_tokens or [start_cuda(ctx, operands, kept_in, platform=platform, **params)]
        results = done_cuda(ctx, tokens, kept_out, op=op, codec=codec, described=kept_in,
                            collective=wire, **double)
    for i, r in zip(kept_all, results):
        outs[i] = r
    return outs


def _lower_local_sum(ctx, split, operands, avals_in, avals_out, own_tokens, platform, params):
    """A reduction summed inside each process on its devices first
    (local_sum.py): the reduce-scatter, herring's start and done on the
    slices across processes, the all-gather. Where lower_start emitted the
    reduce-scatter and the start (XLA:CUDA's buckets), only the done and the
    all-gather."""
    mid = local_sum.middle(split, params)
    parts_in = local_sum.slice_avals(split, avals_in)
    done = dict(op=mid["op"], codec=mid["codec"], described=parts_in, collective=mid["collective"])
    if own_tokens and not _double(platform):
        parts = done_cuda(ctx, own_tokens, parts_in, **done)
    else:
        axes, op = params["axes"], params["op"]
        sliced = local_sum.scatter(ctx, split, axes, op, operands, avals_in,
                                   cpu=_double(platform))
        token = start_cuda(ctx, sliced, parts_in, platform=platform, **mid)
        double = (dict(platform="cpu", operands=sliced, avals_in=parts_in)
                  if _double(platform) else {})
        parts = done_cuda(ctx, [token], parts_in, **done, **double)
    return local_sum.gather(ctx, split, params["axes"], params["op"], parts, avals_out)


def lower_start(ctx, *args, platform, reduction, axes, groups, transpose, root, codec, collective,
                feedback):
    """herring_allreduce_start on `platform`: its token."""
    op = reduction
    del transpose
    wire = _on_the_wire(collective)
    kept = nonempty(ctx.avals_in)
    if (platform == "cpu" and not _double(platform)) or not kept:
        return [token_constant()]
    operands, avals = [args[i] for i in kept], [ctx.avals_in[i] for i in kept]
    params = dict(op=op, axes=axes, groups=groups, root=root, codec=codec, collective=wire,
                  feedback=feedback)
    split = local_sum.split_for(ctx, avals, on_device=True, **params)
    if split is not None:
        if _double(platform):
            return [token_constant()]  # the done lowers it all (local_sum.py says why)
        sliced = local_sum.scatter(ctx, split, axes, op, operands, avals, cpu=False)
        return [start_cuda(ctx, sliced, local_sum.slice_avals(split, avals), platform=platform,
                           **local_sum.middle(split, params))]
    return [start_cuda(ctx, operands, avals, platform=platform, **params)]
