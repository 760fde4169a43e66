"""``same_batches``: the data two runs fed at a step, each batch counted once - a closure the optimizer evaluates
several times a step (LBFGS stops at 8 evaluations in one run and runs 20 in the other) feeds one batch as often."""

from __future__ import annotations

from types import SimpleNamespace

from convcheck.diagnose.detectors.watched_data import same_batches


def _run(hashes, dtype="float32"):
    return SimpleNamespace(steps=[{"batch_sha256": hashes, "batch_rounded": [{"bfloat16": h + "r"} for h in hashes],
                                   "layers": {"fc": {"dtype": dtype}}}])


def test_one_batch_fed_by_8_and_by_20_closure_evaluations_is_the_same_data():
    assert same_batches(_run(["x"] * 8), _run(["x"] * 20), 0)


def test_other_batches_or_another_order_are_other_data():
    assert not same_batches(_run(["x", "y"]), _run(["x", "z"]), 0)
    assert not same_batches(_run(["x", "y"]), _run(["y", "x"]), 0)
    assert not same_batches(_run(["x"]), _run(["x", "y"]), 0)


def test_a_bfloat16_run_matches_by_its_rounded_batches():
    a = _run(["x"] * 3)
    b = SimpleNamespace(steps=[{"batch_sha256": ["x16"] * 5, "batch_rounded": [{"bfloat16": "xr"}] * 5,
                                "layers": {"fc": {"dtype": "bfloat16"}}}])
    assert same_batches(a, b, 0)
