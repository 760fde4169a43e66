"""The injected-error sweep: a convolution that is wrong by a relative EPS unless it runs in float64.

Shared by the tests (``test_detection.py``) and the benchmark (``benchmarks/floors.py``): for a
target and a reduction length K it finds the smallest EPS whose conv is flagged, and the healthy
local error ("noise") of the same conv at EPS = 0. Sensitivity = smallest flagged EPS / noise.
Both the rule in force and the old one (``old_rule``: max(8 u sqrt(K), 1e-3), on local and
intrinsic) are read from the same rows, so one sweep gives before and after.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from convcheck.measure.parity import checks, run_parity
from convcheck.targets.spec import Target
from convcheck.numerics.tolerances import DEFAULT_TOLERANCES, Tolerances

T = Target.parse

# Eighth decades (x1.33) from 1e-8 to 1 (and 2, 4: the old rule could miss even EPS = 1 in bf16).
EPS_GRID = tuple([10 ** (k / 8) for k in range(-64, 1)] + [2.0, 4.0])


class WrongConv(nn.Conv2d):
    """A 3x3 convolution whose result is multiplied by (1 + eps) whenever it does not run in float64."""

    def __init__(self, channels: int, eps: float):
        super().__init__(channels, 16, 3, padding=1)
        self.eps = eps

    def forward(self, x):
        out = super().forward(x)
        if out.dtype == torch.float64 or self.eps == 0:
            return out
        return (out.float() * (1.0 + self.eps)).to(out.dtype)


def wrong_conv_net(channels: int, eps: float) -> nn.Module:
    """K = 9 * channels; the conv is the first layer so its input is the batch itself."""
    return nn.Sequential(WrongConv(channels, eps), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                         nn.Linear(64, 4))


def old_rule(row) -> bool:
    """Before issue 10: flagged when local and intrinsic both exceed max(8 u sqrt(K), 1e-3)."""
    bound = max(8.0 * row["u"] * math.sqrt(max(1, row["K"])), 1e-3)
    return bool(row["local"] > bound and row["intrinsic"] > bound)


def conv_row(target: str, channels: int, eps: float, tolerances: Tolerances = DEFAULT_TOLERANCES,
             batch: int = 4, seed: int = 0):
    """The conv's forward row and whether that row is flagged and the target's first flagged layer
    (its gradient rows may flag it sooner: the injected error scales them too)."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = wrong_conv_net(channels, eps).double()
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    x = torch.randn((batch, channels, 8, 8), generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (batch,), generator=gen)

    def build(t: Target) -> nn.Module:
        m = wrong_conv_net(channels, eps)
        m.load_state_dict(state)
        t.runner.place(m)
        for name, p in m.state_dict().items():
            if p.is_floating_point():
                p.copy_(state[name].to(p.dtype))
        return m.train()

    r = run_parity(build, (x, y), [Target.parse(target)], tolerances=tolerances, seed=seed)
    t = r.layers
    row = t[(t["kind"] == "forward") & (t["layer"] == "0")].iloc[0]
    return row, bool(row["flagged"]) and r.first_flagged[T(target)] == "0"


@dataclass
class Limit:
    target: str
    K: int
    noise: float  # healthy local error of the conv (EPS = 0)
    floor: float  # its floor
    eps_after: float  # smallest EPS flagged by the rule in force (inf: none on the grid)
    eps_before: float  # ... by the old rule

    @property
    def after(self) -> float:
        return self.eps_after / self.noise

    @property
    def before(self) -> float:
        return self.eps_before / self.noise


def _smallest(flagged_at, grid=EPS_GRID) -> float:
    """Bisection for the smallest grid EPS with ``flagged_at(eps)`` (flags grow with EPS)."""
    if not flagged_at(grid[-1]):
        return math.inf
    lo, hi = -1, len(grid) - 1  # flagged_at(grid[hi]) holds; grid[lo] is not flagged (or below the grid)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if flagged_at(grid[mid]):
            hi = mid
        else:
            lo = mid
    return grid[hi]


def detection_limit(target: str, channels: int, tolerances: Tolerances = DEFAULT_TOLERANCES,
                    before: bool = True) -> Limit:
    """Noise, floor and the smallest flagged EPS (rule in force and, with ``before``, the old rule)."""
    with checks.measuring_all():  # the healthy conv's own floor, not the cheap lower bound
        healthy, _ = conv_row(target, channels, 0.0, tolerances)
    cache: dict[float, tuple] = {}

    def row_at(eps):
        if eps not in cache:
            cache[eps] = conv_row(target, channels, eps, tolerances)
        return cache[eps]

    after = _smallest(lambda e: row_at(e)[1])
    old = _smallest(lambda e: old_rule(row_at(e)[0])) if before else math.nan
    return Limit(target, int(healthy["K"]), float(healthy["local"]), float(healthy["floor"]), after, old)
