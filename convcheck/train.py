"""Lockstep training on every arm, and the perturbation envelope; per-step curves.

Every arm (the two targets, the judge, and the envelope runs of the
lower-precision target) starts from the same initial weights and sees the same
batches in the same order, one step at a time. Per step and arm we keep
scalars only: the loss, the global and per-layer gradient norms, the relative
parameter distance to the judge (and, for envelope runs, to the target they
perturb), non-finite flags, the GradScaler's scale and skipped steps, and the
activation statistics the training-problem detectors read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F

from convcheck.capture import SharedDropoutMasks, leaf_modules, tensors_in
from convcheck.metrics import DEFAULT_TOLERANCES, Tolerances
from convcheck.targets import JUDGE, Target

ModelBuilder = Callable[[Target], nn.Module]
Progress = Callable[[int, int], None]

OPTIMIZERS = ("sgd", "adam")

CURVE_COLUMNS = [
    "arm", "role", "target", "step", "loss", "grad_norm", "dist_judge", "dist_ref", "dist_other",
    "nonfinite_loss", "nonfinite_grad", "loss_scale", "skipped", "update_ratio",
]


@dataclass(frozen=True)
class Arm:
    """One training run: a target, its role, and (for envelope runs) the perturbation seed."""

    name: str
    target: Target
    role: str  # "target" | "judge" | "envelope"
    perturb_seed: int | None = None
    reference: str | None = None  # the arm an envelope run perturbs


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 30
    optimizer: str = "adam"
    lr: float = 1e-3
    momentum: float = 0.9
    seed: int = 0


@dataclass
class TrainResult:
    curves: pd.DataFrame  # one row per (arm, step)
    layer_grads: pd.DataFrame  # arm, step, layer, grad_norm, zero_frac
    activations: pd.DataFrame  # arm, step, layer, kind, dead_frac, saturated_frac
    arms: list[Arm]
    config: TrainConfig
    per_target: dict[str, dict] = field(default_factory=dict)
    # Per arm: (step, layer) where a leaf module first turned finite inputs into a
    # non-finite output during training, or None.
    nonfinite_producer: dict[str, tuple[int, str] | None] = field(default_factory=dict)

    def arm_curve(self, name: str) -> pd.DataFrame:
        return self.curves[self.curves["arm"] == name]


def converged(losses: list[float], tol: Tolerances = DEFAULT_TOLERANCES) -> bool:
    """The rule: every loss finite, and the mean of the last three losses is below
    ``tol.converged_loss_ratio`` times the first loss."""
    if not losses or not all(math.isfinite(v) for v in losses):
        return False
    tail = losses[-3:] if len(losses) >= 4 else losses[-1:]
    return sum(tail) / len(tail) < tol.converged_loss_ratio * losses[0]


CONVERGED_RULE = ("converged = every loss finite and mean(last 3 losses) < {ratio:g} x first loss")


def perturb_(model: nn.Module, ulp: float, seed: int) -> None:
    """Move every floating parameter by one ulp (relative) in a random direction, in place."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_floating_point():
                continue
            sign = torch.randint(0, 2, p.shape, generator=gen, dtype=torch.int64).to(p.dtype) * 2 - 1
            p.mul_(1 + sign.to(p.device) * ulp)


def _make_optimizer(name: str, params, cfg: TrainConfig):
    if name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)
    if name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr)
    raise ValueError(f"unknown optimizer {name!r}")


