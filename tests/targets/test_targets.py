"""convcheck.targets.spec: the spec grammar, availability, flag restore, TF32 emulation."""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from convcheck.errors import ConvcheckError, TargetUnavailable, UsageError
from convcheck.numerics.formats import RNE, TF32
from convcheck.numerics.metrics import rel_l2
from convcheck.targets.spec import (
    CPU_JUDGE,
    EmulateTF32,
    Target,
    default_targets,
    parse_targets,
    round_to_tf32,
    runnable_targets,
    snapshot_global_flags,
)

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")

# Every spec of ARCHITECTURE.md's target table, plus combinations the grammar allows.
TABLE_SPECS = [
    "cpu", "cpu:float64", "cuda", "cuda:1", "cuda:tf32", "cuda:no-tf32", "cuda:amp-fp16",
    "cpu:amp-bf16", "cpu:bf16", "cpu:fp16", "cpu:emulate-tf32",
]
MORE_SPECS = ["cuda:0", "cuda:1:tf32", "cuda:amp-bf16", "cuda:bf16", "cuda:fp16", "cuda:float64", "mps", "mps:fp16"]
CPU_SPECS = [s for s in TABLE_SPECS if s.startswith("cpu")]


# --- spec grammar ------------------------------------------------------------------------

@pytest.mark.parametrize("spec", TABLE_SPECS + MORE_SPECS)
def test_every_spec_round_trips(spec):
    t = Target.parse(spec)
    assert str(t) == spec
    assert Target.parse(str(t)) == t


@pytest.mark.parametrize("spec, device, index, mode", [
    ("cpu", "cpu", None, "float32"),
    ("cpu:float64", "cpu", None, "float64"),
    ("cuda:1", "cuda", 1, "float32"),
    ("cuda:1:tf32", "cuda", 1, "tf32"),
    ("cuda:amp-fp16", "cuda", None, "amp-fp16"),
    ("cpu:emulate-tf32", "cpu", None, "emulate-tf32"),
])
def test_parse_fields(spec, device, index, mode):
    assert Target.parse(spec) == Target(device, index, mode)


@pytest.mark.parametrize("alias, canonical", [
    ("cpu:fp32", "cpu"), ("cpu:float32", "cpu"), ("cpu:float", "cpu"), ("cpu:f32", "cpu"),
    ("cpu:fp64", "cpu:float64"), ("cpu:double", "cpu:float64"), ("cpu:f64", "cpu:float64"),
    ("cpu:bfloat16", "cpu:bf16"), ("cpu:float16", "cpu:fp16"), ("cpu:half", "cpu:fp16"),
    ("cuda:amp", "cuda:amp-fp16"), ("CPU", "cpu"), ("  cuda:TF32 ", "cuda:tf32"),
])
def test_aliases_and_case(alias, canonical):
    t = Target.parse(alias)
    assert t == Target.parse(canonical)
    assert str(t) == canonical


def test_the_cpu_judge_is_cpu_float64():
    assert CPU_JUDGE == Target.parse("cpu:float64")
    assert CPU_JUDGE.runner.is_float64 and not Target.parse("cpu").runner.is_float64
    assert CPU_JUDGE.param_dtype == torch.float64


@pytest.mark.parametrize("spec, param, compute, u", [
    ("cpu", torch.float32, torch.float32, 2.0**-24),
    ("cpu:float64", torch.float64, torch.float64, 2.0**-53),
    ("cpu:bf16", torch.bfloat16, torch.bfloat16, 2.0**-8),
    ("cpu:fp16", torch.float16, torch.float16, 2.0**-11),
    ("cpu:amp-bf16", torch.float32, torch.bfloat16, 2.0**-8),
    ("cpu:emulate-tf32", torch.float32, torch.float32, 2.0**-11),
    ("cuda:tf32", torch.float32, torch.float32, 2.0**-11),
    ("cuda:no-tf32", torch.float32, torch.float32, 2.0**-24),
    ("cuda:amp-fp16", torch.float32, torch.float16, 2.0**-11),
])
def test_numeric_properties(spec, param, compute, u):
    t = Target.parse(spec)
    assert t.param_dtype == param
    assert t.compute_dtype == compute
    assert t.unit_roundoff == u
    assert t.ulp == 2 * u


