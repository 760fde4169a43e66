"""Issue 10's detection limits: a layer wrong by ~10x its healthy noise is flagged in every CPU
precision, and the healthy zoo is flagged nowhere (the injected-error sweep: ``sweep.py``;
the full table: ``benchmarks/floors.py sweep``)."""

from __future__ import annotations

import pytest
import torch

from convcheck.plan.seeded_data import load_batches
from convcheck.plan.models import resolve_model
from convcheck.measure.parity import run_parity
from convcheck.pipeline import initial_state, model_builder
from convcheck.targets.spec import Target

from .sweep import detection_limit

CPU_TARGETS = ("cpu", "cpu:bf16", "cpu:fp16", "cpu:amp-bf16", "cpu:emulate-tf32")


@pytest.mark.parametrize("target", CPU_TARGETS)
def test_a_conv_wrong_by_ten_times_its_noise_is_flagged(target):
    """K = 576 (64 channels, 3x3), as in the issue: the old u*sqrt(K) rule needed EPS of 0.1..1
    (300x+ the noise); the floor flags it within 10x."""
    lim = detection_limit(target, 64)
    assert lim.after <= 10, (lim.eps_after, lim.noise)
    assert lim.before >= 100  # the old rule, read from the same rows
    assert lim.eps_after < lim.eps_before


@pytest.mark.parametrize("target", ("cpu:bf16", "cpu:emulate-tf32"))
def test_wide_reductions_too(target):
    lim = detection_limit(target, 512, before=False)  # K = 4608
    assert lim.after <= 10, (lim.eps_after, lim.noise)


def _zoo(name, batch, shape=None):
    kw = dict(input_shape=shape, num_classes=10) if shape else {}
    m = resolve_model(name, **kw)
    b = load_batches(None, input_shape=m.input_shape, num_classes=m.num_classes, batch_size=batch,
                     num_batches=1, seed=0)
    return model_builder(m, initial_state(m, 0)), b.batches[0]


# float16 convolutions' backward on a CPU has no fast kernel (cifar_cnn: 40 s of its 44): slow there.
NO_FP16 = tuple(t for t in CPU_TARGETS if t != "cpu:fp16")


@pytest.mark.parametrize("name, batch, shape, targets", [
    ("lenet", 32, None, CPU_TARGETS),
    ("cifar_cnn", 16, None, NO_FP16),
    pytest.param("cifar_cnn", 16, None, ("cpu:fp16",), marks=pytest.mark.slow),
    pytest.param("resnet18", 4, (3, 64, 64), CPU_TARGETS, marks=pytest.mark.slow),
    pytest.param("resnet34", 2, (3, 64, 64), NO_FP16, marks=pytest.mark.slow),
    pytest.param("resnet50", 2, None, NO_FP16, marks=pytest.mark.slow),
])
def test_the_healthy_zoo_is_flagged_nowhere(name, batch, shape, targets):
    build, batch_ = _zoo(name, batch, shape)
    r = run_parity(build, batch_, [Target.parse(t) for t in targets])
    assert all(v is None for v in r.first_flagged.values()), r.flagged()[["target", "layer", "param", "intrinsic",
                                                                            "floor", "over_floor"]]
    # where the precision is reduced (floors above float32's), every row is within bound_factor x its
    # floor; float32 rows lean on the absolute term (their own error is up to ~10x their floor)
    reduced = r.layers[r.layers["floor"] > 1e-5]
    assert len(reduced) and (reduced["over_floor"] <= r.tolerances.bound_factor).all()
    assert torch.get_default_dtype() == torch.float32