class _ArmState:
    def __init__(self, arm: Arm, build: ModelBuilder, cfg: TrainConfig):
        self.arm = arm
        self.model = build(arm.target)
        if arm.perturb_seed is not None:
            perturb_(self.model, arm.target.ulp, arm.perturb_seed)
        self.opt = _make_optimizer(cfg.optimizer, self.model.parameters(), cfg)
        self.scaler = arm.target.make_grad_scaler()
        self.layers = [(n, m) for n, m in leaf_modules(self.model)
                       if any(True for _ in m.parameters(recurse=False))]
        self.acts: list[tuple[str, str, float, float]] = []
        self.step_index = 0
        self.producer: tuple[int, str] | None = None
        self.masks = SharedDropoutMasks(self.model, 0)
        self.masks.__enter__()  # registered first: the hooks below see the shared-mask output
        self._hooks = [m.register_forward_hook(self._act_hook(n))
                       for n, m in leaf_modules(self.model)
                       if isinstance(m, (nn.ReLU, nn.Sigmoid, nn.Tanh))]
        self._hooks += [m.register_forward_hook(self._finite_hook(n)) for n, m in leaf_modules(self.model)]

    def _finite_hook(self, name):
        def hook(module, inputs, output):
            if self.producer is not None or not torch.is_grad_enabled():
                return
            outs = tensors_in(output)
            if outs and not all(_all_finite(t) for t in outs):
                if all(_all_finite(t) for t in tensors_in(inputs)):
                    self.producer = (self.step_index, name)
        return hook

    def _act_hook(self, name):
        def hook(module, inputs, output):
            if not torch.is_grad_enabled():
                return
            with torch.no_grad():
                if isinstance(module, nn.ReLU):
                    dead = float((output <= 0).float().mean())
                    self.acts.append((name, "relu", dead, math.nan))
                else:  # saturated sigmoid/tanh: pre-activations outside +-5 (DeepDiagnosis)
                    sat = float((inputs[0].abs() > 5).float().mean())
                    self.acts.append((name, type(module).__name__.lower(), math.nan, sat))
        return hook

    def close(self):
        for h in self._hooks:
            h.remove()
        self.masks.__exit__(None, None, None)

    def step(self, x: torch.Tensor, y: torch.Tensor, seed: int, rng_seed: int) -> dict:
        t = self.arm.target
        self.acts = []
        self.masks.seed = seed  # dropout masks: the same on every arm at this step
        self.masks._calls = 0
        with t.applied():
            # Any other random draw differs per arm, as it would on another device;
            # parity's probe names the layers that make such draws.
            torch.manual_seed(rng_seed)
            self.opt.zero_grad(set_to_none=True)
            with t.autocast():
                out = self.model(t.cast_input(x))
            # half-precision logits are upcast for the loss; the judge keeps float64
            loss = F.cross_entropy(out.float() if out.dtype in (torch.float16, torch.bfloat16) else out,
                                   t.cast_input(y))
            loss_value = float(loss.detach())
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
                self.scaler.unscale_(self.opt)
            else:
                loss.backward()
            layer_norms, zero_fracs = [], []
            total_sq = 0.0
            for name, m in self.layers:
                grads = [p.grad.detach() for p in m.parameters(recurse=False) if p.grad is not None]
                if not grads:
                    continue
                sq = sum(float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2 for g in grads)
                total_sq += sq
                zeros = sum(int((g == 0).sum()) for g in grads)
                layer_norms.append((name, math.sqrt(sq) if math.isfinite(sq) else math.inf))
                zero_fracs.append(zeros / max(1, sum(g.numel() for g in grads)))
            grad_norm = math.sqrt(total_sq) if math.isfinite(total_sq) else math.inf
            weight_sq = sum(float(torch.linalg.vector_norm(p.detach(), dtype=torch.float64)) ** 2
                            for p in self.model.parameters())
            lr = self.opt.param_groups[0]["lr"]
            update_ratio = lr * grad_norm / math.sqrt(weight_sq) if weight_sq > 0 else math.nan
            skipped = False
            scale = math.nan
            if self.scaler is not None:
                before = self.scaler.get_scale()
                self.scaler.step(self.opt)
                self.scaler.update()
                scale = self.scaler.get_scale()
                skipped = scale < before
            elif math.isfinite(loss_value) and math.isfinite(grad_norm):
                self.opt.step()
            else:
                self.opt.step()  # a non-finite step is a result: let it poison the weights as it would
        return dict(
            loss=loss_value, grad_norm=grad_norm,
            nonfinite_loss=not math.isfinite(loss_value),
            nonfinite_grad=not math.isfinite(grad_norm) and self.scaler is None,
            loss_scale=scale, skipped=skipped, update_ratio=update_ratio,
            layer_norms=layer_norms, zero_fracs=zero_fracs, acts=list(self.acts),
        )


def _all_finite(t: torch.Tensor) -> bool:
    """One reduction instead of an elementwise isfinite: a NaN/Inf anywhere makes the sum non-finite."""
    if not t.is_floating_point():
        return True
    return math.isfinite(float(t.detach().sum(dtype=torch.float64)))


def _param_distance(a: nn.Module, b: nn.Module) -> float:
    """||theta_a - theta_b|| / ||theta_b|| over every parameter, in float64 on the CPU."""
    num = den = 0.0
    for pa, pb in zip(a.parameters(), b.parameters()):
        vb = pb.detach().to("cpu", torch.float64)
        num += float(torch.linalg.vector_norm(pa.detach().to("cpu", torch.float64) - vb)) ** 2
        den += float(torch.linalg.vector_norm(vb)) ** 2
    if not math.isfinite(num):
        return math.inf
    return math.sqrt(num / den) if den > 0 else math.nan


