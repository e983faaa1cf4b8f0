"""Shared by the training examples: the data-parallel step over a mesh of all
devices of all processes, reducing gradients with herring_jax or with jax's
own collectives (`--reduce herring|native`)."""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import herring_jax
from checkpointing import Checkpoints, FullyShardedCheckpoints


def _steps(text: str) -> tuple[int, ...]:
    try:
        steps = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected steps like 100,150, got {text!r}") from None
    if any(s <= 0 for s in steps) or list(steps) != sorted(set(steps)):
        raise argparse.ArgumentTypeError(f"expected increasing positive steps, got {text!r}")
    return steps


def make_optimizer(args) -> optax.GradientTransformation:
    """What follows the gradient reduction: --optimizer at --lr, dropped 10x
    at each of --lr-drops (optax counts the updates, so a resumed run keeps
    its place in the schedule)."""
    lr = (optax.piecewise_constant_schedule(args.lr, {s: 0.1 for s in args.lr_drops})
          if args.lr_drops else args.lr)
    return optax.sgd(lr, momentum=0.9) if args.optimizer == "sgd" else optax.adamw(lr)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reduce", choices=["herring", "native", "none"], default="herring",
                        help="herring: herring_jax.allreduce_gradients; native: jax.lax.pmean; "
                             "none: no averaging (each process trains alone: the compute-only "
                             "baseline of the training benchmark)")
    parser.add_argument("--compression", choices=["none", "bf16", "fp16", "int8"],
                        default="none",
                        help="--reduce herring: wire codec of the gradients (with error "
                             "feedback); it applies where they cross between processes over "
                             "the transport (between hosts, or everywhere with "
                             "HERRING_HOST_STAGE=0)")
    parser.add_argument("--no-error-feedback", action="store_true",
                        help="with a lossy --compression: drop what each step's encoding "
                             "lost instead of adding it to the next step's gradients")
    parser.add_argument("--powersgd-rank", type=int, default=0,
                        help="--reduce herring: average the gradients with herring_jax.powersgd "
                             "of this rank instead of allreduce_gradients (0: off)")
    parser.add_argument("--powersgd-warmup", type=int, default=0,
                        help="with --powersgd-rank: average exactly for this many first steps")
    parser.add_argument("--powersgd-codec", choices=["none", "bf16", "fp16", "int8"],
                        default="none", help="with --powersgd-rank: wire codec of the factors")
    parser.add_argument("--powersgd-iterations", type=int, default=1,
                        help="with --powersgd-rank: power iterations per step")
    parser.add_argument("--topk-fraction", type=float, default=0.0,
                        help="--reduce herring: average the gradients with herring_jax.topk "
                             "sending this share of each leaf (with error feedback) instead of "
                             "allreduce_gradients (0: off)")
    parser.add_argument("--accordion", default=None, metavar="LIGHT,HEAVY",
                        help="--reduce herring: herring_jax.accordion between two reductions, "
                             "each none|bf16|fp16|int8 (allreduce_gradients' codec), "
                             "powersgd<rank>[-<codec>] or topk<fraction>, e.g. "
                             "powersgd4,powersgd1")
    parser.add_argument("--accordion-interval", type=int, default=10,
                        help="with --accordion: steps between two decisions")
    parser.add_argument("--accordion-eta", type=float, default=0.5,
                        help="with --accordion: the relative change of the norm that is critical")
    parser.add_argument("--sharded-optimizer", action="store_true",
                        help="--reduce herring: herring_jax.sharded_optimizer(optimizer) in place "
                             "of allreduce_gradients + optimizer: each device keeps and updates "
                             "1/N of the optimizer state")
    parser.add_argument("--fully-sharded", action="store_true",
                        help="--reduce herring: herring_jax.fully_sharded(optimizer): each "
                             "process holds 1/N of the parameters and of the optimizer state, "
                             "gathers the parameters bucket by bucket in the forward pass and "
                             "reduce-scatters the gradients (one device per process)")
    parser.add_argument("--reshard-after-forward", action="store_true",
                        help="with --fully-sharded: gather the parameters again in the backward "
                             "pass instead of keeping them from the forward pass")
    parser.add_argument("--prefetch", type=int, default=2,
                        help="with --fully-sharded: gathers let run ahead of the one the forward "
                             "pass waits for (0: none; -1: all at once)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32, help="examples per device per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--lr-drops", type=_steps, default=(), metavar="STEP[,STEP...]",
                        help="a step-decay schedule: the learning rate is multiplied by 0.1 "
                             "from each of these steps on (e.g. 100,150)")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                        help="what follows the gradient reduction in the optax chain (sgd: "
                             "with momentum 0.9, the setting of the PowerSGD paper; give it "
                             "its own --lr)")
    parser.add_argument("--pin", action="store_true",
                        help="pin this process to core (rank %% CPUs) before jax starts its "
                             "threads, which inherit it (the pinned runs of BENCHMARKS.md)")
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default=None,
                        help="save params and optimizer state here (orbax; --fully-sharded: "
                             "herring_jax.save_sharded, each process its chunks), and resume "
                             "from the latest checkpoint found there")
    parser.add_argument("--checkpoint-every", type=int, default=50,
                        help="steps between checkpoints (and one after the last step)")
    parser.add_argument("--kill-at-step", type=kill_plan, default=None,
                        metavar="STEP[:RANK][,...]",
                        help="fault injection for tests: the last process (or RANK) "
                             "SIGKILLs itself after STEP (then relaunch to resume); under "
                             "herring-jax launch --max-restarts, the k-th item applies to "
                             "restart k (HERRING_RESTART)")
    add_local_sgd_arguments(parser)


