"""convcheck.measure.parity: one-step per-layer and per-gradient parity against the float64 judge."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from convcheck.capture import leaf_modules
from convcheck.pipeline import initial_state, model_builder
from convcheck.numerics.metrics import Tolerances
from convcheck.plan.models import ResolvedModel, resolve_model
from convcheck.measure.parity import COLUMNS, ParityResult, run_parity
from convcheck.measure.table_schema import named
from convcheck.targets.spec import Target, snapshot_global_flags
from convcheck.numerics.thresholds import FLOOR_ABSOLUTE

T = Target.parse


class NaiveNorm(nn.Module):
    """Per-sample normalisation with the variance as E[x^2] - E[x]^2.

    Fine in float32 (it loses ~1e-4, a note), catastrophic in bfloat16 when the
    features carry a large mean: E[x^2] ~ 900 and E[x]^2 ~ 900 agree in every
    bit bfloat16 keeps, so the variance is noise.
    """

    def forward(self, x):
        mean = x.mean(dim=1, keepdim=True)
        var = (x * x).mean(dim=1, keepdim=True) - mean * mean
        return (x - mean) / torch.sqrt(var.clamp_min(0) + 1e-5)


class OffsetNet(nn.Module):
    """fc1 puts the features at mean ~30 with std ~1; the naive norm is wrong only in low precision."""

    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(64, 32)
        self.norm = NaiveNorm()
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(32, 4)
        with torch.no_grad():
            self.fc1.bias.fill_(30.0)

    def forward(self, x):
        return self.fc2(self.relu(self.norm(self.fc1(self.flatten(x)))))


class Sqrt(nn.Module):
    def forward(self, x):
        return torch.sqrt(x)


class Scale(nn.Module):
    def forward(self, x):
        return x * 1e5


def _object(factory, shape=(1, 8, 8), classes=4):
    return ResolvedModel(name=factory.__name__, factory=factory, input_shape=shape,
                         num_classes=classes, source="object")


def _batch(shape, classes, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((n, *shape), generator=gen), torch.randint(0, classes, (n,), generator=gen)


def _parity(model: ResolvedModel, targets, n=8, seed=0, **kw) -> ParityResult:
    build = model_builder(model, initial_state(model, seed))
    return run_parity(build, _batch(model.input_shape, model.num_classes, n, seed),
                      [T(t) for t in targets], seed=seed, **kw)


@pytest.fixture(scope="module")
def lenet():
    return resolve_model("lenet")


@pytest.fixture(scope="module")
def lenet_reduced(lenet):
    return _parity(lenet, ["cpu", "cpu:bf16", "cpu:emulate-tf32", "cpu:amp-bf16"])


def _fwd(result, target):
    t = result.layers
    return t[(t["target"] == target) & (t["kind"] == "forward")]


def _grad(result, target):
    t = result.layers
    return t[(t["target"] == target) & (t["kind"] == "grad")]


# --- a healthy model ---------------------------------------------------------------------

def test_lenet_cpu_against_the_judge(lenet_reduced, lenet):
    r = lenet_reduced
    assert tuple(r.layers.columns) == COLUMNS
    assert r.first_flagged[T("cpu")] is None
    fwd = _fwd(r, "cpu")
    names = [n for n, _ in leaf_modules(lenet.factory())]
    assert list(fwd["layer"]) == names
    assert list(fwd["order"]) == list(range(len(names)))
    assert not fwd["flagged"].any()
    # float32 against float64: errors of order 1e-7
    assert fwd["local"].max() < 1e-6
    assert fwd["propagated"].max() < 1e-5
    assert fwd["propagated"].max() > 1e-9  # really measured, not a copy of the judge
    assert (fwd["nan"] == 0).all() and (fwd["inf"] == 0).all()
    assert (fwd["floor"] > 0).all() and (fwd["K"] >= 1).all()
    conv1 = fwd[fwd["layer"] == "conv1"].iloc[0]
    assert conv1["K"] == 1 * 5 * 5 and conv1["u"] == 2.0**-24
    # float32: the floor is the rounding of the result (~u/sqrt(3) relative), the bound is what
    # bound_factor x floor plus the absolute term allows
    assert 1e-8 < conv1["floor"] < 1e-7
    assert conv1["bound"] == pytest.approx(r.tolerances.bound_factor * conv1["floor"] + FLOOR_ABSOLUTE)


def test_every_parameter_has_a_finite_gradient_row(lenet_reduced, lenet):
    params = [n for n, _ in lenet.factory().named_parameters()]
    for target in ("cpu", "cpu:bf16", "cpu:emulate-tf32", "cpu:amp-bf16"):
        g = _grad(lenet_reduced, target)
        assert sorted(g["param"]) == sorted(params), target
        for col in ("local", "propagated", "bound", "ref_absmax"):
            assert g[col].map(math.isfinite).all(), (target, col)
        assert (g["nan"] == 0).all() and (g["inf"] == 0).all()
        assert not g["flagged"].any()
    assert _grad(lenet_reduced, "cpu")["propagated"].max() < 1e-5


def test_lenet_reduced_precision_is_larger_but_bounded(lenet_reduced):
    r = lenet_reduced
    assert bool(r)
    assert not r.layers["flagged"].any()
    assert all(v is None for v in r.first_flagged.values())
    cpu = _fwd(r, "cpu")["local"].max()
    for target, low, high in (("cpu:bf16", 1e-3, 5e-2), ("cpu:emulate-tf32", 5e-5, 5e-3),
                              ("cpu:amp-bf16", 1e-3, 5e-2)):
        fwd = _fwd(r, target)
        assert low < fwd["local"].max() < high, target
        assert fwd["local"].max() > 100 * cpu, target
        assert (fwd["over_floor"] <= r.tolerances.bound_factor).all(), target
        assert fwd["propagated"].max() < 0.5, target
    assert set(named(r.losses)) == {"cpu", "cpu:bf16", "cpu:emulate-tf32", "cpu:amp-bf16"}
    assert all(math.isfinite(v) for v in r.losses.values())
    assert abs(r.losses[T("cpu")] - r.judge_loss) < 1e-5


def test_emulated_tf32_matmuls_carry_the_error(lenet_reduced):
    fwd = _fwd(lenet_reduced, "cpu:emulate-tf32").set_index("layer")
    # conv/linear layers are rounded to TF32, element-wise layers are float32-exact
    assert fwd.loc["fc1", "local"] > 1e-5
    assert fwd.loc["relu1", "local"] < 1e-6


def test_cifar_cnn_reduced_precision_is_larger_but_bounded():
    r = _parity(resolve_model("cifar_cnn"), ["cpu:bf16", "cpu:emulate-tf32"], n=4)
    assert bool(r), r.flagged()
    assert named(r.first_flagged) == {"cpu:bf16": None, "cpu:emulate-tf32": None}
    assert 1e-3 < _fwd(r, "cpu:bf16")["local"].max() < 5e-2
    assert 5e-5 < _fwd(r, "cpu:emulate-tf32")["local"].max() < 5e-3
    assert r.layers["module"].isin(["BatchNorm2d"]).any()
    for target in ("cpu:bf16", "cpu:emulate-tf32"):
        assert _grad(r, target)["local"].map(math.isfinite).all()


# --- a layer wrong only in reduced precision ---------------------------------------------------

@pytest.fixture(scope="module")
def offset_net():
    return _parity(_object(OffsetNet), ["cpu", "cpu:bf16"], n=16)


def test_the_reduced_precision_culprit_is_flagged_first(offset_net):
    r = offset_net
    assert not bool(r)
    assert r.first_flagged[T("cpu:bf16")] == "norm"
    flagged = r.flagged("cpu:bf16")
    assert list(flagged["layer"]) == ["norm"]
    row = flagged.iloc[0]
    assert row["kind"] == "forward" and row["module"] == "NaiveNorm"
    assert row["local"] > 1.0 and row["intrinsic"] > 1.0   # every digit lost, by its own arithmetic
    assert row["floor"] < 0.1 and row["needed"] == math.inf  # destroyed: no bound_factor passes it
    # the layers before it are within their bounds; fc2 after it merely propagates
    fwd = _fwd(r, "cpu:bf16").set_index("layer")
    assert fwd.loc["fc1", "local"] < fwd.loc["fc1", "bound"]
    assert fwd.loc["fc2", "propagated"] > 1.0 > fwd.loc["fc2", "local"]
    assert not fwd.loc["fc2", "flagged"]


def test_the_same_layer_in_float32_is_flagged_but_small(offset_net):
    """float32 loses ~1e-4 here: far above what float32 allows (its floor ~1e-6), so the row is
    flagged; below min_error it is a note for the verdict (tests/scenarios), not a culprit."""
    fwd = _fwd(offset_net, "cpu").set_index("layer")
    assert offset_net.first_flagged[T("cpu")] == "norm"
    assert 1e-5 < fwd.loc["norm", "intrinsic"] < offset_net.tolerances.min_error
    assert fwd.loc["norm", "over_floor"] > offset_net.tolerances.bound_factor
    assert not fwd.drop(index="norm")["flagged"].any()


class WrongLinear(nn.Linear):
    """A Linear whose result is off by a relative 5% whenever it does not run in float64."""

    def forward(self, x):
        out = super().forward(x)
        return out if out.dtype == torch.float64 else out * 1.05


def _wrong_linear_net():
    return nn.Sequential(nn.Flatten(), WrongLinear(64, 16), nn.ReLU(), nn.Linear(16, 4))


def test_needed_bound_factor_comes_from_the_flagged_rows_and_would_pass_them():
    r = _parity(_object(_wrong_linear_net), ["cpu:bf16"], n=8)
    assert named(r.first_flagged) == {"cpu:bf16": "1"}
    row = _fwd(r, "cpu:bf16").set_index("layer").loc["1"]
    assert row["flagged"]
    need = r.needed_bound_factor()
    assert need == pytest.approx(r.flagged()["needed"].max())
    assert r.tolerances.bound_factor < need < 100 and need >= row["needed"]
    assert need > r.layers[~r.layers["flagged"]]["needed"].max()  # the flagged rows only decide it
    passing = _parity(_object(_wrong_linear_net), ["cpu:bf16"], n=8, tolerances=Tolerances(bound_factor=need * 1.01))
    assert bool(passing) and passing.needed_bound_factor() == 0.0
    assert _parity(_object(OffsetNet), ["cpu:bf16"], n=16).needed_bound_factor() == math.inf  # destroyed


def test_tolerances_change_what_is_flagged():
    r = _parity(_object(_wrong_linear_net), ["cpu:bf16"], n=8, tolerances=Tolerances(bound_factor=1e6))
    assert bool(r) and named(r.first_flagged) == {"cpu:bf16": None}
    # a destroyed result is flagged whatever the factor
    r = _parity(_object(OffsetNet), ["cpu:bf16"], n=16, tolerances=Tolerances(bound_factor=1e6))
    assert named(r.first_flagged) == {"cpu:bf16": "norm"}


def test_worst_rows_are_each_targets_own_ranked_by_own_error_over_floor(offset_net):
    worst = offset_net.worst(3)
    assert list(dict.fromkeys(worst["target"])) == ["cpu", "cpu:bf16"]
    assert (worst.groupby("target").size() == 3).all()
    bf16 = worst[worst["target"] == "cpu:bf16"]
    assert bf16.iloc[0]["layer"] == "norm" and bf16.iloc[0]["flagged"]
    rest = bf16.iloc[1:]["over_floor"].tolist()
    assert rest == sorted(rest, reverse=True)


# --- non-finite values are results -------------------------------------------------------------

def _sqrt_net():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), Sqrt(), nn.Linear(16, 4))


def _scale_net():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), Scale(), nn.Linear(16, 4))


def test_a_model_that_produces_nan_is_a_result():
    r = _parity(_object(_sqrt_net), ["cpu", "cpu:bf16"], n=8)
    for target in ("cpu", "cpu:bf16"):
        fwd = _fwd(r, target).set_index("layer")
        assert fwd.loc["2", "nan"] > 0                 # sqrt of negatives, on every arm
        assert fwd.loc["3", "input_nonfinite"] > 0
        assert fwd.loc["1", "nan"] == 0
        assert _grad(r, target)["nan"].sum() > 0
        # the judge produces the same NaN: that is the model, not this target
        assert r.first_flagged[T(target)] is None
        assert math.isfinite(fwd.loc["2", "local"])
    assert "2" not in r.stochastic_layers       # NaN != NaN must not look random
    assert math.isnan(r.judge_loss)


def test_overflow_only_in_float16_is_flagged_where_it_starts():
    r = _parity(_object(_scale_net), ["cpu", "cpu:fp16"], n=8)
    assert named(r.first_flagged) == {"cpu": None, "cpu:fp16": "2"}
    fwd = _fwd(r, "cpu:fp16").set_index("layer")
    assert fwd.loc["2", "inf"] > 0 and fwd.loc["1", "inf"] == 0
    assert fwd.loc["2", "local"] == math.inf
    assert fwd.loc["3", "input_nonfinite"] > 0
    assert _fwd(r, "cpu")["inf"].sum() == 0


# --- hygiene -------------------------------------------------------------------------------------

def test_parity_leaves_flags_alone_and_prints_nothing(capsys):
    before = snapshot_global_flags()
    dtype = torch.get_default_dtype()
    _parity(_object(OffsetNet), ["cpu:emulate-tf32", "cpu:bf16", "cpu:amp-bf16"], n=4)
    assert snapshot_global_flags() == before
    assert torch.get_default_dtype() == dtype
    try:
        assert not torch.is_autocast_enabled("cpu")
    except TypeError:  # torch < 2.4
        assert not torch.is_autocast_cpu_enabled()
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def test_the_judge_in_the_target_list_is_skipped():
    r = _parity(_object(OffsetNet), ["cpu:float64", "cpu"], n=2)
    assert set(r.layers["target"]) == {"cpu"}
    assert set(named(r.first_flagged)) == {"cpu"}


# --- tensors changed in place between modules ------------------------------------------------

class InPlaceResidual(nn.Module):
    """Like a ResNet block: the last norm's output is changed in place by ``out += identity``."""

    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(64, 64)
        self.bn = nn.BatchNorm1d(64)
        self.relu = nn.ReLU()
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        x = self.flatten(x)
        out = self.bn(self.fc(x))
        out += x
        return self.head(self.relu(out))


