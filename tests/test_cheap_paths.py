"""The shortcuts that make parity and training cheap give what the long way gives (issue 14, item 2).

No timing here: each shortcut is held against the computation it replaces.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

from convcheck.plan.builder import _loaded, _placed, model_builder
from convcheck.numerics.metrics import param_distance, param_norm_sq, rel_l2
from convcheck.plan.models import ResolvedModel, resolve_model
from convcheck.measure.parity.judge_pass import run_judge, stochastic_layers
from convcheck.measure.parity.known import probe_needed
from convcheck.measure.parity.local import private_copy
from convcheck.pipeline import initial_state
from convcheck.targets.runners import cross_entropy
from convcheck.targets.spec import CPU_JUDGE, Target
from convcheck.measure.train.nonfinite import all_finite

T = Target.parse


def _stock_net():
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.5), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 3))


class _Noisy(nn.Module):
    def forward(self, x):
        return x + 0.1 * torch.randn_like(x)


def _resolved(factory):
    return ResolvedModel(name="net", factory=factory, input_shape=(1, 8, 8), num_classes=3, source="object")


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)


def test_builds_equal_the_factorys_and_draw_no_random_numbers():
    resolved = resolve_model("cifar_cnn")
    state = initial_state(resolved, 0)
    build = model_builder(resolved, state)
    for spec in ("cpu", "cpu:bf16", "cpu:fp16", "cpu:float64", "cpu:emulate-tf32"):
        target = T(spec)
        before = torch.random.get_rng_state()
        got = build(target)
        assert torch.equal(torch.random.get_rng_state(), before)
        want = _placed(_loaded(resolved.factory(), state), state, target.runner).train()
        a, b = got.state_dict(keep_vars=True), want.state_dict(keep_vars=True)
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and type(a[k]) is type(b[k]) and a[k].requires_grad == b[k].requires_grad
            assert torch.equal(a[k], b[k]), k
        assert got.training
    one, two = build(T("cpu")), build(T("cpu"))
    with torch.no_grad():
        next(one.parameters()).add_(1.0)
    assert not torch.equal(next(one.parameters()), next(two.parameters()))  # independent copies


def test_a_model_that_cannot_be_copied_is_rebuilt_by_its_factory():
    class Uncopyable(nn.Linear):
        def __deepcopy__(self, memo):
            raise TypeError("no copies")

    calls = []

    def factory():
        calls.append(1)
        return nn.Sequential(Uncopyable(4, 2))

    resolved = ResolvedModel(name="u", factory=factory, input_shape=None, num_classes=None, source="object")
    state = initial_state(resolved, 0)
    build = model_builder(resolved, state)
    a, b = build(T("cpu")), build(T("cpu:float64"))
    assert len(calls) == 4  # the state, the template, then one factory call per build
    assert torch.equal(a[0].weight.double(), b[0].weight)


def test_the_probe_is_skipped_only_where_it_can_find_nothing():
    resolved = _resolved(_stock_net)
    build = model_builder(resolved, initial_state(resolved, 0))
    batch = _batch()
    assert not probe_needed(build(CPU_JUDGE), CPU_JUDGE.runner)
    calls, _, _, _ = run_judge(build(CPU_JUDGE), batch, CPU_JUDGE.runner, 0, cross_entropy)
    assert stochastic_layers(build(CPU_JUDGE), batch[0], calls, CPU_JUDGE.runner, 0) == []  # the long way agrees
    noisy = nn.Sequential(nn.Flatten(), _Noisy(), nn.Linear(64, 3))
    assert probe_needed(noisy, CPU_JUDGE.runner)
    hooked = _stock_net()
    hooked[2].register_forward_hook(lambda m, i, o: o + torch.rand_like(o))
    assert probe_needed(hooked, CPU_JUDGE.runner)
    subclass = nn.Sequential(type("MyReLU", (nn.ReLU,), {})())
    assert probe_needed(subclass, CPU_JUDGE.runner)

    class Block(nn.Module):  # stock children, but code of its own around them
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 3)

        def forward(self, x):
            return self.fc(x.flatten(1) + 0.1 * torch.randn_like(x.flatten(1)))

    assert probe_needed(Block(), CPU_JUDGE.runner)
    assert probe_needed(nn.Sequential(Block()), CPU_JUDGE.runner)


def test_a_light_copy_computes_as_a_deep_copy_and_leaves_the_original_alone():
    torch.manual_seed(0)
    bn, conv = nn.BatchNorm2d(4).train(), nn.Conv2d(4, 4, 3)
    bn.register_forward_hook(lambda m, i, o: o * 0)  # the copy must not fire it
    x = torch.randn(2, 4, 6, 6)
    for layer in (bn, conv):
        stats = {n: b.clone() for n, b in layer.named_buffers()}
        light, deep = private_copy(layer), copy.deepcopy(layer)
        deep._forward_hooks.clear()
        assert torch.equal(light(x), deep(x))
        light(x).sum().backward()
        assert all(p.grad is None for p in layer.parameters())
        assert all(torch.equal(b, stats[n]) for n, b in layer.named_buffers())
        assert all(p.grad is not None for p in light.parameters())


def test_metrics_shortcuts_give_the_long_ways_values():
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(1000, generator=g, dtype=torch.float64)
    x = (ref + 1e-3 * torch.randn(1000, generator=g, dtype=torch.float64)).float()
    long_way = float(torch.linalg.vector_norm(x.double() - ref)) / float(torch.linalg.vector_norm(ref))
    assert rel_l2(x, ref) == long_way and rel_l2(x, ref) == long_way  # the second from the remembered norm
    ref.mul_(2.0)  # changed in place: its norm is measured again
    assert rel_l2(x, ref) == float(torch.linalg.vector_norm(x.double() - ref)) / float(torch.linalg.vector_norm(ref))
    a, b = nn.Linear(8, 4), nn.Linear(8, 4).double()
    assert param_distance(a, b) == param_distance(a, b, param_norm_sq(b))
    with torch.no_grad():
        a.weight[0, 0] = math.inf
    assert math.isinf(param_distance(a, b)) and math.isinf(param_distance(a, b, param_norm_sq(b)))


def test_all_finite_reads_a_sum_that_overflows_as_finite():
    big = torch.full((4,), 60000.0, dtype=torch.float16)  # its float16 sum overflows, every element is finite
    assert all_finite(big)
    assert not all_finite(torch.tensor([1.0, math.nan]))
    assert not all_finite(torch.tensor([1.0, math.inf], dtype=torch.bfloat16))


# --- the stochastic probe is skipped when the judge's forward drew nothing (RandomDraws) -------------

class _OwnCodeBlock(nn.Module):
    def __init__(self, draw: str | None = None):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.draw = draw
        self.gen = torch.Generator().manual_seed(1) if draw == "own-generator" else None

    def forward(self, x):
        h = self.fc(x) + x  # own code: a residual add
        if self.draw == "global":
            h = h * (torch.rand_like(h) > 0.3)
        elif self.draw == "own-generator":
            h = h * (torch.rand(h.shape, generator=self.gen, dtype=h.dtype) > 0.3)
        return h


def _draws_net(draw):
    return nn.Sequential(nn.Linear(4, 8), _OwnCodeBlock(draw), nn.Linear(8, 3))


@pytest.mark.parametrize("draw, expected", [(None, False), ("global", True), ("own-generator", True)])
def test_random_draws_are_seen_inside_a_runner_that_restores_the_state(draw, expected):
    from convcheck.measure.parity.known import RandomDraws
    from convcheck.targets.spec import CPU_JUDGE

    model = _draws_net(draw).double().train()
    with RandomDraws(model) as draws, CPU_JUDGE.runner.applied():
        model(torch.randn(4, 4, dtype=torch.float64))
    assert draws.drawn is expected


def test_own_code_that_draws_is_still_found_stochastic():
    draw = "global"
    from convcheck.measure.parity import run_parity
    from convcheck.targets.spec import Target

    torch.manual_seed(0)
    state = _draws_net(draw).state_dict()

    def build(t):
        m = _draws_net(draw)
        m.load_state_dict(state)
        t.runner.place(m)
        return m.train()

    batch = (torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,)))
    r = run_parity(build, batch, [Target.parse("cpu:bf16")])
    assert r.stochastic_layers == ("1",), r.stochastic_layers
    assert not r.layers["flagged"].any()


@pytest.mark.parametrize("spec", ["cpu", "cpu:bf16", "cpu:fp16"])
@pytest.mark.parametrize("layer", [nn.ReLU(), nn.ReLU6(), nn.MaxPool2d(2), nn.MaxPool2d(3, 2, 1, ceil_mode=True),
                                   nn.AdaptiveMaxPool2d(3), nn.Flatten(), nn.Unflatten(1, (2, 2)), nn.Identity()],
                         ids=lambda m: type(m).__name__)
def test_a_selection_layers_local_error_is_its_output_rounding(spec, layer):
    """``known.selects``: parity writes the free lower bound as the local error without running the
    copy; running it gives the same number, to the bit (values near float16's limit included)."""
    from convcheck.measure.parity.floor import FloorMeter
    from convcheck.measure.parity.known import selects

    assert selects(layer)
    runner = T(spec).runner
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64, generator=g) * 3e4  # past 65504 once rounded to float16
    if isinstance(layer, nn.Unflatten):
        x = x.reshape(2, 4, 36)
    judge_out = layer(x)
    got = private_copy(layer)(x.to(runner.param_dtype))
    meter = FloorMeter.of(runner, CPU_JUDGE.runner)
    assert rel_l2(got, judge_out) == meter.output_rounding(judge_out, got.dtype)
    assert not selects(nn.LeakyReLU()) and not selects(nn.Hardtanh(-0.3, 0.3))