def add_local_sgd_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--local-steps", type=int, default=0,
                        help="--reduce herring: every device trains alone for this many steps "
                             "(the --optimizer), then the devices average their parameters' "
                             "change and --outer steps them (herring_jax.local_sgd; 0: off). "
                             "The reported loss is this process's own")
    parser.add_argument("--outer", choices=("sgd", "slowmo", "diloco"), default="diloco",
                        help="with --local-steps: the outer step. sgd: the average (Local "
                             "SGD); slowmo: slow momentum (herring_jax.slowmo, the base "
                             "learning rate --lr); diloco: Nesterov SGD (herring_jax.diloco)")
    parser.add_argument("--outer-lr", type=float, default=None,
                        help="with --local-steps: the outer learning rate (sgd, slowmo: 1.0; "
                             "diloco: 0.7)")
    parser.add_argument("--outer-momentum", type=float, default=None,
                        help="with --local-steps: slowmo's slow momentum (0.5) or diloco's "
                             "outer momentum (0.9)")
    parser.add_argument("--fragments", type=int, default=1,
                        help="with --local-steps: Streaming DiLoCo's fragments, synced in "
                             "turn (herring_jax.local_sgd's fragments)")
    parser.add_argument("--delay", type=int, default=0,
                        help="with --local-steps: the steps each fragment's reduction "
                             "overlaps before it is applied (local_sgd's delay; one device "
                             "per process)")
    parser.add_argument("--mixing", type=float, default=0.5,
                        help="with --delay: the share of the local parameters kept when a "
                             "fragment arrives (local_sgd's mixing)")


def kill_plan(text: str) -> list[tuple[int, int | None]]:
    """--kill-at-step's value: [(step, rank or None for the last), ...]."""
    plan = []
    for item in text.split(","):
        step, _, rank = item.partition(":")
        try:
            plan.append((int(step), int(rank) if rank else None))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected STEP or STEP:RANK items separated by commas, got {item!r}") from None
    return plan


def kill_now(args, step: int) -> bool:
    """Whether this process SIGKILLs itself after `step` (--kill-at-step): one
    kill per run, the k-th item in restart k, so that a restarted job that
    resumes before that step is not killed again at the same point."""
    if not args.kill_at_step:
        return False
    restart = int(os.environ.get("HERRING_RESTART", "0"))
    if restart >= len(args.kill_at_step):
        return False
    at, rank = args.kill_at_step[restart]
    return step == at and jax.process_index() == (
        jax.process_count() - 1 if rank is None else rank)


def compression_name(args) -> str:
    """The name train-bench's --codecs gives this run (-noef: a lossy codec
    without error feedback)."""
    name = _compression_name(args)
    return name + "-noef" if getattr(args, "no_error_feedback", False) else name


def _compression_name(args) -> str:
    if getattr(args, "fully_sharded", False):
        name = "fully-reshard" if args.reshard_after_forward else "fully"
        return name if args.compression == "none" else f"{name}-{args.compression}"
    local = local_sgd_name(args)
    if local:
        return local
    if getattr(args, "sharded_optimizer", False):
        return "sharded" if args.compression == "none" else f"sharded-{args.compression}"
    if args.topk_fraction:
        return f"topk{args.topk_fraction:g}"
    if getattr(args, "accordion", None):
        return "accordion-" + args.accordion.replace(",", "-")
    if not args.powersgd_rank:
        return args.compression
    name = f"powersgd{args.powersgd_rank}"
    if args.powersgd_codec != "none":
        name += f"-{args.powersgd_codec}"
    if args.powersgd_iterations != 1:
        name += f"-it{args.powersgd_iterations}"
    return name


