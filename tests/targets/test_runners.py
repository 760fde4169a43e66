"""convcheck.targets.runners: one class per kind of target, each tested on what it owns."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from convcheck.errors import UsageError
from convcheck.numerics.formats import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, TF32
from convcheck.targets.runners import PARITY_LOSS_SCALE, cross_entropy, op_class, runner_class, runner_classes
from convcheck.targets.runners.half import AmpBFloat16Runner, AmpFloat16Runner, CastRunner
from convcheck.targets.runners.float64 import Float64Runner
from convcheck.targets.runners.plain import EmulatedTF32Runner, FloatRunner, TF32Runner
from convcheck.targets.spec import Target, snapshot_global_flags

T = Target.parse
U32, U64, UTF32, UF16, UBF16 = FLOAT32, FLOAT64, TF32, FLOAT16, BFLOAT16


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _batch(n=4):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


# --- the registry ------------------------------------------------------------------------------

def test_every_mode_has_exactly_one_class_per_device():
    seen = {}
    for cls in runner_classes():
        for mode in cls.modes:
            for device in cls.devices:
                assert (device, mode) not in seen, (cls, seen.get((device, mode)))
                seen[(device, mode)] = cls
    assert len(runner_classes()) == 9


@pytest.mark.parametrize("spec, cls", [
    ("cpu", FloatRunner), ("cuda:1", FloatRunner), ("cuda:tf32", TF32Runner), ("cuda:no-tf32", TF32Runner),
    ("cpu:emulate-tf32", EmulatedTF32Runner), ("cpu:bf16", CastRunner), ("cuda:fp16", CastRunner),
    ("cuda:amp-fp16", AmpFloat16Runner), ("cpu:amp-bf16", AmpBFloat16Runner), ("cpu:float64", Float64Runner),
    ("cuda:float64", Float64Runner),
])
def test_each_spec_gets_its_runner(spec, cls):
    assert type(T(spec).runner) is cls
    assert T(spec).runner.target == T(spec)


def test_a_mode_on_the_wrong_device_says_where_it_runs():
    with pytest.raises(UsageError, match="exists only on cuda"):
        runner_class("cpu", "amp-fp16", "cpu:amp-fp16")
    with pytest.raises(UsageError, match="cpu or a cuda GPU"):
        T("mps:float64")


# --- precision models ----------------------------------------------------------------------------

@pytest.mark.parametrize("spec, matmul, conv, elementwise, working", [
    ("cpu", (U32, U32), (U32, U32), (U32, U32), U32),
    ("cpu:float64", (U64, U64), (U64, U64), (U64, U64), U64),
    ("cuda:tf32", (UTF32, U32), (UTF32, U32), (U32, U32), UTF32),
    ("cuda:no-tf32", (U32, U32), (U32, U32), (U32, U32), U32),
    ("cpu:emulate-tf32", (UTF32, U32), (UTF32, U32), (U32, U32), UTF32),
    ("cuda:bf16", (UBF16, U32), (UBF16, U32), (UBF16, UBF16), UBF16),
    ("cpu:fp16", (UF16, U32), (UF16, U32), (UF16, UF16), UF16),
    ("cuda:amp-fp16", (UF16, U32), (UF16, U32), (UF16, UF16), UF16),
    ("cpu:amp-bf16", (UBF16, U32), (UBF16, U32), (UBF16, UBF16), UBF16),
])
def test_precision_model(spec, matmul, conv, elementwise, working):
    p = T(spec).runner.precision
    assert (p.matmul.operand, p.matmul.accumulate) == matmul
    assert (p.conv.operand, p.conv.accumulate) == conv
    assert (p.elementwise.operand, p.elementwise.accumulate) == elementwise
    assert p.working == working and working.unit_roundoff == T(spec).unit_roundoff


def test_plain_cuda_follows_the_tf32_flags_on_a_tf32_gpu(monkeypatch):
    import convcheck.targets.runners.plain as plain

    from convcheck.targets.runners import preserved_global_flags

    monkeypatch.setattr(plain, "tensor_cores_have_tf32", lambda device: True)
    with preserved_global_flags():
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cuda.matmul.allow_tf32 = False
        p = T("cuda").runner.precision
        assert p.conv.operand == UTF32 and p.matmul.operand == U32  # FACTS.md: the stack's defaults
        torch.backends.cudnn.allow_tf32 = False
        assert T("cuda").runner.precision.working == U32
        torch.backends.cudnn.allow_tf32 = True
        monkeypatch.setattr(plain, "tensor_cores_have_tf32", lambda device: False)
        assert T("cuda").runner.precision.working == U32  # pre-Ampere: no TF32 at all


def test_op_classes():
    assert op_class(nn.Conv2d(1, 1, 3)) == "conv"
    assert op_class(nn.Linear(2, 2)) == "matmul"
    assert op_class(nn.ReLU()) == op_class(nn.BatchNorm2d(2)) == "elementwise"


# --- placing, forward+loss+backward --------------------------------------------------------------

@pytest.mark.parametrize("spec, dtype", [("cpu", torch.float32), ("cpu:bf16", torch.bfloat16),
                                         ("cpu:amp-bf16", torch.float32), ("cpu:float64", torch.float64)])
def test_place_and_cast_input(spec, dtype):
    r = T(spec).runner
    model = r.place(_mlp())
    assert all(p.dtype == dtype for p in model.parameters())
    x, y = _batch()
    assert r.cast_input(x).dtype == dtype
    assert r.cast_input(y).dtype == torch.int64  # labels only move


def test_amp_forward_runs_matmuls_in_bfloat16_and_the_loss_in_float32():
    r = T("cpu:amp-bf16").runner
    model = r.place(_mlp())
    out, loss = r.forward_loss(model, *_batch())
    assert out.dtype == torch.bfloat16
    assert loss.dtype == torch.float32
    r.backward(loss)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_cast_forward_loss_upcasts_half_logits():
    r = T("cpu:bf16").runner
    out, loss = r.forward_loss(r.place(_mlp()), *_batch())
    assert out.dtype == torch.bfloat16 and loss.dtype == torch.float32


def test_a_user_loss_is_called_with_output_and_target():
    seen = []

    def loss_fn(out, target):
        seen.append((out.shape, target.shape))
        return cross_entropy(out, target) * 2

    r = T("cpu").runner
    _, loss = r.forward_loss(r.place(_mlp()), *_batch(), loss_fn=loss_fn)
    assert seen == [(torch.Size([4, 3]), torch.Size([4]))]
    assert math.isfinite(float(loss.detach()))


def test_local_backward_returns_unscaled_gradients():
    """The fp16 AMP runner scales parity's backward by 2^16 and must divide it back out."""
    layer = nn.Linear(8, 3)
    x = torch.randn(4, 8)
    g = torch.randn(4, 3)
    import copy

    plain = T("cpu").runner.local_backward(copy.deepcopy(layer), (x,), g)
    scaled_runner = AmpFloat16Runner(T("cuda:amp-fp16"))
    assert scaled_runner.parity_loss_scale == PARITY_LOSS_SCALE == 2.0**16
    # Without a GPU autocast(cuda) is a no-op, so the arithmetic is float32 either way:
    # the two must agree to the rounding of a power-of-two scale (exactly).
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaled = scaled_runner.local_backward(layer, (x,), g)
    for name in plain:
        assert torch.equal(plain[name], scaled[name]), name