def test_amp_and_grad_scaler_properties():
    assert Target.parse("cuda:amp-fp16").runner.parity_loss_scale == 2.0**16
    amp_bf16 = Target.parse("cpu:amp-bf16").runner
    assert amp_bf16.mixed_precision and amp_bf16.parity_loss_scale == 1.0
    assert not Target.parse("cpu:bf16").runner.mixed_precision
    assert amp_bf16.make_grad_scaler() is None


@pytest.mark.parametrize("spec", TABLE_SPECS + MORE_SPECS)
def test_describe_names_the_spec(spec):
    assert Target.parse(spec).describe().startswith(spec + " (")


@pytest.mark.parametrize("spec, wrong_part", [
    ("gpu", "'gpu'"),                 # unknown device
    ("tpu:bf16", "'tpu'"),
    ("cpu:fp8", "'fp8'"),             # unknown mode
    ("cuda:tf33", "'tf33'"),
    ("cpu:0", "device index"),        # index on cpu
    ("cpu:bf16:fp16", "more than one mode"),   # two modes
    ("cuda:tf32:no-tf32", "more than one mode"),
    ("cpu:tf32", "'tf32'"),           # cuda-only modes on the cpu
    ("cpu:no-tf32", "'no-tf32'"),
    ("cpu:amp-fp16", "'amp-fp16'"),
    ("cuda:tf32:1", "index"),         # index after the mode
    ("cuda:1:2", "index"),
    ("cuda:emulate-tf32", "emulate-tf32"),
])
def test_malformed_specs_name_the_wrong_part(spec, wrong_part):
    with pytest.raises(UsageError) as info:
        Target.parse(spec)
    msg = str(info.value)
    assert wrong_part in msg
    assert spec in msg or spec.split(":")[0] in msg
    assert "\n" not in msg


@pytest.mark.parametrize("spec, offered", [
    ("cpu:bf17", "did you mean 'cpu:bf16'?"),          # a near typo: the near mode, not the twelve
    ("cuda:1:tf23", "did you mean 'cuda:1:tf32'?"),
    ("cpu:emulate-tf31", "did you mean 'cpu:emulate-tf32'?"),
    ("ddp:cpu:2:bf17", "did you mean 'ddp:cpu:2:bf16'?"),
    ("cpuu", "did you mean 'cpu'?"),
    ("gpu:tf32", "did you mean 'cuda'?"),
])
def test_a_near_typo_is_offered_its_nearest_spelling(spec, offered):
    with pytest.raises(UsageError) as info:
        Target.parse(spec)
    msg = str(info.value)
    assert offered in msg and "\n" not in msg
    assert "expected one of float32" not in msg


def test_a_far_mode_lists_every_mode():
    with pytest.raises(UsageError, match="expected one of float32, ") as info:
        Target.parse("cpu:int4")
    assert "did you mean" not in str(info.value)


def test_cuda_only_mode_message_says_cuda():
    with pytest.raises(UsageError, match="only on cuda"):
        Target.parse("cpu:tf32")
    with pytest.raises(UsageError, match="no device index|takes no"):
        Target.parse("cpu:0")


@pytest.mark.parametrize("spec", ["", "   ", "cpu:", "cuda::tf32", "cuda:\u00b2", "cuda:-1", "cuda:1.5"])
def test_odd_specs_are_usage_errors_not_crashes(spec):
    with pytest.raises(UsageError):
        Target.parse(spec)


def test_usage_errors_exit_2():
    assert UsageError("x").exit_code == 2 and TargetUnavailable("x").exit_code == 2
    assert issubclass(TargetUnavailable, ConvcheckError)


def test_parse_targets_needs_two_distinct_targets():
    a, b = parse_targets("cpu, cpu:bf16")
    assert (str(a), str(b)) == ("cpu", "cpu:bf16")
    with pytest.raises(UsageError, match="exactly two"):
        parse_targets("cpu")
    with pytest.raises(UsageError, match="exactly two"):
        parse_targets("cpu,cpu:bf16,cpu:fp16")
    with pytest.raises(UsageError, match="same target twice"):
        parse_targets("cpu,cpu:fp32")
    with pytest.raises(UsageError, match="'fp8'"):
        parse_targets("cpu,cpu:fp8")


# --- availability -------------------------------------------------------------------------

@pytest.mark.parametrize("spec", CPU_SPECS)
def test_cpu_targets_are_available(spec):
    t = Target.parse(spec)
    assert t.is_available()
    t.check_available()
    assert spec in runnable_targets()