def local_sgd_name(args) -> str | None:
    """train-bench's names of the --local-steps runs and of the compute-only one."""
    if args.reduce == "none":
        return "compute"
    if not getattr(args, "local_steps", 0):
        return None
    name = f"{'localsgd' if args.outer == 'sgd' else args.outer}{args.local_steps}"
    if getattr(args, "fragments", 1) > 1:
        name += f"f{args.fragments}"
    if getattr(args, "delay", 0):
        name += f"d{args.delay}"
    return name if args.compression == "none" else f"{name}-{args.compression}"


def setup(args) -> jax.sharding.Mesh:
    if args.no_error_feedback and args.compression == "none":
        raise SystemExit("--no-error-feedback turns off the error feedback of a lossy "
                         "--compression (bf16, fp16, int8); none is exact and has none")
    if args.pin:
        # The rank as herring-jax launch gives it: jax.distributed is not up yet.
        if "HERRING_PROCESS_ID" not in os.environ:
            raise SystemExit("--pin takes the rank from herring-jax launch (HERRING_PROCESS_ID), "
                             "which is not set here: start the job with herring-jax launch")
        rank = int(os.environ["HERRING_PROCESS_ID"])
        core = rank % os.cpu_count()
        os.sched_setaffinity(0, {core})
        print(f"process {rank} pinned to core {core}", flush=True)
    if args.reduce == "native":
        # lax.pmean across processes on CPU needs jax's gloo collectives.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    herring_jax.initialize()
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return jax.sharding.Mesh(np.array(devices), ("data",))


def make_fully_sharded_trainer(mesh, args, loss_fn, init_fn):
    """make_trainer's --fully-sharded form: a step over this process's own
    device and batch; `params` is the FullyShardedState (its chunks and the
    optimizer's), `opt_state` None. step.whole(params) gathers the whole
    parameters (a collective: every process calls it)."""
    if args.reduce != "herring" or args.topk_fraction or args.powersgd_rank or \
            args.sharded_optimizer:
        raise SystemExit("--fully-sharded takes --reduce herring, without --topk-fraction, "
                         "--powersgd-rank or --sharded-optimizer")
    if len(mesh.local_devices) != 1:
        raise SystemExit("--fully-sharded runs one device per process; this process has "
                         f"{len(mesh.local_devices)} (unset XLA_FLAGS' "
                         "--xla_force_host_platform_device_count)")
    optimizer = make_optimizer(args)
    fs = herring_jax.fully_sharded(optimizer, compression=args.compression,
                                   error_feedback=not args.no_error_feedback,
                                   reshard_after_forward=args.reshard_after_forward,
                                   prefetch=None if args.prefetch < 0 else args.prefetch)
    # The whole parameters exist only while init cuts out this process's chunks.
    state = jax.jit(lambda: fs.init(init_fn()))()

    def local_step(state, _unused, batch):
        loss, grads = fs.value_and_grad(loss_fn)(state, batch)
        return fs.apply_gradients(state, grads), None, herring_jax.allreduce(loss, "mean")

    step = jax.jit(local_step, donate_argnums=(0,))
    step.takes_local_batch = True
    step.whole = jax.jit(fs.gather)
    # Its checkpoints: each process its own chunks (save_sharded).
    shapes = jax.eval_shape(init_fn)
    step.checkpoints = lambda args: FullyShardedCheckpoints(args, fs, shapes)
    return state, None, step