def test_optimizer_step_without_a_scaler():
    r = T("cpu").runner
    model = r.place(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    _, loss = r.forward_loss(model, *_batch())
    r.train_backward(loss, opt, None)
    scale, skipped = r.optimizer_step(opt, None)
    assert math.isnan(scale) and skipped is False
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_only_fp16_amp_makes_a_grad_scaler():
    for spec in ("cpu", "cpu:bf16", "cpu:amp-bf16", "cpu:float64", "cpu:emulate-tf32", "cuda:tf32"):
        assert T(spec).runner.make_grad_scaler() is None
        assert T(spec).runner.parity_loss_scale == 1.0


# --- flags -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["cpu", "cpu:emulate-tf32", "cpu:bf16", "cpu:amp-bf16", "cpu:float64",
                                  "cuda:tf32", "cuda:no-tf32"])
def test_every_runner_restores_the_flags_it_touched(spec):
    before = snapshot_global_flags()
    with T(spec).runner.applied():
        pass
    assert snapshot_global_flags() == before


def test_emulated_tf32_rounds_matmul_operands_only_inside():
    a, b = torch.randn(16, 32), torch.randn(32, 16)
    with T("cpu:emulate-tf32").runner.applied():
        inside = a @ b
    assert not torch.equal(inside, a @ b)


# --- the float64 runner (judge) -------------------------------------------------------------------

def test_judge_references_are_float64_on_its_device():
    j = T("cpu:float64").runner
    assert j.is_float64 and j.fast
    ref = j.reference(torch.ones(3, dtype=torch.bfloat16))
    assert ref.dtype == torch.float64 and ref.device == j.torch_device
    assert j.reference(torch.tensor([1, 2])).dtype == torch.int64
    layer = nn.Linear(2, 2)
    copy = j.reference_module(layer)
    assert copy is not layer and copy.weight.dtype == torch.float64
    assert layer.weight.dtype == torch.float32  # the original is untouched


def test_only_float64_runners_can_judge():
    assert [T(s).runner.is_float64 for s in ("cpu:float64", "cuda:float64", "cpu", "cpu:bf16")] == [
        True, True, False, False]


@pytest.mark.parametrize("capability, fast", [((9, 0), True), ((8, 0), True), ((7, 0), True), ((6, 0), True),
                                              ((10, 0), True), ((8, 6), False), ((8, 9), False), ((7, 5), False),
                                              ((12, 0), False)])
def test_fast_float64_gpus(monkeypatch, capability, fast):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert T("cuda:float64").runner.fast is fast
