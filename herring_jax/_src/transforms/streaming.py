"""Streaming DiLoCo (Douillard et al., "Streaming DiLoCo with overlapping
communication", 2025) for local_sgd: fragments synced in turn, and with
``delay >= 1`` each fragment's reduction overlapping the next inner steps.

The schedule, for F fragments, a period of H = `every` steps and a delay of
D steps (count: the step count after this step's inner update, 1, 2, ...):

  start  fragment f's pseudo-gradient, synced_f - (p_f + u_f) (this step's
         inner update included), is sent at the steps where
         ``count % H == f * H // F``;
  arrive with D = 0 at once: the fragment's parameters become the new synced
         ones, synced_f + o_f, where o_f is the outer step on the average;
         with D >= 1, D steps later (the fragment trains on meanwhile): the
         outer step uses the average of the pseudo-gradients taken at the
         start, and the fragment's parameters become
         ``mixing * p_f + (1 - mixing) * (synced_f + o_f)``, p_f the local
         parameters after that step's inner update: Streaming DiLoCo's
         merge of local and global parameters (its alpha). mixing = 0
         replaces them by the new global value, dropping the D steps of
         local progress; mixing > 0 keeps that share of them.

The other fragments go on with their inner updates. A D >= 1 reduction
starts in one execution of the step and ends in a later one
(async_reduce.py): its bytes are in the engine's memory meanwhile, and the
optimizer state holds its tokens and a copy of what it sent
(``Pending``), so that a checkpoint saved after any step resumes: where the
tokens name no start of this process (its start ran in an earlier life of
the process), the arriving step starts the reduction again from that copy,
under the same ticket on every process, and waits for it. The average, so
the result, is bitwise the one the uninterrupted run collected.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from typing import Any, NamedTuple

import optax

from herring_jax._src.collectives import async_reduce
from herring_jax._src.transforms.optax_transform import CompressedGradientsState


def fragment_leaves(params, fragments: int) -> list[int]:
    """Streaming's partition: the fragment (0 .. F-1) of each leaf of
    `params`, in ``jax.tree_util.tree_leaves`` order.

    Fragments are contiguous runs of leaves in that order (the layers of a
    model usually come in it), cut where the running byte count is nearest
    F equal shares: a leaf goes to the next fragment once its midpoint lies
    past the current fragment's share, and every fragment gets at least one
    leaf (so F may not exceed the number of leaves). Leaves are never split,
    so one large leaf makes its fragment larger than the others.
    """
    leaves = jax.tree_util.tree_leaves(params)
    if fragments > len(leaves):
        raise ValueError(f"herring_jax.local_sgd: fragments={fragments} but the parameters "
                         f"have {len(leaves)} leaves, and a fragment is a run of whole "
                         f"leaves: use at most {len(leaves)} fragments")
    sizes = [int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
             for x in leaves]
    total = max(sum(sizes), 1)
    out, f, before, members = [], 0, 0, 0
    for i, b in enumerate(sizes):
        # Midpoint past the share, compared in integers: 2F(before) + Fb > 2(f+1)total.
        past = 2 * fragments * before + fragments * b > 2 * (f + 1) * total
        if members and (past or len(sizes) - i == fragments - 1 - f):
            f, members = f + 1, 0
        out.append(f)
        before += b
        members += 1
    return out


def schedule(every: int, fragments: int, delay: int) -> np.ndarray:
    """The branch of each phase (count % every): f starts (or, with delay 0,
    syncs) fragment f, F + f collects fragment f, 2F does neither."""
    table = np.full(every, 2 * fragments, np.int32)
    for f in range(fragments):
        table[f * every // fragments] = f
        if delay:
            table[(f * every // fragments + delay) % every] = fragments + f
    return table


def local_sgd_in_flight(count, every: int, fragments: int = 1, delay: int = 0) -> bool:
    """Whether a fragment's reduction of ``local_sgd(..., delay=D)`` is in
    flight after a step: not in the parameters yet. Training that stops
    there ends without it (a checkpoint of the state saved then holds what
    was sent, and the resumed run applies it where the uninterrupted run
    would have).

    Args:
      count: the state's step count after the step (``opt_state.count``).
      every, fragments, delay: the transformation's.

    Returns:
      True where some fragment was sent in the last `delay` steps and has not
      arrived yet.

    Examples:
      >>> herring_jax.local_sgd_in_flight(4, every=4, fragments=2, delay=1)
      True
      >>> herring_jax.local_sgd_in_flight(5, every=4, fragments=2, delay=1)
      False
    """
    count = int(count)
    starts = [f * every // fragments for f in range(fragments)]
    return any(c >= 1 and c % every in starts for c in range(count - delay + 1, count + 1))


def check_delay(delay: int, every: int, fragments: int, axis_name) -> None:
    if not delay:
        return
    gap = every // fragments
    if delay >= gap:
        raise ValueError(
            f"herring_jax.local_sgd: delay={delay} must be less than every // fragments = "
            f"{gap}, the steps between two fragments' syncs, so that a fragment arrives "
            "before the next one starts and some steps have nothing in flight (where a "
            "checkpoint can be saved): use a smaller delay, fewer fragments or a longer "
            "period")
    if axis_name is not None:
        raise NotImplementedError(
            "herring_jax.local_sgd: delay >= 1 reduces across processes only (axis_name="
            "None) for now; inside shard_map use delay=0")


def init_outer(outer, params, fragments: int, delay: int):
    """The outer state: outer.init(params) for one fragment synced at once
    (the layout of local_sgd without streaming), else one state per fragment
    over the list of its leaves."""
    if fragments == 1 and not delay:
        return outer.init(params)
    leaves = jax.tree_util.tree_leaves(params)
    of = fragment_leaves(params, fragments)
    return tuple(outer.init([x for x, g in zip(leaves, of) if g == f])
                 for f in range(fragments))


class Pending(NamedTuple):
    """What local_sgd with a delay keeps of the fragments in flight.

    Attributes:
      tokens: for each fragment, its start's tokens (async_reduce's), one row
        per call (its float32 leaves, its other leaves): uint8[2, 8].
      sent: what the last fragment to start sent, one flat buffer per dtype
        of the parameters (sorted by name), each as long as the largest
        fragment's elements of that dtype: a resumed run starts the
        reduction again from it (one fragment is in flight at a time, as
        ``delay < every // fragments``, so the fragments share it).
    """

    tokens: Any
    sent: Any


def _payload_layout(leaves, fragments: int):
    """(dtypes, lengths, where): the dtypes of the sent buffers (sorted by
    name), each buffer's length, and where[i] = (buffer, offset) of leaf i's
    elements in its fragment's payload."""
    of = fragment_leaves(leaves, fragments)
    dtypes = sorted({np.dtype(x.dtype).name for x in leaves})
    fill = {(f, d): 0 for f in range(fragments) for d in dtypes}
    where = []
    for x, f in zip(leaves, of):
        d = np.dtype(x.dtype).name
        where.append((dtypes.index(d), fill[f, d]))
        fill[f, d] += int(x.size)
    lengths = [max(fill[f, d] for f in range(fragments)) for d in dtypes]
    return dtypes, lengths, where


def init_pending(params, fragments: int, delay: int):
    """The state of the fragments in flight (``Pending``); () with no delay,
    so that the state of local_sgd without streaming keeps its leaves."""
    if not delay:
        return ()
    dtypes, lengths, _ = _payload_layout(jax.tree_util.tree_leaves(params), fragments)
    return Pending(tokens=tuple(jnp.zeros((2, 8), jnp.uint8) for _ in range(fragments)),
                   sent=tuple(jnp.zeros((n,), d) for d, n in zip(dtypes, lengths)))


def streamed_update(u, params, state, count, *, every, fragments, delay, mixing, outer,
                    reducer, compression):
    """local_sgd's update with fragments or a delay: (update, synced, outer
    state, reduce state, pending tokens)."""
    p_leaves, treedef = jax.tree_util.tree_flatten(params)
    u_leaves = treedef.flatten_up_to(u)
    s_leaves = treedef.flatten_up_to(state.synced)
    feedback = isinstance(state.reduce, CompressedGradientsState)
    r_leaves = treedef.flatten_up_to(state.reduce.residual) if feedback else []
    of = fragment_leaves(params, fragments)
    members = [[i for i, g in enumerate(of) if g == f] for f in range(fragments)]

    def pseudo_of(idx, u_l, s_l):
        return [(s_l[i] - p_leaves[i]) - u_l[i] for i in idx]

    def outer_step(f, average, s_l, outer_states):
        synced_f = [s_l[i] for i in members[f]]
        o, outer_f = outer.update(average, outer_states[f], synced_f)
        states = tuple(outer_f if g == f else x for g, x in enumerate(outer_states))
        return o, optax.apply_updates(synced_f, o), states

    def sync(f, u_l, s_l, outer_states, r_l, pend):
        """Delay 0: reduce fragment f through the bucketed path and move it to
        the new synced parameters at once."""
        idx = members[f]
        sub = CompressedGradientsState([r_l[i] for i in idx]) if feedback else state.reduce
        average, sub = reducer.update(pseudo_of(idx, u_l, s_l), sub)
        o, new_f, outer_states = outer_step(f, average, s_l, outer_states)
        u_l, s_l, r_l = list(u_l), list(s_l), list(r_l)
        for j, i in enumerate(idx):
            u_l[i] = ((s_l[i] - p_leaves[i]) + o[j]).astype(u_l[i].dtype)
            s_l[i] = new_f[j]
            if feedback:
                r_l[i] = sub.residual[j]
        return u_l, s_l, outer_states, r_l, pend

    def groups_of(idx):
        """The fragment's non-empty leaves in two calls: float32 ones take the
        codec, the rest travel exact (as allreduce_gradients sends them)."""
        live = [i for i in idx if p_leaves[i].size]
        f32 = [i for i in live if np.dtype(p_leaves[i].dtype) == np.float32]
        rest = [i for i in live if i not in f32]
        return [(f32, compression), (rest, "none")]

    dtypes, lengths, where = _payload_layout(p_leaves, fragments) if delay else ([], [], [])

    def start(f, u_l, s_l, outer_states, r_l, pend):
        """Delay >= 1: send fragment f's pseudo-gradient under the ticket
        `count`, keep the tokens and a copy of what was sent; the fragment
        trains on."""
        idx = members[f]
        pseudo = dict(zip(idx, pseudo_of(idx, u_l, s_l)))
        r_l = list(r_l)
        tokens = list(pend.tokens[f])
        sent_of = {}
        for g, (group, codec) in enumerate(groups_of(idx)):
            if not group:
                continue
            lossy = feedback and codec != "none"
            sent = [jnp.ravel(pseudo[i] + r_l[i] if lossy else pseudo[i]) for i in group]
            sent_of.update(zip(group, sent))
            tokens[g] = async_reduce.start_reduction(sent, count, op="mean", codec=codec,
                                                     feedback=lossy)
        copies = []
        for k, (d, n) in enumerate(zip(dtypes, lengths)):
            parts = [sent_of[i] for i in idx if i in sent_of and where[i][0] == k]
            used = sum(int(b.size) for b in parts)
            copies.append(jnp.concatenate([*parts, jnp.zeros((n - used,), d)]))
        pend = Pending(tuple(jnp.stack(tokens) if g == f else x
                             for g, x in enumerate(pend.tokens)), tuple(copies))
        return list(u_l), list(s_l), outer_states, r_l, pend

    def arrive(f, u_l, s_l, outer_states, r_l, pend):
        """Delay >= 1: collect fragment f's average (started `delay` steps
        ago), take the outer step and merge it into the local parameters."""
        idx = members[f]
        average = {}
        ticket = count - delay
        for g, (group, codec) in enumerate(groups_of(idx)):
            if not group:
                continue
            like = [jax.ShapeDtypeStruct((p_leaves[i].size,), p_leaves[i].dtype) for i in group]
            token = pend.tokens[f][g]
            lossy = feedback and codec != "none"

            def collect(token=token, like=like, codec=codec, lossy=lossy):
                return async_reduce.finish_reduction(ticket, token, like, op="mean",
                                                     codec=codec, feedback=lossy)

            def again(token=token, like=like, codec=codec, group=group, lossy=lossy):
                # The start ran in an earlier life of the process (a restored
                # checkpoint): every process starts it again from its copy,
                # under the start's ticket, and waits for it (re-encoding the
                # same bytes loses the same, so the residual is as before).
                del token
                sent = [jax.lax.dynamic_slice_in_dim(pend.sent[where[i][0]], where[i][1],
                                                     p_leaves[i].size) for i in group]
                again_token = async_reduce.start_reduction(sent, ticket, op="mean",
                                                           codec=codec, feedback=lossy)
                return async_reduce.finish_reduction(ticket, again_token, like, op="mean",
                                                     codec=codec, feedback=lossy)

            got = jax.lax.cond(async_reduce.started(token) == 1, collect, again)
            average.update({i: g.reshape(p_leaves[i].shape) for i, g in zip(group, got)})
            if lossy:
                # What this process's encoding lost, as the engine encoded it
                # (allreduce_gradients' residual), kept for the fragment's
                # next start, which comes after this arrival.
                r_l = list(r_l)
                for i, lost in zip(group, got[len(group):]):
                    r_l[i] = lost.reshape(p_leaves[i].shape)
        average = [average[i] if i in average else jnp.zeros_like(p_leaves[i]) for i in idx]
        o, new_f, outer_states = outer_step(f, average, s_l, outer_states)
        u_l, s_l = list(u_l), list(s_l)
        for j, i in enumerate(idx):
            p, v = p_leaves[i], u_l[i]
            if mixing == 0:
                merged = (s_l[i] - p) + o[j]
            else:
                merged = (mixing * (p + v) + (1 - mixing) * new_f[j]) - p
            u_l[i] = merged.astype(v.dtype)
            s_l[i] = new_f[j]
        return u_l, s_l, outer_states, list(r_l), pend

    def stay(u_l, s_l, outer_states, r_l, pend):
        return list(u_l), list(s_l), outer_states, list(r_l), pend

    first = [(lambda *a, f=f: (start if delay else sync)(f, *a)) for f in range(fragments)]
    second = [(lambda *a, f=f: arrive(f, *a)) for f in range(fragments)] if delay else [
        stay] * fragments
    table = schedule(every, fragments, delay)
    which = jnp.asarray(table)[count % every]
    if delay:
        # Fragment 0's first arrival would come `delay` steps into training,
        # before anything started (its first start is at count = every).
        which = jnp.where((count <= delay) & (which >= fragments) & (which < 2 * fragments),
                          2 * fragments, which)
    # The count, so the branch, is the same on every worker: the reductions pair up.
    u_l, s_l, outer_state, r_l, pending = jax.lax.switch(
        which, [*first, *second, stay], u_leaves, s_leaves, state.outer, r_leaves,
        state.pending)
    reduce_state = (CompressedGradientsState(jax.tree_util.tree_unflatten(treedef, r_l))
                    if feedback else state.reduce)
    return (jax.tree_util.tree_unflatten(treedef, u_l),
            jax.tree_util.tree_unflatten(treedef, s_l), outer_state, reduce_state, pending)