def make_trainer(mesh, args, loss_fn, init_fn):
    """Returns (params, opt_state, step(params, opt_state, batch) -> (..., loss))."""
    if getattr(args, "fully_sharded", False):
        return make_fully_sharded_trainer(mesh, args, loss_fn, init_fn)
    if getattr(args, "local_steps", 0):
        return make_local_sgd_trainer(mesh, args, loss_fn, init_fn)
    if args.reduce == "herring":
        if getattr(args, "accordion", None):
            light, heavy = (reduction(name, args) for name in args.accordion.split(","))
            grad_tx = herring_jax.accordion(light, heavy, interval=args.accordion_interval,
                                            eta=args.accordion_eta, axis_name="data")
        elif args.topk_fraction:
            grad_tx = herring_jax.topk(args.topk_fraction, "data")
        elif args.powersgd_rank:
            grad_tx = herring_jax.powersgd(args.powersgd_rank, "data",
                                           warmup_steps=args.powersgd_warmup,
                                           codec=args.powersgd_codec,
                                           power_iterations=args.powersgd_iterations)
        else:
            grad_tx = herring_jax.allreduce_gradients(
                "data", compression=args.compression,
                error_feedback=not args.no_error_feedback)
        mean = herring_jax.pmean
    elif args.reduce == "native":
        grad_tx = optax.GradientTransformation(
            lambda p: optax.EmptyState(), lambda g, s, p=None: (jax.lax.pmean(g, "data"), s))
        mean = jax.lax.pmean
    else:
        grad_tx = optax.identity()
        def mean(x, _axis):
            return x
    optimizer = make_optimizer(args)
    tx = optax.chain(grad_tx, optimizer)
    state_spec = P()
    if args.sharded_optimizer:
        if args.reduce != "herring" or args.topk_fraction or args.powersgd_rank:
            raise SystemExit("--sharded-optimizer takes --reduce herring, without --topk-fraction "
                             "or --powersgd-rank")
        # The optimizer's state is sharded over the devices: each keeps its
        # chunks (a leading axis of one per device).
        tx = herring_jax.sharded_optimizer(optimizer, "data", compression=args.compression,
                                           error_feedback=not args.no_error_feedback)
        state_spec = P("data")

    def local_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, mean(loss, "data")

    # check_vma=False: gradients of the replicated parameters stay per-device
    # and the optax transformation averages them (pmap semantics).
    step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(), state_spec, P("data")),
                                 out_specs=(P(), state_spec, P()), check_vma=False),
                   donate_argnums=(0, 1))
    replicated = NamedSharding(mesh, P())
    params = jax.jit(init_fn, out_shardings=replicated)()
    opt_state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=state_spec,
                                      check_vma=False))(params)
    return params, opt_state, step


def reduction(name: str, args):
    """One of --accordion's reductions over "data", by name."""
    from herring_jax._src.collectives import codecs
    if name in codecs.CODECS:
        return herring_jax.allreduce_gradients("data", compression=name)
    if name.startswith("topk"):
        return herring_jax.topk(float(name[len("topk"):]), "data")
    if name.startswith("powersgd"):
        rank, _, codec = name[len("powersgd"):].partition("-")
        return herring_jax.powersgd(int(rank), "data", codec=codec or "none",
                                    warmup_steps=args.powersgd_warmup)
    raise SystemExit(f"--accordion: unknown reduction {name!r}; give none, bf16, fp16, int8, "
                     "powersgd<rank>[-<codec>] or topk<fraction>")


def accordion_note(opt_state) -> str:
    """--accordion's schedule so far, from rank 0's copy of the state."""
    def get(name):
        return int(optax.tree_utils.tree_get(opt_state, name).addressable_shards[0].data)
    return f"accordion light {get('light_steps')} heavy {get('heavy_steps')}"


