"""Bad input and lifecycle: each documented behaviour is exercised in a real job."""

import pytest

from multiproc import assert_all_ok, launch

CASES = ["before-initialize", "bad-dtype", "bad-dtype-in-psum", "bad-op", "int-mean",
         "bad-op-in-jit", "reinitialize-different", "reinitialize-same", "empty-tree",
         "zero-size-leaf", "non-finite", "scalar", "shutdown-twice"]


@pytest.mark.parametrize("nproc", [1, 2])
def test_documented_errors_and_edge_cases(nproc):
    run = launch("errors_worker.py", [], nproc=nproc)
    assert_all_ok(run, expected_cases=len(CASES))
    assert [r["case"] for r in run.results[0]] == CASES


def test_herring_errors_translates_only_herring_failures():
    import jax

    import herring_jax

    herring = "herring allreduce on rank 0: rank 1 has sent nothing"
    # XLA's prefix, once per computation the failure passed through, is dropped.
    msg = "INTERNAL: " + "Error dispatching computation: " * 3 + herring
    # Raised by jax when the step's result is awaited, or (ValueError) when the
    # call itself ran the step: a HerringError with herring's message and the
    # original's traceback, not chained to it (it says the same).
    for original in (jax.errors.JaxRuntimeError(msg), ValueError(msg)):
        with pytest.raises(herring_jax.HerringError) as info:
            with herring_jax.herring_errors():
                raise original
        assert str(info.value) == herring
        assert info.value.__suppress_context__ and info.value.__cause__ is None
        assert isinstance(info.value, jax.errors.JaxRuntimeError)
    # Anything else passes unchanged, also as a decorator.

    @herring_jax.herring_errors()
    def other():
        raise ValueError("INTERNAL: something else")

    with pytest.raises(ValueError) as info:
        other()
    assert type(info.value) is ValueError


def test_jaxlib_makes_herring_failures_herring_errors_once_translation_is_installed():
    # What initialize() installs: jaxlib makes a JaxRuntimeError of a failed
    # computation by calling the class, wherever a result is awaited.
    import jax

    import herring_jax
    from herring_jax._src.process.errors import install_error_translation

    herring = "herring allreduce on rank 0: rank 1 has sent nothing"
    msg = "INTERNAL: " + "Error dispatching computation: INTERNAL: " * 2 + herring
    install_error_translation()
    install_error_translation()  # twice is once
    made = jax.errors.JaxRuntimeError(msg)
    assert type(made) is herring_jax.HerringError and str(made) == herring, repr(made)
    # Anything else, and a HerringError made by name, as before.
    other = jax.errors.JaxRuntimeError("INTERNAL: something else")
    assert type(other) is jax.errors.JaxRuntimeError and str(other) == "INTERNAL: something else"
    named = herring_jax.HerringError("herring_jax.initialize() failed on rank 0 of 2: " + msg)
    assert str(named) == "herring_jax.initialize() failed on rank 0 of 2: " + msg
    with pytest.raises(jax.errors.JaxRuntimeError):
        raise made


def test_an_uncaught_herring_error_prints_its_message_first_and_the_libraries_frames_on_request():
    import jax
    import jax.numpy as jnp

    import herring_jax
    from herring_jax._src.process.errors import format_uncaught, install_error_translation

    install_error_translation()

    def fail():  # a frame of the program, under frames of jax's own code
        jax.tree_util.tree_map(lambda x: (_ for _ in ()).throw(jax.errors.JaxRuntimeError(
            "INTERNAL: herring allreduce on rank 0: rank 1 has sent nothing")), [jnp.ones(1)])

    with pytest.raises(herring_jax.HerringError) as info:
        fail()
    short = format_uncaught(info.value, verbose=False)
    assert short.startswith("herring_jax.HerringError: herring allreduce on rank 0: "), short
    assert "in fail" in short and "/jax/" not in short, short
    assert ("frame(s) in herring_jax and the libraries it works with "
            "(jax, jaxlib, optax, flax, orbax) left out") in short, short
    verbose = format_uncaught(info.value, verbose=True)
    assert verbose.startswith("Traceback") and "/jax/" in verbose, verbose


@pytest.mark.parametrize("provider", ["efa", "tpc;ofi_rxm"])
def test_an_unavailable_or_misspelt_provider_is_a_herring_error_naming_the_others(provider):
    # As a new user tries it: `herring-jax launch -n 1` with HERRING_FI_PROVIDER
    # set to a provider this machine lacks (efa off AWS) or a misspelt one.
    # Once, the communicator whose transport could not open shut that null
    # transport down: signal 11 instead of an error.
    import os
    import subprocess
    import sys

    program = ("import herring_jax\n"
               "try:\n"
               "    herring_jax.initialize()\n"
               "except herring_jax.HerringError as e:\n"
               "    print('HERRING_ERROR', e, flush=True)\n")
    proc = subprocess.run(
        [sys.executable, "-m", "herring_jax.launch", "-n", "1", "--", sys.executable, "-c",
         program],
        env={**os.environ, "JAX_PLATFORMS": "cpu", "HERRING_FI_PROVIDER": provider},
        cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True, text=True,
        timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "signal" not in output, output
    [line] = [x for x in proc.stdout.splitlines() if "HERRING_ERROR" in x]
    assert f"no libfabric provider '{provider}'" in line, line
    # The providers this machine has, by name; tcp;ofi_rxm is everywhere.
    assert "Providers available here: " in line and "tcp;ofi_rxm" in line, line
    available = line.split("Providers available here: ")[1].split(". ")[0].split(", ")
    assert provider not in available, line
