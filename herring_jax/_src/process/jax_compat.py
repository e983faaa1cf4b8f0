"""The one place herring_jax touches jax internals (jax._src and friends).

Checked against jax 0.10.2, 0.11.2 and 0.12.0.1 (SUPPORTED_JAX); if a newer
jax moves these, only this file changes.
"""

from __future__ import annotations

import functools
import re
import threading

import jax
import numpy as np

from herring_jax._src.process import install_dirs

# The jax releases whose private names below were read, and herring_jax
# tested with: 0.10 (the newest for Python 3.11; the whole suite on 0.10.2),
# 0.11 (lax compatibility, allreduce and optax on 0.11.2) and 0.12 (Python
# 3.12 and later; the whole suite on 0.12.0.1). Outside it any name below may
# have moved or changed its meaning, so importing fails rather than reducing
# wrongly.
SUPPORTED_JAX = ">=0.10,<0.13"
_MIN_JAX, _END_JAX = (0, 10), (0, 13)


def check_jax_version(version: str, where: str = "") -> None:
    """Raises ImportError, saying how to get a supported jax, for a jax
    version outside SUPPORTED_JAX."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match and _MIN_JAX <= (int(match[1]), int(match[2])) < _END_JAX:
        return
    found = f"jax {version}" + (f" ({where})" if where else "")
    raise ImportError(
        f"herring_jax supports jax {SUPPORTED_JAX}, but found {found}. Install a supported "
        f"one, pip install 'jax{SUPPORTED_JAX}' 'jaxlib{SUPPORTED_JAX}' (0.10.x on Python "
        "3.11, 0.12.x on Python 3.12 and later), then reinstall herring_jax against it "
        "(pip install --no-build-isolation . in its checkout); .ci/install.sh does both.")


# Before the private imports below: on an unknown jax they may be the first
# thing to fail, with a message that says nothing of versions.
check_jax_version(jax.__version__, jax.__file__)

from jax._src import ad_util as _ad_util  # noqa: E402
from jax._src import config as _config  # noqa: E402
from jax._src import core as _core  # noqa: E402
from jax._src import distributed as _distributed  # noqa: E402
from jax._src import sharding_impls as _sharding_impls  # noqa: E402
from jax._src import source_info_util as _source_info  # noqa: E402
from jax._src.interpreters import ad as _ad  # noqa: E402
from jax._src.interpreters import batching as _batching  # noqa: E402
from jax._src.interpreters import partial_eval as _pe  # noqa: E402
from jax._src.lax import parallel as _parallel  # noqa: E402


def distributed_client():
    """The jax.distributed client (key-value store), or None before initialize."""
    return _distributed.global_state.client


def hosts_coordination_service() -> bool:
    """Whether jax.distributed's coordination service runs in this process
    (process 0's): its exit ends every other process of the job."""
    return getattr(_distributed.global_state, "service", None) is not None


def computation_devices(ctx) -> list | None:
    """The devices of the computation being lowered, in mesh/assignment order.

    A single-device computation whose device is chosen at run time gives
    [None]. Returns None when jax lowers several devices without a concrete
    assignment.
    """
    axis_ctx = ctx.module_context.axis_context
    if isinstance(axis_ctx, _sharding_impls.SPMDAxisContext):
        return list(axis_ctx.mesh.devices.flat)
    if isinstance(axis_ctx, _sharding_impls.ShardingContext):
        if axis_ctx.device_assignment is None:
            # jax leaves single-device computations unassigned until run.
            return [None] if axis_ctx.num_devices == 1 else None
        return list(axis_ctx.device_assignment)
    devices = getattr(axis_ctx, "devices", None)
    return list(devices) if devices is not None else None


def take_module_counter(ctx, name: str, width: int) -> int:
    """Returns a counter scoped to the module being lowered and adds `width`.

    Kept in the module context's own per-module cache dict, so it starts at 0
    for every lowered module and needs no clean-up.
    """
    store = ctx.module_context.cached_primitive_lowerings
    value = store.get(name, 0)
    store[name] = value + width
    return value


# -- shard_map varying-axis (vma) bookkeeping ---------------------------------
# jax 0.10 tracks which mesh axes a value varies over (aval.mat.varying) when
# shard_map runs with check_vma=True; a psum result no longer varies over the
# reduced axes.

def _varying(aval) -> frozenset:
    mat = getattr(aval, "mat", None)
    return frozenset(getattr(mat, "varying", ()) or ())


def _unreduced(aval) -> frozenset:
    mat = getattr(aval, "mat", None)
    return frozenset(getattr(mat, "unreduced", ()) or ())


# Since jax 0.11 the type records which reduction an unreduced value awaits
# (mat.unreduced_kind: sum, max or min) and requires it to be None exactly
# when nothing is left unreduced; jax 0.10 has no such field.
_HAS_UNREDUCED_KIND = "unreduced_kind" in getattr(_core.ManualAxisType, "__slots__", ())


def drop_reduced_axes(aval, axes):
    """The aval of a psum result: no longer varying (nor unreduced) over `axes`."""
    varying, unreduced = _varying(aval), _unreduced(aval)
    if not (varying | unreduced).intersection(axes):
        return aval
    left = frozenset(a for a in unreduced if a not in axes)
    update = dict(varying=frozenset(a for a in varying if a not in axes), unreduced=left)
    if _HAS_UNREDUCED_KIND and not left:
        # Else update() keeps the operand's kind (sum) beside an empty
        # unreduced set, which jax 0.11 and later reject.
        update["unreduced_kind"] = None
    return aval.update(manual_axis_type=aval.mat.update(**update))


def unreduced_as_varying(aval, axes):
    """The aval of an operand unreduced over `axes` taken as varying over
    them: each device's partial sum as its own value (the type lax's
    unreduced_reduce_scatter gives its operand's data; no jax cast does it)."""
    unreduced = _unreduced(aval)
    left = frozenset(a for a in unreduced if a not in axes)
    update = dict(varying=_varying(aval) | frozenset(axes), unreduced=left)
    if _HAS_UNREDUCED_KIND and not left:
        update["unreduced_kind"] = None
    return aval.update(manual_axis_type=aval.mat.update(**update))


def varies_over_all(aval, axes) -> bool:
    """Whether `aval` is varying over every one of `axes` (check_vma=True)."""
    return _varying(aval).issuperset(axes)


def check_varying(aval, axes, api_name: str) -> None:
    """lax's check that a reduce-scatter's or all-gather's operand varies over
    the axes (where shard_map checks varying axes)."""
    if check_vma_enabled() and not varies_over_all(aval, axes):
        raise ValueError(
            f"{api_name} must be applied to a value that varies over {tuple(axes)} inside "
            f"jax.shard_map(..., check_vma=True); got {aval.str_short(True)}. Mark it "
            "varying first with jax.lax.pcast(x, axes, to='varying'), or pass "
            "check_vma=False to jax.shard_map")


def vary_over(x, axes):
    """`x`, marked varying over those of `axes` it does not vary over yet
    (check_vma=True; lax's insert_collective_pvary)."""
    if not check_vma_enabled():
        return x
    missing = tuple(a for a in axes if a not in _varying(jax.typeof(x)))
    return pvary(x, missing) if missing else x


def is_varying(aval, axes) -> bool:
    return bool(_varying(aval).intersection(axes))


def is_reduced(aval, axes) -> bool:
    mat = getattr(aval, "mat", None)
    return bool(frozenset(getattr(mat, "reduced", ()) or ()).intersection(axes))


def is_unreduced(aval, axes) -> bool:
    return bool(_unreduced(aval).intersection(axes))


def axis_state(aval, axes, api_name: str = "herring_jax.psum") -> str:
    """'varying', 'unreduced', 'reduced' or 'invarying' over `axes`, with lax's
    ValueError when the axes disagree, or when an unreduced operand awaits a
    max or min (unreduced_kind, jax 0.11 and later) rather than a sum."""
    state = _parallel._get_from(aval, tuple(axes), api_name)
    kind = getattr(aval.mat, "unreduced_kind", None)
    if state == "unreduced" and kind is not None and kind.name != "sum":
        # lax.psum's unreduced_psum refuses it too: summing partial maxima
        # would be a wrong answer, not a reduction.
        raise ValueError(f"{api_name} cannot accept args with unreduced_kind={kind}; "
                         "it sums, so the operand must be unreduced for a sum "
                         f"(got {aval.str_short(True)}); reduce it with jax.lax.pmax/pmin")
    return state


# -- lax behaviours that changed between the supported jax releases ----------
# There is no flag to ask, and the source of lax may be reformatted by any
# patch release; so each is told by tracing lax itself once, and a form no
# release is known to take fails loudly rather than guessing one.

_PROBE_AXIS = "herring_jax_probe"


def _traced_by_lax(body) -> list:
    """The equations (primitive name, params) of `body` traced inside a
    shard_map over an abstract 2-device mesh that does not check varying
    axes (as pmap and check_vma=False)."""
    from jax.sharding import PartitionSpec

    def equations(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn.primitive.name, eqn.params
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", value)
                if hasattr(inner, "eqns"):
                    yield from equations(inner)

    def trace():
        mesh = jax.sharding.AbstractMesh((2,), (_PROBE_AXIS,))
        f = jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec(),
                          check_vma=False)
        return list(equations(jax.make_jaxpr(f)(jax.ShapeDtypeStruct((4, 4), np.float32)).jaxpr))

    # On a thread of its own: the caller may be inside a trace, a shard_map
    # over another mesh or one that checks varying axes, all of which jax
    # keeps per thread and which would change (or refuse) this trace. An
    # abstract mesh and abstract inputs touch no device, so the first use may
    # come before jax.distributed.initialize.
    box: dict = {}

    def run():
        try:
            box["equations"] = trace()
        except Exception as e:  # noqa: BLE001 - handed to the caller below
            box["error"] = e

    thread = threading.Thread(target=run, name="herring_jax-lax-probe")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["equations"]


def _unknown_lax(what: str, found: str) -> RuntimeError:
    return RuntimeError(
        f"herring_jax cannot tell how jax {jax.__version__}'s {what} behaves: {found}, which "
        "matches the behaviour of no jax release herring_jax knows (tested: 0.10.2, 0.11.2, "
        "0.12.0.1). Rather than guess (a wrong guess gives wrong gradients or refuses valid "
        "calls), it stops: use one of those releases, or report this jax version to "
        "herring_jax")


@functools.cache
def invariant_gather_needs_check_vma() -> bool:
    """lax.all_gather(..., to='invarying') where shard_map does not check
    varying axes (check_vma=False, pmap): True where lax makes it a plain
    all_gather, whose transpose sums the cotangents (psum_scatter; jax 0.12);
    False where it stays invariant, each device taking its own block of the
    cotangent (jax 0.10 and 0.11)."""
    what = "lax.all_gather(..., to='invarying') without check_vma"
    try:
        names = [name for name, _ in _traced_by_lax(
            lambda v: jax.lax.all_gather(v, _PROBE_AXIS, to="invarying"))]
    except Exception as e:
        raise _unknown_lax(what, f"tracing it failed with {e!r}") from e
    if "all_gather_invariant" in names:
        return False
    if "all_gather" in names:
        return True
    raise _unknown_lax(what, f"lax bound {names}")


@functools.cache
def negative_scatter_dimension() -> bool:
    """lax.psum_scatter with a negative scatter_dimension: True where lax
    counts it from the end, as numpy (jax 0.11 and 0.12); False where it
    binds it negative and fails to lower it (jax 0.10)."""
    what = "lax.psum_scatter(..., scatter_dimension=-1)"
    try:
        dims = [params.get("scatter_dimension") for name, params in _traced_by_lax(
            lambda v: jax.lax.psum_scatter(v, _PROBE_AXIS, scatter_dimension=-1, tiled=True))
            if name == "reduce_scatter"]
    except Exception as e:
        raise _unknown_lax(what, f"tracing it failed with {e!r}") from e
    if dims == [1]:
        return True
    if dims == [-1]:
        return False
    raise _unknown_lax(what, f"lax bound reduce_scatter with scatter_dimension {dims}")


def check_vma_enabled() -> bool:
    """Whether the shard_map being traced checks varying axes (check_vma=True)."""
    return bool(_config._check_vma.value)


def auto_pcast_enabled() -> bool:
    return bool(_config.auto_pcast.value)


def check_axis_names(axes, api_name: str, like: str = "psum") -> None:
    """Raises lax's NameError for an axis name no enclosing transform binds:
    lax's own message first (code that matches lax's text keeps working),
    then herring's detail, naming `api_name` and the axes that are bound.

    `like`: whose message comes first, "psum" (lax.psum, pmean, pmax and pmin:
    "Found an unbound axis name: x. To fix this, please call psum under
    `jax.shard_map`.") or "axis_size" (lax.psum_scatter and all_gather, which
    ask the axis's size first: "unbound axis name: x").
    """
    try:
        # herring's name in lax's other refusals (jax 0.12's no_collectives).
        _parallel._check_axis_names(tuple(axes), api_name)
    except NameError:
        bound = [a for a in _core.unsafe_get_axis_names()]
        missing = [a for a in axes if not isinstance(a, int) and a not in bound]
        where = (f"the axes bound here (by jax.shard_map, pmap or vmap) are {bound}: check "
                 "the spelling" if bound else
                 "no axis is bound here: call it inside jax.shard_map (or jax.pmap) over a "
                 "mesh with that axis")
        first = missing[0] if missing else axes[0]
        raise NameError(f"{_lax_unbound_text(first, like).rstrip('.')}. {api_name}: "
                        f"unbound axis name(s) {missing}; {where}.") from None


def _lax_unbound_text(name, like: str) -> str:
    """lax's own text for the unbound axis `name`: lax.psum's check, or where
    lax asks the axis's size (all_gather, psum_scatter)."""
    try:
        if like == "psum":
            _parallel._check_axis_names((name,), "psum")
        else:
            _core.get_axis_env().axis_size(name)
    except NameError as e:
        return str(e)
    return f"unbound axis name: {name}"


def skip_one_sized_axes(axes) -> tuple:
    """Drops size-1 mesh axes where jax's config says lax.psum does."""
    return tuple(_parallel._maybe_skip_one_sized_axes(tuple(axes)))


def preduced(x, axes):
    return _parallel.preduced(x, tuple(axes))


# vmap: jax's batching rules that see the vmapped axis's name and size.
not_mapped = None  # the batch dimension of an unbatched value


def zero_tangent(primal):
    """A symbolic zero tangent for `primal` (ad.Zero of its tangent type)."""
    return _ad_util.p2tz(primal)


def zeros_of(aval):
    """Zeros of type `aval` (its varying axes and sharding too), as jax
    instantiates a symbolic zero tangent."""
    return _ad.instantiate_zeros(_ad.Zero(aval))


def transpose_jaxpr(closed_jaxpr, known, cts) -> list:
    """The cotangents of a linear ClosedJaxpr's inputs (None: zero) from its
    outputs' (arrays or symbolic zeros); `known`: the values of the inputs
    that are not transposed, None for those that are (jax.linear_transpose's
    own backward pass, without its check that each cotangent has its
    output's own type, which a reduced output's unreduced cotangent fails)."""
    primals = [_ad.UndefinedPrimal(a.to_ct_aval()) if k is None else k
               for a, k in zip(closed_jaxpr.in_avals, known)]
    outs = _ad.backward_pass(closed_jaxpr.jaxpr, True, closed_jaxpr.consts, primals, list(cts))
    return [None if k is not None or type(o) is _ad.Zero else o for o, k in zip(outs, known)]


def register_named_batcher(primitive, rule) -> None:
    """rule(axis_data, vals, dims, **params); axis_data has .name and .size."""
    _batching.fancy_primitive_batchers[primitive] = rule


def batch_jaxpr(closed_jaxpr, axis_data, in_dims):
    """`closed_jaxpr` batched over axis_data's axis with inputs batched at
    `in_dims` (None: unbatched): (the batched ClosedJaxpr, each output's
    batch dimension, None where the body's own batching leaves it unbatched,
    e.g. an all_gather over the vmapped axis)."""
    return _batching.batch_jaxpr2(closed_jaxpr, axis_data, tuple(in_dims))


def pvary(x, axes):
    return _core.pvary(x, axis_name=tuple(axes))


def axes_size(axes) -> int:
    return jax.lax.psum(1, tuple(axes))


def manual_mesh(ctx):
    """The mesh of the enclosing shard_map while lowering, or None."""
    axis_ctx = ctx.module_context.axis_context
    if isinstance(axis_ctx, _sharding_impls.SPMDAxisContext):
        return axis_ctx.mesh
    return None


def reduce_scatter_hlo(ctx, x, reducer, *, axes, groups, size):
    """A tiled reduce-scatter of 1-D `x` along dimension 0 over `groups`
    (axis_index_groups of `axes`, each of `size` devices), as lax lowers
    psum_scatter: XLA's own collective (NCCL on XLA:CUDA). `reducer`: lax's
    add_p, max_p or min_p. ctx's avals are x's and the result's."""
    return _parallel._reduce_scatter_lowering(
        reducer, ctx, x, scatter_dimension=0, axis_name=tuple(axes),
        axis_index_groups=groups, axis_size=size, tiled=True)


def all_gather_hlo(ctx, x, *, axes, groups, size):
    """A tiled all-gather of 1-D `x` along dimension 0 over `groups`, as lax
    lowers all_gather (reduce_scatter_hlo's other half)."""
    return _parallel._all_gather_lowering(
        ctx, x, all_gather_dimension=0, axis_name=tuple(axes), axis_index_groups=groups,
        axis_size=size, tiled=True)


def auto_axes(ctx) -> tuple:
    """The enclosing shard_map's mesh axes (of more than one device) that it
    leaves to the partitioner (not manual: axis_names= naming only some),
    while lowering."""
    axis_ctx = ctx.module_context.axis_context
    if not isinstance(axis_ctx, _sharding_impls.SPMDAxisContext):
        return ()
    return tuple(a for a in axis_ctx.mesh.axis_names
                 if a not in axis_ctx.manual_axes and axis_ctx.mesh.shape[a] > 1)


# -- where values are produced in the program being traced --------------------

def production_order(values) -> list[int] | None:
    """For values traced by jit (one trace), the position in the traced program
    of the equation that produced each (inputs and constants: -1), i.e. the
    order in which XLA's dataflow can have them ready. None when the values are
    not all tracers of one jaxpr trace (eager, or mixed traces)."""
    traces = {id(getattr(v, "_trace", None)) for v in values}
    if len(traces) != 1 or not all(isinstance(v, _pe.DynamicJaxprTracer) for v in values):
        return None
    frame = getattr(values[0]._trace, "frame", None)
    eqns = getattr(frame, "tracing_eqns", None)
    if eqns is None:
        return None
    index = {}
    for i, e in enumerate(eqns):
        e = e() if callable(e) and not isinstance(e, _pe.TracingEqn) else e
        if e is not None:
            index[id(e)] = i
    return [index.get(id(getattr(v, "parent", None)), -1) for v in values]


# -- where a call was written in the user's program ---------------------------

def user_call_site(ctx) -> str | None:
    """'train.py:42 (step)': the innermost frame of the user's own code that
    led to the equation being lowered, or None where jax kept no traceback."""
    traceback = getattr(ctx, "traceback", None)
    try:
        for frame in _source_info.user_frames(traceback):
            if not install_dirs.in_library(frame.file_name):
                name = frame.file_name.rsplit("/", 1)[-1]
                return f"{name}:{frame.start_line} ({frame.function_name})"
    except Exception:  # noqa: BLE001 - a description only; never fail a lowering for it
        return None
    return None


# -- effects ------------------------------------------------------------------

from jax._src import effects as _effects  # noqa: E402


class _HostStateEffect(_effects.Effect):
    """A call that changes state outside the program (a reduction started in
    one step and collected in a later one): its results may go unused, and
    jax must not drop it then. Unordered: nothing orders it but its data."""

    __str__ = lambda self: "HerringHostState"  # noqa: E731


HOST_STATE_EFFECT = _HostStateEffect()
for _allowed in (_effects.lowerable_effects, _effects.control_flow_allowed_effects,
                 _effects.custom_derivatives_allowed_effects, _effects.remat_allowed_effects):
    _allowed.add_type(_HostStateEffect)