def test_an_output_changed_in_place_later_is_judged_as_the_layer_made_it():
    r = _parity(_object(InPlaceResidual), ["cpu"], n=8)
    assert r.stochastic_layers == ()  # was: 'bn' looked random (its recorded output had changed)
    fwd = _fwd(r, "cpu").set_index("layer")
    assert fwd.loc["bn", "local"] < 1e-6 and fwd.loc["bn", "propagated"] < 1e-5
    assert {"bn.weight", "bn.bias"} <= set(_grad(r, "cpu")["param"])
    assert bool(r)


def _conv_bias_bn():
    return nn.Sequential(nn.Conv2d(1, 8, 3, bias=True), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 6 * 6, 4))


def test_a_bias_feeding_batchnorm_is_not_a_culprit():
    """Its exact gradient is zero (BatchNorm removes the mean): float32 and float64 rounding
    noise are both ~0 and their ratio means nothing."""
    r = _parity(_object(_conv_bias_bn), ["cpu", "cpu:bf16"], n=8)
    assert named(r.first_flagged) == {"cpu": None, "cpu:bf16": None}
    bias = _grad(r, "cpu").set_index("param").loc["0.bias"]
    assert bias["propagated"] > 1  # relative to the cancelled judge gradient: meaningless
    assert bias["local"] < 1e-6    # relative to the terms it sums: float32 rounding