def test_abs_max_and_finite_flag_give_the_long_ways_values():
    from convcheck.numerics.metrics import abs_max, rel_l2_finite

    for t in (torch.tensor([-3.0, 2.0]), torch.tensor([-0.0, 0.0]), torch.tensor([1.0, -math.inf]),
              torch.randn(100, dtype=torch.float64)):
        assert abs_max(t) == float(t.abs().max()) and str(abs_max(t)) == str(float(t.abs().max()))
    assert math.isnan(abs_max(torch.tensor([1.0, math.nan]))) and math.isnan(abs_max(torch.tensor([])))
    ref = torch.randn(50, dtype=torch.float64)
    assert rel_l2_finite(ref.float(), ref) == (rel_l2(ref.float(), ref), True)
    bad = ref.float().clone()
    bad[3] = math.nan
    err, finite = rel_l2_finite(bad, ref)
    assert math.isinf(err) and not finite


@pytest.mark.parametrize("rounding", ["RNE", "RNA", "RZ"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rounding_on_the_bit_pattern_equals_frexp_rounding(dtype, rounding):
    from dataclasses import replace

    from convcheck.numerics.formats import BFLOAT16, TF32
    from convcheck.targets.runners.precision import round_to

    scaled = {"RNE": torch.round, "RNA": lambda v: torch.copysign(torch.floor(v.abs() + 0.5), v), "RZ": torch.trunc}
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(20000, generator=g, dtype=torch.float64)
         * torch.exp(10 * torch.randn(20000, generator=g, dtype=torch.float64))).to(dtype)
    ties = (torch.arange(1024, 2048, dtype=dtype) + 0.5) * 2.0 ** -7
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-40, -3e-42], dtype=dtype)
    for t in (x, torch.cat([ties, -ties, special])):
        if dtype == torch.float32:  # float32 subnormals: the format's own grid (tests/numerics/test_tf32_rounding.py)
            t = t[~((t.abs() < torch.finfo(dtype).tiny) & (t != 0))]
        for fmt in (replace(TF32, rounding=rounding), replace(BFLOAT16, dtype=None, rounding=rounding)):
            bits = fmt.significand_bits  # no dtype: the significand cut in t's own dtype
            m, e = torch.frexp(t)
            want = torch.where(torch.isfinite(t), scaled[rounding](m * 2.0 ** bits) * torch.exp2((e - bits).to(dtype)), t)
            got = round_to(t, fmt)
            assert torch.equal(torch.isnan(got), torch.isnan(want))
            ok = ~torch.isnan(want)
            assert torch.equal(got[ok], want[ok]) and torch.equal(torch.signbit(got[ok]), torch.signbit(want[ok]))


