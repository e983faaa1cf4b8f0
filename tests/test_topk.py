"""herring_jax.topk: top-k sparsification with error feedback, step by step
and bitwise against its numpy model (tests/workers/topk_worker.py), on 2
processes and on 2 processes x 2 devices reduced over a mesh axis."""

import pytest

from multiproc import assert_all_ok, launch


@pytest.mark.parametrize("nproc,devices,args", [(2, 1, []), (2, 2, ["--axis"])],
                         ids=["processes", "mesh-axis"])
def test_topk_matches_the_numpy_model_on_every_worker(nproc, devices, args):
    run = launch("topk_worker.py", ["--steps", "3", *args], nproc=nproc, devices=devices)
    digests = assert_all_ok(run, expected_cases=4)
    # Every rank holds the same update at every step.
    assert all(len(d) == 1 for c, d in digests.items() if c.startswith("step")), digests


def test_topk_rejects_bad_fractions():
    import herring_jax
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\]"):
            herring_jax.topk(bad)


def test_topk_model_keeps_what_it_does_not_send():
    # The numpy model itself: one worker sends its k largest magnitudes and
    # keeps the rest, so update + residual is the gradient exactly.
    import numpy as np
    from herring_jax._src.transforms import topk as topk_lib
    g = np.array([0.5, -3.0, 2.0, 0.25, -1.0, 4.0, 0.0, -0.125], np.float32)
    update, [residual] = topk_lib.model_np([g], [np.zeros_like(g)], 0.25)
    assert update.tolist() == [0, -3.0, 0, 0, 0, 4.0, 0, 0]
    assert residual.tolist() == [0.5, 0, 2.0, 0.25, -1.0, 0, 0.0, -0.125]
    # Two workers: the mean of their top-k, each index summed in worker order.
    h = np.array([1.0, 0, 0, 0, 0, 0, 0, 8.0], np.float32)
    update, _ = topk_lib.model_np([g, h], [np.zeros_like(g)] * 2, 0.25)
    assert update.tolist() == [0.5, -1.5, 0, 0, 0, 2.0, 0, 4.0]
