"""Training's cheap statistics give what the long way gives, bit for bit (issue 14, item 2).

Each shortcut in ``convcheck.measure.train.stats``, ``train.distances`` and ``train.arms.perturb_`` is held
against the plain expression it replaces. No timing here.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from convcheck.numerics.metrics import param_distance, param_norm_sq
from convcheck.measure.train.arms import perturb_
from convcheck.measure.train.distances import Distances
from convcheck.measure.train.stats import (
    ALONE, GROUP, Scratch, fraction_abs_above, fraction_le_zero, groups, norms_and_zeros, seed_generators,
)


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))


def _tensors(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    big = torch.randn(ALONE + 17, generator=g).to(dtype)
    big[::3] = 0
    small = torch.randn(5, 7, generator=g).to(dtype)
    small[0] = 0
    odd = torch.randn(8, 8, generator=g).to(dtype).t()  # not contiguous
    bad = torch.tensor([1.0, float("nan"), float("inf"), 0.0, -0.0]).to(dtype)
    return [big, small, odd, bad, torch.zeros(0, dtype=dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_norms_and_zero_counts_are_the_plain_calls(dtype):
    ts = _tensors(dtype)
    norms, zeros = norms_and_zeros(ts, Scratch())
    for t, n, z in zip(ts, norms, zeros):
        assert _same(n, float(torch.linalg.vector_norm(t, dtype=torch.float64)))
        assert z == t.numel() - int(torch.count_nonzero(t))
    assert norms_and_zeros(ts, Scratch(), zeros=False)[1] is None


def test_activation_fractions_are_the_plain_means():
    scratch = Scratch()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 6, 9, 9, generator=g)
    x[0, 0, 0, :3] = torch.tensor([float("nan"), -0.0, 0.0])
    for t in (torch.relu(x), x, x.to(torch.bfloat16), x.to(torch.float64), x.permute(0, 2, 3, 1), x[:, :0]):
        assert _same(fraction_le_zero(t, scratch), float((t <= 0).float().mean()))
        assert _same(fraction_abs_above(t * 4, 5.0, scratch), float(((t * 4).abs() > 5.0).float().mean()))


def test_seed_generators_seeds_the_cpu_generator_as_manual_seed_does():
    seed_generators(1234)
    a = torch.rand(5)
    torch.manual_seed(1234)
    assert torch.equal(a, torch.rand(5))


def test_groups_keep_order_and_limits():
    sizes = [3, ALONE, 5, 7, GROUP // 2, GROUP // 2, 1, ALONE * 2, 2]
    ts = [torch.empty(n) for n in sizes]
    gs = groups(ts)
    assert [i for g in gs for i in g] == list(range(len(ts)))
    for g in gs:
        assert len(g) == 1 or (sum(sizes[i] for i in g) <= GROUP and all(sizes[i] < ALONE for i in g))


def _long_perturb_(model: nn.Module, ulp: float, seed: int) -> None:
    """perturb_ as it was written before the shortcuts."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_floating_point():
                continue
            up = torch.randint(0, 2, p.shape, generator=gen, dtype=torch.uint8).bool().to(p.device)
            down_f, up_f = 1 + torch.tensor([-1, 1], dtype=p.dtype, device=p.device) * ulp
            p.mul_(torch.where(up, up_f, down_f))


def _mixed_net():
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, ALONE // 4 + 3), nn.Linear(3, 2))
    net[3].to(torch.bfloat16)
    net[0].weight.data = net[0].weight.data.to(memory_format=torch.channels_last)  # not contiguous
    return net


@pytest.mark.parametrize("ulp", [2.0 ** -23, 2.0 ** -7, 0.3, 3e38])  # 3e38: up - down overflows, not exact
def test_perturb_is_the_long_way(ulp):
    a, b, c = _mixed_net(), _mixed_net(), _mixed_net()
    b.load_state_dict(a.state_dict())
    c.load_state_dict(a.state_dict())
    perturb_(a, ulp, 7)
    _long_perturb_(b, ulp, 7)
    scratch = Scratch()
    perturb_(_mixed_net(), ulp, 8, scratch)  # the draws' buffer holds another run's draws before c's
    perturb_(c, ulp, 7, scratch)
    for (n, x), y, z in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert x.dtype == y.dtype == z.dtype and torch.equal(x, y) and torch.equal(z, y), n


def _state(name, model, role="target"):
    s = SimpleNamespace(arm=SimpleNamespace(name=name, role=role), model=model, kept=None)
    s.remember_weight_sq = lambda v, s=s: setattr(s, "kept", v)
    return s