@pytest.mark.parametrize("spec", ["cpu", "cpu:bf16", "cpu:emulate-tf32"])
def test_one_forward_for_local_output_and_gradients_gives_both_long_ways(spec):
    from convcheck.measure.parity.judge_pass import JudgeCall
    from convcheck.measure.parity.local import local_forward_backward, local_grads, target_call

    runner = T(spec).runner
    g = torch.Generator().manual_seed(4)
    for layer, x in ((nn.Conv2d(2, 3, 3), torch.randn(2, 2, 5, 5, generator=g, dtype=torch.float64)),
                     (nn.BatchNorm1d(4), torch.randn(6, 4, generator=g, dtype=torch.float64)),
                     (nn.Linear(4, 2), torch.randn(3, 4, generator=g, dtype=torch.float64))):
        judge_out = layer.double()(x)
        jc = JudgeCall("l", type(layer).__name__, (x,), judge_out.detach(), torch.randn_like(judge_out))
        target_layer = copy.deepcopy(layer).to(runner.param_dtype)
        args = (x.to(runner.param_dtype),)
        with runner.applied():
            out, grads = local_forward_backward(target_layer, jc, runner, args)
            want_out, want_grads = target_call(target_layer, args), local_grads(target_layer, jc, runner)
        assert torch.equal(out, want_out)
        assert grads.keys() == want_grads.keys() and all(torch.equal(grads[k], want_grads[k]) for k in grads)