@no_gpu
@pytest.mark.parametrize("spec", ["cuda", "cuda:1", "cuda:tf32", "cuda:amp-fp16"])
def test_cuda_without_a_gpu_is_a_clear_error_listing_runnable_targets(spec):
    t = Target.parse(spec)
    assert not t.is_available()
    with pytest.raises(TargetUnavailable) as info:
        t.check_available()
    msg = str(info.value)
    assert spec in msg and "cannot run here" in msg
    for runnable in ("cpu", "cpu:float64", "cpu:bf16", "cpu:emulate-tf32"):
        assert runnable in msg
    assert "cuda" not in msg.split("targets that can:")[1]
    assert "\n" not in msg


def test_default_targets_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    targets, note = default_targets()
    assert [str(t) for t in targets] == ["cpu", "cpu:emulate-tf32"]  # what a GPU's TF32 would do (issue 44)
    assert note and "no GPU" in note and "cpu:emulate-tf32" in note and "\n" not in note


def test_default_targets_with_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    targets, note = default_targets()
    assert [str(t) for t in targets] == ["cpu", "cuda"]
    assert note is None


# --- applying a target restores every flag --------------------------------------------------

@pytest.mark.parametrize("spec", CPU_SPECS + ["cuda:tf32", "cuda:no-tf32"])
def test_flags_unchanged_after_applied(spec):
    before = snapshot_global_flags()
    rng = torch.random.get_rng_state()
    with Target.parse(spec).applied():
        pass
    assert snapshot_global_flags() == before
    assert torch.equal(torch.random.get_rng_state(), rng)


@pytest.mark.parametrize("spec", CPU_SPECS + ["cuda:tf32"])
def test_flags_restored_after_an_exception_inside(spec):
    before = snapshot_global_flags()
    with pytest.raises(RuntimeError, match="boom"):
        with Target.parse(spec).applied():
            torch.set_default_dtype(torch.float64)
            torch.set_grad_enabled(False)
            torch.backends.cudnn.benchmark = not before["cudnn.benchmark"]
            torch.set_float32_matmul_precision("medium")
            raise RuntimeError("boom")
    assert snapshot_global_flags() == before
    assert torch.get_default_dtype() == torch.float32
    assert torch.is_grad_enabled()


def test_tf32_flags_are_set_inside_and_restored():
    before = snapshot_global_flags()
    with Target.parse("cuda:tf32").applied():
        assert torch.backends.cuda.matmul.allow_tf32 is True
        assert torch.backends.cudnn.allow_tf32 is True
    with Target.parse("cuda:no-tf32").applied():
        assert torch.backends.cuda.matmul.allow_tf32 is False
        assert torch.backends.cudnn.allow_tf32 is False
    assert snapshot_global_flags() == before


def test_emulation_is_off_after_applied():
    torch.manual_seed(0)
    a, b = torch.randn(32, 64), torch.randn(64, 32)
    plain = a @ b
    with Target.parse("cpu:emulate-tf32").applied():
        inside = a @ b
    after = a @ b
    assert not torch.equal(inside, plain)
    assert torch.equal(after, plain)


# --- round_to_tf32 -------------------------------------------------------------------------

def test_round_to_tf32_is_exact_on_values_with_10_mantissa_bits():
    gen = torch.Generator().manual_seed(1)
    mant = torch.randint(1024, 2048, (10000,), generator=gen).double()  # 11 significant bits
    exp = torch.randint(-100, 100, (10000,), generator=gen).double()
    sign = torch.randint(0, 2, (10000,), generator=gen).double() * 2 - 1
    x = (sign * mant * torch.pow(2.0, exp - 10)).float()
    assert torch.equal(round_to_tf32(x), x)


def test_round_to_tf32_relative_error_at_most_half_an_ulp():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(100000, generator=gen) * torch.exp(torch.randn(100000, generator=gen) * 10)
    r = round_to_tf32(x)
    rel = ((r.double() - x.double()).abs() / x.double().abs()).max()
    assert float(rel) <= 2.0**-11
    assert float(rel) > 2.0**-12  # it really rounds
    # the result has at most 10 explicit mantissa bits
    assert int((r.view(torch.int32) & 0x1FFF).abs().sum()) == 0