def make_local_sgd_trainer(mesh, args, loss_fn, init_fn):
    """make_trainer for --local-steps: every device a worker of
    herring_jax.local_sgd, with parameters and optimizer state of its own
    between syncs (a leading axis of one per device, sharded over "data")."""
    if (args.reduce != "herring" or args.topk_fraction or args.powersgd_rank
            or args.sharded_optimizer or args.local_steps < 0):
        raise SystemExit("--local-steps takes a positive count and --reduce herring, without "
                         "--topk-fraction, --powersgd-rank or --sharded-optimizer")
    inner = make_optimizer(args)
    # A delayed fragment's reduction outlives the step, which herring does
    # across processes only: with one device per process the processes are
    # the workers, inside the shard_map as outside it.
    if args.delay and jax.local_device_count() != 1:
        raise SystemExit("--delay needs one device per process")
    kw = {"axis_name": None if args.delay else "data", "compression": args.compression,
          "error_feedback": not args.no_error_feedback,
          "fragments": args.fragments, "delay": args.delay, "mixing": args.mixing}
    if args.outer == "sgd":
        tx = herring_jax.local_sgd(inner, args.local_steps, optax.sgd(args.outer_lr or 1.0), **kw)
    elif args.outer == "slowmo":
        tx = herring_jax.slowmo(inner, args.local_steps, learning_rate=args.lr,
                                momentum=0.5 if args.outer_momentum is None
                                else args.outer_momentum,
                                slow_learning_rate=args.outer_lr or 1.0, **kw)
    else:
        tx = herring_jax.diloco(inner, args.local_steps, outer_learning_rate=args.outer_lr or 0.7,
                                outer_momentum=0.9 if args.outer_momentum is None
                                else args.outer_momentum, **kw)
    spec = P("data")

    def one(tree):
        return jax.tree_util.tree_map(lambda x: x[0], tree)

    def stack(tree):
        return jax.tree_util.tree_map(lambda x: x[None], tree)

    def local_step(params, opt_state, batch):
        p = one(params)
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        updates, opt_state = tx.update(grads, one(opt_state), p)
        # The loss of this device's own model, not averaged: a reduction
        # every step would make every step wait for the slowest process.
        return stack(optax.apply_updates(p, updates)), stack(opt_state), loss

    step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(spec, spec, spec),
                                 out_specs=(spec, spec, P()), check_vma=False),
                   donate_argnums=(0, 1))
    n = mesh.devices.size
    params = jax.jit(lambda: jax.tree_util.tree_map(
        lambda x: jax.numpy.broadcast_to(x, (n, *x.shape)), init_fn()),
        out_shardings=NamedSharding(mesh, spec))()
    opt_state = jax.jit(jax.shard_map(lambda p: stack(tx.init(one(p))), mesh=mesh,
                                      in_specs=spec, out_specs=spec, check_vma=False))(params)
    return params, opt_state, step


def local_params(params, args):
    """This process's first device's copy of the parameters."""
    local = jax.tree_util.tree_map(lambda a: a.addressable_shards[0].data, params)
    if getattr(args, "local_steps", 0):
        local = jax.tree_util.tree_map(lambda a: a[0], local)
    return local


def state_mib(opt_state) -> float:
    """MiB of optimizer state this process holds (every local device's copy or
    chunk)."""
    return sum(s.data.nbytes for leaf in jax.tree_util.tree_leaves(opt_state)
               for s in leaf.addressable_shards) / 2**20


def compile_step(step, *args):
    """The jitted step compiled ahead of time for these arguments, and its
    buffers as XLA plans them (per process). The loop then calls the compiled
    step: a `step.lower(...).compile()` next to calls of `step` itself would
    trace and compile the same program twice (about 3 s of CPU per process
    for train_lm's smallest model)."""
    compiled = step.lower(*args).compile()
    return compiled, step_memory(compiled)


def step_memory(compiled) -> str:
    """A compiled step's buffers as XLA plans them (per process)."""
    m = compiled.memory_analysis()
    if m is None:
        return "step memory n/a"
    mib = 2.0 ** 20
    return (f"step memory: arguments {m.argument_size_in_bytes / mib:.3f} MiB, outputs "
            f"{m.output_size_in_bytes / mib:.3f} MiB, temporaries "
            f"{m.temp_size_in_bytes / mib:.3f} MiB")


def global_batch(mesh, local_arrays):
    """Each process passes the rows of its own devices."""
    sharding = NamedSharding(mesh, P("data"))
    return tuple(jax.make_array_from_process_local_data(sharding, a) for a in local_arrays)


def params_digest(params) -> str:
    """sha256 of this process's copy of every parameter, in tree order."""
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(params):
        h.update(np.asarray(leaf.addressable_shards[0].data).tobytes())
    return h.hexdigest()[:16]


def in_flight_note(args, done: int) -> None:
    """Says so where a Streaming DiLoCo fragment is still in flight after the
    last step run: it is not in the parameters this run ends with."""
    if not (getattr(args, "local_steps", 0) and getattr(args, "delay", 0)):
        return
    if not herring_jax.local_sgd_in_flight(done, args.local_steps, args.fragments, args.delay):
        return
    where = (f"the checkpoint after step {done} in {args.checkpoint_dir} holds what it sent, "
             "and a run resumed from it (a larger --steps) applies it" if args.checkpoint_dir
             else "without --checkpoint-dir it is lost")
    print(f"note: a fragment's reduction was in flight after step {done} (--delay "
          f"{args.delay}): it is not in these final parameters; {where}", flush=True)