def test_a_record_is_a_view_until_its_memory_is_written_then_the_value_recorded():
    """``parity.snapshots``: no copy of what nothing writes; a copy, before the write, of what is written
    (in place, through a view of it, or as an ``out=``)."""
    from convcheck.measure.parity.snapshots import Snapshots

    a, b, c = torch.arange(6.0).reshape(2, 3), torch.ones(4), torch.zeros(3)
    snap = Snapshots()
    with snap:
        ra, rb, rc = snap(a), snap(b), snap(c)
        assert snap(a) is ra  # one record per tensor and version
        a[0].add_(10)  # a write through a view of a
        torch.add(c, 5, out=c)
        assert snap(a) is not ra  # a new version: a new record
    snap.clear()
    assert torch.equal(ra, torch.arange(6.0).reshape(2, 3)) and torch.equal(rc, torch.zeros(3))
    assert rb.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # never written: still a view
    assert ra.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()


@pytest.mark.parametrize("spec", ["cpu", "cpu:amp-bf16"])
def test_the_last_target_drops_the_judges_record_as_it_goes_and_makes_the_same_rows(spec):
    """``TargetPass.release``: each call's record goes once its rows and its parent's own-code row are
    made (autocast's layers keep theirs for gradient rows made after the backward)."""
    import pandas as pd

    from convcheck.measure.parity.result import COLUMNS
    from convcheck.measure.parity.target_pass import TargetPass
    from convcheck.numerics.tolerances import DEFAULT_TOLERANCES

    model = resolve_model("resnet18", input_shape=(3, 32, 32), num_classes=10)
    build = model_builder(model, initial_state(model, 0))
    g = torch.Generator().manual_seed(6)
    batch = torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 10, (2,), generator=g)
    target = T(spec)
    tables, left = [], []
    for release in (False, True):
        calls, _, grads, _ = run_judge(build(CPU_JUDGE), batch, CPU_JUDGE.runner, 0, cross_entropy)
        n = len(calls)
        tp = TargetPass(spec, target.runner, CPU_JUDGE.runner, (calls, grads), DEFAULT_TOLERANCES, [], 0)
        tp.release = release
        tp.run(build(target), batch, cross_entropy)
        tables.append(pd.DataFrame(tp.rows, columns=COLUMNS))
        left.append(len(calls) / n)
    pd.testing.assert_frame_equal(tables[0], tables[1], check_exact=True)
    assert left[0] == 1.0 and left[1] < (0.5 if spec == "cpu" else 1.0)