def make_arms(targets: list[Target], envelope: int, seed: int) -> list[Arm]:
    """The two targets, the judge, and ``envelope`` perturbed runs of the lower-precision target."""
    arms = [Arm(str(t), t, "target") for t in targets if t != JUDGE]
    arms.append(Arm(str(JUDGE), JUDGE, "judge"))
    if envelope > 0:
        ref = lower_precision(targets)
        for k in range(envelope):
            arms.append(Arm(f"{ref}~{k + 1}", ref, "envelope", perturb_seed=seed * 1000 + k + 1,
                            reference=str(ref)))
    return arms


def lower_precision(targets: list[Target]) -> Target:
    """B, the target with the larger unit roundoff (the second one on a tie)."""
    a, b = targets[0], targets[1]
    return a if a.unit_roundoff > b.unit_roundoff else b


def run_training(
    build: ModelBuilder,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    arms: list[Arm],
    cfg: TrainConfig,
    *,
    tolerances: Tolerances = DEFAULT_TOLERANCES,
    progress: Progress | None = None,
) -> TrainResult:
    """Train every arm for ``cfg.steps`` steps in lockstep; return per-step curves."""
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {cfg.optimizer!r}")
    states = [_ArmState(arm, build, cfg) for arm in arms]
    by_name = {s.arm.name: s for s in states}
    judge = next((s for s in states if s.arm.role == "judge"), None)
    pair = [s for s in states if s.arm.role == "target"]
    other = {a.arm.name: b for a, b in zip(pair, reversed(pair))} if len(pair) == 2 else {}
    if len(pair) == 1 and judge is not None:  # the other target is the judge itself (cpu,cpu:float64)
        other = {pair[0].arm.name: judge}
    rows, grad_rows, act_rows = [], [], []
    total = cfg.steps * len(states)
    try:
        for step in range(cfg.steps):
            x, y = batches[step % len(batches)]
            step_seed = cfg.seed * 100003 + step
            results = {}
            for i, s in enumerate(states):
                s.step_index = step
                results[s.arm.name] = s.step(x, y, step_seed, step_seed * 16 + i)
                if progress:
                    progress(step * len(states) + i + 1, total)
            for s in states:
                r = results[s.arm.name]
                ref = by_name.get(s.arm.reference) if s.arm.reference else None
                rows.append(dict(
                    arm=s.arm.name, role=s.arm.role, target=str(s.arm.target), step=step,
                    loss=r["loss"], grad_norm=r["grad_norm"],
                    dist_judge=_param_distance(s.model, judge.model) if judge and s is not judge else 0.0,
                    dist_ref=_param_distance(s.model, ref.model) if ref else math.nan,
                    dist_other=_param_distance(s.model, other[s.arm.name].model) if s.arm.name in other else math.nan,
                    nonfinite_loss=r["nonfinite_loss"], nonfinite_grad=r["nonfinite_grad"],
                    loss_scale=r["loss_scale"], skipped=r["skipped"], update_ratio=r["update_ratio"],
                ))
                for (layer, norm), zf in zip(r["layer_norms"], r["zero_fracs"]):
                    grad_rows.append(dict(arm=s.arm.name, step=step, layer=layer, grad_norm=norm, zero_frac=zf))
                for layer, kind, dead, sat in r["acts"]:
                    act_rows.append(dict(arm=s.arm.name, step=step, layer=layer, kind=kind,
                                         dead_frac=dead, saturated_frac=sat))
    finally:
        for s in states:
            s.close()
    producers = {s.arm.name: s.producer for s in states}
    curves = pd.DataFrame(rows, columns=CURVE_COLUMNS)
    result = TrainResult(
        curves=curves,
        layer_grads=pd.DataFrame(grad_rows, columns=["arm", "step", "layer", "grad_norm", "zero_frac"]),
        activations=pd.DataFrame(act_rows, columns=["arm", "step", "layer", "kind", "dead_frac", "saturated_frac"]),
        arms=arms, config=cfg, nonfinite_producer=producers,
    )
    for arm in arms:
        if arm.role == "envelope":
            continue
        c = result.arm_curve(arm.name)
        losses = [float(v) for v in c["loss"]]
        bad = c[c["nonfinite_loss"] | c["nonfinite_grad"]]
        result.per_target[arm.name] = dict(
            role=arm.role,
            converged=converged(losses, tolerances),
            first_loss=losses[0] if losses else math.nan,
            final_loss=losses[-1] if losses else math.nan,
            first_nonfinite_step=int(bad["step"].iloc[0]) if len(bad) else None,
            skipped_steps=int(c["skipped"].sum()),
            final_loss_scale=float(c["loss_scale"].iloc[-1]) if len(c) else math.nan,
            final_dist_judge=float(c["dist_judge"].iloc[-1]) if len(c) else math.nan,
        )
    return result