def test_resnet_blocks_have_every_gradient_and_no_stochastic_layer():
    model = resolve_model("resnet18", input_shape=(3, 32, 32), num_classes=10)
    r = _parity(model, ["cpu"], n=2)
    assert r.stochastic_layers == ()
    params = {n for n, _ in model.factory().named_parameters()}
    assert set(_grad(r, "cpu")["param"]) == params
    fwd = _fwd(r, "cpu")
    assert fwd["local"].map(math.isfinite).all()
    assert fwd["local"].max() < 1e-5
    assert named(r.first_flagged) == {"cpu": None}


# --- layers the fast paths must not trip over (found in review) ------------------------------

class _FFT(nn.Module):
    def forward(self, x):
        return torch.fft.fft(x)


class _Magnitude(nn.Module):
    def forward(self, x):
        return x.abs()


class ComplexLayers(nn.Module):
    """A leaf whose output is complex (an FFT), then its magnitude."""

    def __init__(self):
        super().__init__()
        self.flatten, self.a, self.fft, self.mag, self.b = nn.Flatten(), nn.Linear(64, 32), _FFT(), _Magnitude(), \
            nn.Linear(32, 4)

    def forward(self, x):
        return self.b(self.mag(self.fft(self.a(self.flatten(x)))))


def test_a_layer_with_complex_output_is_measured_not_a_crash():
    r = _parity(_object(ComplexLayers), ["cpu", "cpu:emulate-tf32"], n=4)
    fwd = _fwd(r, "cpu").set_index("layer")
    assert fwd.loc["fft", "ref_absmax"] > 0 and math.isfinite(fwd.loc["fft", "propagated"])
    assert r.first_flagged[T("cpu")] is None


class _GradModePath(nn.Module):
    """Computes in float64 when autograd is on (a training-only path), in its own dtype otherwise."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 4) * 0.1)

    def forward(self, x):
        if torch.is_grad_enabled():
            return (x.double() @ self.w.double()).to(x.dtype)
        return x @ self.w


def test_the_local_run_takes_the_path_the_targets_own_forward_took():
    """The target's forward runs with autograd on; so does its copy of the layer on the judge's input
    (with it off, a layer like ``nn.MultiheadAttention`` takes a fast path the target never ran)."""
    r = _parity(_object(lambda: nn.Sequential(nn.Flatten(), _GradModePath())), ["cpu"], n=8)
    row = _fwd(r, "cpu").set_index("layer").loc["1"]
    assert row["local"] == row["floor"]  # the float64 path: nothing but the rounding of its result