@pytest.mark.parametrize("spec", ["cpu:emulate-tf32", "cpu:amp-bf16"])
def test_a_forward_floor_takes_the_gradient_floors_output_and_gives_the_long_ways_rows(spec):
    """``FloorMeter``: where a row rounds its operands (TF32, autocast), the gradients' float64 floor
    computes the output the forward's floor needs; handing it over gives the rows of computing it again,
    and the float64 forward on rounded operands runs once per matmul/conv call instead of twice."""
    import pandas as pd

    from convcheck.measure.parity import floor
    from convcheck.measure.parity.result import COLUMNS
    from convcheck.measure.parity.target_pass import TargetPass
    from convcheck.numerics.tolerances import DEFAULT_TOLERANCES

    model = resolve_model("lenet")
    build = model_builder(model, initial_state(model, 0))
    g = torch.Generator().manual_seed(7)
    batch = torch.randn(4, 1, 28, 28, generator=g), torch.randint(0, 10, (4,), generator=g)
    target = T(spec)
    tables, forwards = [], []
    calls_made = []
    original = floor.reference_call

    def counted(*args, **kwargs):
        calls_made.append(1)
        return original(*args, **kwargs)

    for shared in (False, True):
        calls, _, grads, _ = run_judge(build(CPU_JUDGE), batch, CPU_JUDGE.runner, 0, cross_entropy)
        tp = TargetPass(spec, target.runner, CPU_JUDGE.runner, (calls, grads), DEFAULT_TOLERANCES, [], 0)
        if not shared:
            tp.floors._taken_output = lambda module, args: None  # the long way: the forward's floor computes it
        calls_made.clear()
        floor.reference_call = counted
        try:
            tp.run(build(target), batch, cross_entropy)
        finally:
            floor.reference_call = original
        tables.append(pd.DataFrame(tp.rows, columns=COLUMNS))
        forwards.append(len(calls_made))
    pd.testing.assert_frame_equal(tables[0], tables[1], check_exact=True)
    if spec == "cpu:emulate-tf32":  # five conv/linear layers, each with its gradient floor made in its row
        assert forwards == [5, 0]
    else:  # autocast's gradient rows are made after the backward: the forward's floor comes first
        assert forwards[0] == forwards[1]


class _Chain(nn.Module):
    """Own code of four kinds: ``plain`` hands each child's output to the next; ``inplace`` scales one
    in place between children; ``view`` reshapes between children."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.conv = nn.Conv2d(1, 2, 3)
        self.act = nn.ReLU()
        self.flat = nn.Flatten()
        self.fc = nn.Linear(2 * 6 * 6, 3)

    def forward(self, x):
        h = self.conv(x)
        if self.kind == "inplace":
            h.mul_(3.0)
        h = self.act(h)
        h = h.reshape(h.shape[0], -1) if self.kind == "view" else self.flat(h)
        return self.fc(h)


@pytest.mark.parametrize("kind, passes, rows", [("plain", True, 0), ("inplace", False, 1), ("view", False, 0)])
def test_own_code_that_only_hands_values_on_is_not_replayed_and_gives_the_replays_rows(kind, passes, rows,
                                                                                       monkeypatch):
    """``judge_pass.passes_on``: a module whose own code only hands values on (LeNet's, CifarCNN's
    forward) has no own-code point, so no target replays it; the rows are those of replaying it.
    Code that changes a value in place is replayed and gets its row; a view is replayed too (its
    replay finds the view is nothing of its own)."""
    import pandas as pd

    from convcheck.measure.parity import own_check
    from convcheck.measure.parity import run_parity

    resolved = _resolved(lambda: _Chain(kind))
    build = model_builder(resolved, initial_state(resolved, 0))
    replays = []
    original = own_check.OwnCodeCheck.errors

    def counted(self, *args):
        replays.append(type(self.module).__name__)
        return original(self, *args)

    monkeypatch.setattr(own_check.OwnCodeCheck, "errors", counted)
    calls, _, _, _ = run_judge(build(CPU_JUDGE), _batch(), CPU_JUDGE.runner, 0, cross_entropy)
    assert calls["_Chain"].passes_on is passes
    tables = []
    for shortcut in (True, False):
        if not shortcut:
            monkeypatch.setattr("convcheck.measure.parity.judge_pass.passes_on", lambda call, output: False)
        replays.clear()
        result = run_parity(build, _batch(), [T("cpu:bf16")], seed=0)
        tables.append(result.layers)
        assert replays == ([] if shortcut and passes else ["_Chain"])
    pd.testing.assert_frame_equal(tables[0], tables[1], check_exact=True)
    own_rows = tables[0][tables[0]["module"].str.contains("own code")]
    assert len(own_rows) == rows