def test_round_to_tf32_ties_to_even_when_asked():
    one = 1.0
    cases = {
        one + 2.0**-11: one,                        # halfway, lower neighbour even
        one + 3 * 2.0**-11: one + 2.0**-9,           # halfway, upper neighbour even
        one + 2.0**-11 + 2.0**-20: one + 2.0**-10,   # just above halfway
        one + 2.0**-11 - 2.0**-20: one,              # just below halfway
        -(one + 2.0**-11): -one,
        -(one + 3 * 2.0**-11): -(one + 2.0**-9),
    }
    x = torch.tensor(list(cases), dtype=torch.float32)
    expected = torch.tensor(list(cases.values()), dtype=torch.float32)
    assert torch.equal(round_to_tf32(x, replace(TF32, rounding=RNE)), expected)
    # the default, NVIDIA's: ties away from zero (the two halfway cases with an even lower neighbour go up)
    away = expected.clone()
    away[0], away[4] = one + 2.0**-10, -(one + 2.0**-10)
    assert torch.equal(round_to_tf32(x), away)


def test_round_to_tf32_keeps_inf_nan_and_zero():
    x = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0], dtype=torch.float32)
    r = round_to_tf32(x)
    assert r[0] == math.inf and r[1] == -math.inf and math.isnan(float(r[2]))
    assert r[3] == 0 and r[4] == 0 and math.copysign(1, float(r[4])) == -1


def test_round_to_tf32_handles_non_contiguous_and_other_dtypes():
    x = torch.randn(8, 6).t()
    assert torch.equal(round_to_tf32(x), round_to_tf32(x.contiguous()))
    d = torch.randn(5, dtype=torch.float64)
    assert round_to_tf32(d) is d


# --- EmulateTF32 really changes matmul and conv, forward and backward -------------------------

def _err(x, ref):
    return rel_l2(x, ref)


def _linear_and_conv(dtype, emulate: bool):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 256, generator=gen, dtype=torch.float64)
    w = torch.randn(64, 256, generator=gen, dtype=torch.float64) / 16
    b = torch.randn(64, generator=gen, dtype=torch.float64)
    img = torch.randn(4, 8, 16, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(16, 8, 3, 3, generator=gen, dtype=torch.float64) / 8
    leaves = [t.to(dtype).requires_grad_() for t in (x, w, b, img, k)]
    x, w, b, img, k = leaves
    with EmulateTF32() if emulate else contextlib.nullcontext():
        lin = F.linear(x, w, b)
        mm = x @ w.t()
        conv = F.conv2d(img, k, padding=1)
        (lin.square().sum() + conv.square().sum()).backward()
    return dict(linear=lin, mm=mm, conv=conv, w_grad=w.grad, x_grad=x.grad, k_grad=k.grad, img_grad=img.grad)


def test_emulate_tf32_changes_matmul_and_conv_forward_and_backward():
    ref = _linear_and_conv(torch.float64, emulate=False)
    plain = _linear_and_conv(torch.float32, emulate=False)
    emulated = _linear_and_conv(torch.float32, emulate=True)
    for name in ref:
        e_plain = _err(plain[name], ref[name])
        e_emul = _err(emulated[name], ref[name])
        assert e_plain < 1e-6, (name, e_plain)
        assert 1e-4 < e_emul < 1e-3, (name, e_emul)
        assert e_emul > 30 * e_plain, (name, e_plain, e_emul)


def test_emulate_tf32_target_applies_emulation_in_backward():
    """Through the target (not the raw mode): a weight gradient computed inside applied()."""
    gen = torch.Generator().manual_seed(4)
    x64 = torch.randn(32, 128, generator=gen, dtype=torch.float64)
    w64 = torch.randn(10, 128, generator=gen, dtype=torch.float64)
    grads = {}
    for spec in ("cpu:float64", "cpu", "cpu:emulate-tf32"):
        t = Target.parse(spec)
        w = t.cast_input(w64).detach().clone().requires_grad_()
        with t.applied():
            F.linear(t.cast_input(x64), w).sum().backward()
        grads[spec] = w.grad
    assert _err(grads["cpu"], grads["cpu:float64"]) < 1e-6
    assert _err(grads["cpu:emulate-tf32"], grads["cpu:float64"]) > 1e-4


def test_ddp_specs_round_trip_and_leave_the_others_alone():
    """Issue 12: ``ddp:DEVICE:N[:MODE]`` sets ``world``; every other spec keeps ``world=None``."""
    for spec in ("ddp:cpu:2", "ddp:cpu:2:bf16", "ddp:cpu:4:amp-bf16", "ddp:cuda:8:amp-bf16"):
        t = Target.parse(spec)
        assert str(t) == spec and Target.parse(str(t)) == t and t.world == int(spec.split(":")[2])
    assert Target.parse("ddp:cpu:2") != Target.parse("cpu")
    assert Target.parse("cuda:1:tf32").world is None