def train(mesh, args, params, opt_state, step, next_local_batch, report=None):
    """Runs the steps with progress output on rank 0, prints a summary line
    ("done: ...") and shuts herring_jax down; returns (params, losses, step_s).

    `next_local_batch(i)` must depend only on the step index i (and the
    process), so that a resumed run sees the batches an uninterrupted one would.
    """
    rank = jax.process_index()
    losses, times = [], []
    checkpoints = getattr(step, "checkpoints", Checkpoints)(args) if args.checkpoint_dir else None
    first = 0
    if checkpoints:
        # SIGTERM from now on: a save at the next step every process agrees on.
        herring_jax.catch_preemption()
        params, opt_state, first = checkpoints.restore(params, opt_state)
        if rank == 0 and first:
            print(f"resumed from the checkpoint after step {first} in {args.checkpoint_dir}",
                  flush=True)
    sent_before = herring_jax.stats()["bytes_sent"]  # setup() initialized herring_jax
    local = getattr(step, "takes_local_batch", False)
    whole = getattr(step, "whole", lambda p: p)
    memory = ""
    preempted = False
    for i in range(first, args.steps):
        batch = tuple(next_local_batch(i)) if local else global_batch(mesh, next_local_batch(i))
        if i == first:
            run, memory = compile_step(step, params, opt_state, batch)
        start = time.perf_counter()
        params, opt_state, loss = run(params, opt_state, batch)
        loss = float(loss)  # waits for the step
        times.append(time.perf_counter() - start)
        losses.append(loss)
        if checkpoints:
            checkpoints.maybe_save(i + 1, i == args.steps - 1, params, opt_state)
            if i < args.steps - 1 and checkpoints.stop_for_preemption(i + 1, params, opt_state):
                preempted = True
                break
        if kill_now(args, i):
            print(f"killing process {rank} after step {i} (--kill-at-step)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if i % args.log_every == 0 or i == args.steps - 1:
            # Every process gathers (fully sharded), rank 0 reports.
            view = whole(params) if report else None
        if rank == 0 and (i % args.log_every == 0 or i == args.steps - 1):
            extra = report(view) if report else ""
            if getattr(args, "accordion", None):
                sent = (herring_jax.stats()["bytes_sent"] - sent_before) / 2**20
                extra += f", {accordion_note(opt_state)}, sent {sent:.3f} MiB so far"
            recent = np.median(times[1:][-args.log_every:]) * 1e3 if len(times) > 1 else float("nan")
            print(f"step {i:4d}  loss {loss:.4f}  step {recent:.1f} ms  {extra}", flush=True)
    step_s = float(np.median(times[1:])) if len(times) > 1 else float("nan")
    # The mean too: steps that sync every H steps (local SGD) cost more than
    # the median step shows.
    mean_s = float(np.mean(times[1:])) if len(times) > 1 else float("nan")
    # What this process's transport sent per step (gradients, losses and
    # heartbeats; nothing of the host stage's memory reads).
    sent = herring_jax.stats()["bytes_sent"] - sent_before
    sent_mib = sent / max(1, args.steps - first) / 2**20
    if checkpoints:
        checkpoints.close()
    final = whole(params)
    held = state_mib(params) + (state_mib(opt_state) if opt_state is not None else 0.0)
    # A preempted run's processes have said where they saved; its "done" line
    # comes from the run that resumes.
    if rank == 0 and losses and not preempted:
        extra = report(final) if report else ""
        print(f"done: reduce={args.reduce} processes={jax.process_count()} final loss "
              f"{losses[-1]:.4f} (first {losses[0]:.4f}), {extra}, median step "
              f"{step_s * 1e3:.1f} ms, compression {compression_name(args)}, sent {sent_mib:.3f} MiB "
              f"per step, optimizer state {state_mib(opt_state if not local else params.inner):.3f} "
              f"MiB per process, params and optimizer state held {held:.3f} MiB per process, "
              f"{memory}, mean step {mean_s * 1e3:.1f} ms, params sha256 {params_digest(final)}",
              flush=True)
    elif rank == 0 and not preempted:
        print(f"done: nothing to train, the checkpoint is at step {first} of {args.steps}, "
              f"params sha256 {params_digest(final)}", flush=True)
    if rank == 0 and losses:
        in_flight_note(args, first + len(losses))
        if getattr(args, "accordion", None):
            print(f"{accordion_note(opt_state)} steps", flush=True)
    herring_jax.shutdown()
    if preempted:
        # Saved, not done: the launcher and a scheduler's retry loop resume it.
        sys.exit(herring_jax.PREEMPTED_EXIT_CODE)
    return params, losses, step_s
