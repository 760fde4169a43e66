"""The arms of a comparison: the two targets, the judge, and the perturbation envelope."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from convcheck.targets import Target


@dataclass(frozen=True)
class Arm:
    """One training run: a target, its role, and (for envelope runs) the perturbation seed."""

    name: str
    target: Target
    role: str  # "target" | "judge" | "envelope"
    perturb_seed: int | None = None
    reference: str | None = None  # the arm an envelope run perturbs


def lower_precision(targets: list[Target]) -> Target:
    """B, the target with the larger unit roundoff (the second one on a tie; on a tie between a
    single-device and a data-parallel target, the single-device one: its envelope is what the
    data-parallel run is held to)."""
    a, b = targets[0], targets[1]
    if a.unit_roundoff == b.unit_roundoff and (a.world is None) != (b.world is None):
        return a if a.world is None else b
    return a if a.unit_roundoff > b.unit_roundoff else b


def make_arms(targets: list[Target], envelope: int, seed: int, judge: Target) -> list[Arm]:
    """The two targets, the judge, and ``envelope`` perturbed runs of the lower-precision target."""
    arms = [Arm(str(t), t, "target") for t in targets if t != judge]
    arms.append(Arm(str(judge), judge, "judge"))
    if envelope > 0:
        ref = lower_precision(targets)
        for k in range(envelope):
            arms.append(Arm(f"{ref}~{k + 1}", ref, "envelope", perturb_seed=(seed * 1000 + k + 1) % 2**63,
                            reference=str(ref)))
    return arms


def perturb_(model: nn.Module, ulp: float, seed: int) -> None:
    """Move every floating parameter by one ulp (relative) in a random direction, in place."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_floating_point():
                continue
            # the same draws as int64 (one 32-bit draw per element whatever the dtype), kept as bytes;
            # each element is multiplied by one of the two factors 1 + sign * ulp, computed in p's dtype
            up = torch.randint(0, 2, p.shape, generator=gen, dtype=torch.uint8).bool().to(p.device)
            down_f, up_f = 1 + torch.tensor([-1, 1], dtype=p.dtype, device=p.device) * ulp
            p.mul_(torch.where(up, up_f, down_f))