def _nets():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Linear(8, ALONE // 8 + 5), nn.Linear(5, 3))
    judge = _copy(base, torch.float64)
    target = _copy(base, torch.float32)
    env = _copy(base, torch.float32)
    perturb_(env, 2.0 ** -23, 3)
    low = _copy(base, torch.bfloat16)
    odd = _copy(base, torch.float32)
    odd[0].weight.data = odd[0].weight.data.to(memory_format=torch.channels_last)
    return judge, target, env, low, odd


def _copy(m, dtype):
    import copy
    return copy.deepcopy(m).to(dtype)


def test_distances_are_param_distance_and_weight_norms_the_grad_stats_sum():
    judge, target, env, low, odd = (_state(n, m) for n, m in zip(("judge", "t", "env", "low", "odd"), _nets()))
    judge.arm.role = "judge"
    partners = {"judge": (None, None, None), "t": (judge, None, judge), "env": (judge, target, None),
                "low": (judge, None, target), "odd": (judge, target, odd)}
    states = [target, env, low, odd, judge]
    dist = Distances(Scratch())
    for weights in (True, True, False):  # the kept partner buffers are refilled on later calls
        for s in states:
            s.kept = None
        got = dist.measure(states, partners, weights=weights)
        for s in states:
            for b in [p for p in partners[s.arm.name] if p is not None and p is not s]:
                want = param_distance(s.model, b.model, param_norm_sq(b.model))
                assert _same(got[(id(s), id(b))], want), (s.arm.name, b.arm.name)
            long = sum(float(torch.linalg.vector_norm(p.detach(), dtype=torch.float64)) ** 2
                       for p in s.model.parameters())
            assert _same(s.kept, long) if weights else s.kept is None, s.arm.name
        with torch.no_grad():
            for s in states:
                for p in s.model.parameters():
                    p.mul_(1.5)


def test_distances_both_ways_in_place_and_per_layout_are_param_distance():
    """The two targets each other's partner (one difference for both), arms that are no partner (a
    float32 and a float64 one: their last difference is taken in place, never in a model's tensor nor in
    a partner's copy an arm after them reads), and a second model of another layout in the same call."""
    judge, target, env, low, _ = (_state(n, m) for n, m in zip(("judge", "t", "env", "low", "odd"), _nets()))
    deep = _state("f64", _copy(env.model, torch.float64))
    torch.manual_seed(1)
    small_judge = _state("j2", nn.Sequential(nn.Linear(4, 3)).to(torch.float64))
    small = _state("t2", _copy(small_judge.model, torch.float32))
    perturb_(small.model, 2.0 ** -10, 5)
    partners = {"t": (judge, None, low), "low": (judge, None, target), "env": (judge, low, None),
                "f64": (judge, target, low), "judge": (None, None, None), "t2": (small_judge, None, None),
                "j2": (None, None, None)}
    states = [target, low, env, deep, judge, small, small_judge]  # target's copy is read after env's
    before = [[p.detach().clone() for p in s.model.parameters()] for s in states]
    got = Distances(Scratch()).measure(states, partners, weights=True)
    for s in states:
        for b in [p for p in partners[s.arm.name] if p is not None]:
            assert _same(got[(id(s), id(b))], param_distance(s.model, b.model)), (s.arm.name, b.arm.name)
        long = sum(float(torch.linalg.vector_norm(p.detach(), dtype=torch.float64)) ** 2 for p in s.model.parameters())
        assert _same(s.kept, long), s.arm.name
    assert got[(id(target), id(low))] != got[(id(low), id(target))]  # one numerator, two denominators
    for s, kept in zip(states, before):
        assert all(torch.equal(p, q) for p, q in zip(s.model.parameters(), kept)), s.arm.name


def test_an_arm_reuses_its_weight_norm_only_while_the_parameters_are_unchanged():
    from convcheck.plan.config import CompareConfig
    from convcheck.plan.recipe import build_recipe
    from convcheck.targets.spec import Target
    from convcheck.measure.train.arm_state import ArmState

    torch.manual_seed(0)
    template = nn.Sequential(nn.Linear(4, 3))
    arm = SimpleNamespace(name="cpu", target=Target("cpu"), role="target", perturb_seed=None)
    s = ArmState(arm, lambda t: _copy(template, torch.float32), 3, build_recipe(CompareConfig()))
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    s.remember_weight_sq(123.0)  # stale on purpose: the step below must not use it after a change
    with torch.no_grad():
        s.model[0].weight.add_(1.0)
    before = sum(float(torch.linalg.vector_norm(p.detach(), dtype=torch.float64)) ** 2 for p in s.model.parameters())
    r = s.step(x, y, 1, 2)
    assert r["update_ratio"] == r["lr"] * r["grad_norm"] / math.sqrt(before)
    s.remember_weight_sq(4.0)  # nothing changes the parameters before the next statistics: it is used
    stats = s._grad_stats()
    assert stats["update_ratio"] == s.opt.param_groups[0]["lr"] * stats["grad_norm"] / 2.0
    s.close()


class _LongFirstProducer:
    """FirstProducer as it was written before its own hooks: ``capture.LeafCalls`` with a parent hook."""

    def __init__(self, model):
        from convcheck.capture import LeafCalls, made_in_own_code
        from convcheck.nested import first_tensor
        from convcheck.measure.train.nonfinite import _finite, all_finite

        self.found, self.weights, self.step_index, dirty = None, False, 0, [False]

        def blame(name, module):
            self.found = (self.step_index, name)
            self.weights = not all(all_finite(p) for p in module.parameters(recurse=False))

        def leaf(key, name, module, inputs, out):
            if self.found is None and torch.is_grad_enabled() and not all_finite(out):
                dirty[0] = True
                if _finite(inputs):
                    blame(name, module)

        def parent(call):
            if self.found is not None or not torch.is_grad_enabled():
                return
            out = first_tensor(call.output)
            if not dirty[0] and (out is None or all_finite(out)):
                return
            if made_in_own_code(call, _finite):
                blame(call.name, call.module)

        self._calls = LeafCalls(model, leaf, parent).__enter__()


class _Blows(nn.Module):
    """Own code that makes an Inf from finite values while ``blow`` is set, between two children."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.blow = nn.Linear(4, 4), nn.Linear(4, 4), False
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x):
        h = self.a(x)
        if self.blow:
            h = h * torch.tensor([1.0, 1e38, 1e38, 1.0]) * 1e9  # overflows to Inf in this module's own code
        h = self.b(h * self.gain)
        return torch.sigmoid(h)  # an Inf that reaches a sigmoid comes out finite


@pytest.mark.parametrize("where,at", [("own", 2), ("leaf", 3), ("weights", 1), ("none", 0)])
def test_first_producer_names_what_leafcalls_named(where, at):
    from convcheck.measure.train.nonfinite import FirstProducer

    torch.manual_seed(0)
    nets = [nn.Sequential(nn.Linear(3, 4), _Blows(), nn.ReLU(), nn.Linear(4, 2)) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    fast, long = FirstProducer(nets[0]), _LongFirstProducer(nets[1])
    x = torch.randn(5, 3)
    for step in range(4):
        fast.next_step(step)
        long.step_index = step
        if where in ("leaf", "weights") and step == at:
            for net in nets:
                with torch.no_grad():  # a leaf whose output overflows from finite inputs (or its weights are Inf)
                    net[3].weight.fill_(3e38 if where == "leaf" else math.inf)
        for net in nets:
            net[1].blow = where == "own" and step == at
            net(x * 1e3 if step == at else x)
        with torch.no_grad():
            for net in nets:
                net(x)  # not watched: gradients off
    assert fast.found == long.found and fast.weights == long.weights
    assert (fast.found is None) == (where == "none") and fast.weights == (where == "weights")
    fast.close()


@pytest.mark.parametrize("targets,lr", [(["cpu", "cpu:bf16"], 1e-3), (["cpu", "cpu:fp16"], 1e3),
                                        (["cpu", "cpu:float64"], 1e9)])
def test_outcomes_from_rows_are_arm_outcome_of_the_curves(targets, lr):
    from convcheck.plan.config import CompareConfig
    from convcheck.plan.recipe import build_recipe
    from convcheck.targets.spec import Target, default_judge
    from convcheck.numerics.tolerances import DEFAULT_TOLERANCES
    from convcheck.measure.train import TrainConfig, make_arms, run_training
    from convcheck.measure.train.result import arm_outcome

    torch.manual_seed(0)
    template = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    batches = [(torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 3, (4,))) for _ in range(4)]
    arms = make_arms([Target.parse(t) for t in targets], envelope=1, seed=0, judge=default_judge()[0])
    recipe = build_recipe(CompareConfig(optimizer="sgd", lr=lr))
    r = run_training(lambda t: t.place(_copy(template, torch.float64)), batches, arms,
                     TrainConfig(steps=4, seed=0, recipe=recipe))
    long = {a.target: arm_outcome(a, r.arm_curve(a.name), DEFAULT_TOLERANCES) for a in arms if a.role != "envelope"}
    assert repr(r.outcomes) == repr(long) and len(long) >= 2  # repr: NaN fields compare equal, floats exactly
    if lr > 1:
        assert any(o.first_nonfinite_step is not None for o in long.values())
