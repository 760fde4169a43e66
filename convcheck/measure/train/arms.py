"""The arms of a comparison: the two targets, the judge, and the perturbation envelope."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from convcheck.targets.spec import Target


@dataclass(frozen=True)
class Arm:
    """One training run: a target, its role, and (for envelope runs) the perturbation seed."""

    name: str
    target: Target
    role: str  # "target" | "judge" | "envelope"
    perturb_seed: int | None = None
    reference: str | None = None  # the arm an envelope run perturbs
    # an envelope run whose one-ulp nudge of the weights is repeated after every optimizer step (the null
    # model of two targets of the same precision: ``same_precision``), not only made once before step 0
    every_step: bool = False


def lower_precision(targets: list[Target]) -> Target:
    """B, the target with the larger unit roundoff (the second one on a tie; on a tie between a
    single-device and a data-parallel target, the single-device one: its envelope is what the
    data-parallel run is held to)."""
    a, b = targets[0], targets[1]
    if a.unit_roundoff == b.unit_roundoff and (a.world is None) != (b.world is None):
        return a if a.world is None else b
    return a if a.unit_roundoff > b.unit_roundoff else b


def same_precision(targets: list[Target]) -> bool:
    """Whether the two targets compute in the same number formats (their precision models: operand and
    accumulation format of every op class, ``numerics.formats``), so that they differ at most in the order
    of their reductions: a data-parallel target (its all-reduce, SyncBatchNorm), another device of the same
    float32 arithmetic, another BLAS. A target against itself as the judge (``cpu,cpu:float64``) is not."""
    if len(targets) != 2:
        return False
    a, b = targets
    return a != b and a.runner.precision == b.runner.precision


def make_arms(targets: list[Target], envelope: int, seed: int, judge: Target, *,
              every_step: bool | None = None) -> list[Arm]:
    """The two targets, the judge, and ``envelope`` perturbed runs of the lower-precision target.

    The envelope's null model: two targets of different precision differ by a coarser rounding, which a
    one-ulp nudge of the initial weights stands for; two of the same precision (``same_precision``) differ
    in reduction order, which rounds differently at every step, so their envelope runs nudge the weights by
    one ulp after every optimizer step too (``every_step``; None: decided by ``same_precision``; a bundle's
    recorded envelope runs were nudged once: ``bundle.rebuild`` says False)."""
    if len(targets) != 2:  # (the CLI and ``compare`` refuse another count with a usage error first)
        raise ValueError(f"make_arms takes the two targets, got {len(targets)}: {[str(t) for t in targets]}")
    arms = [Arm(str(t), t, "target") for t in targets if t != judge]
    arms.append(Arm(str(judge), judge, "judge"))
    if envelope > 0:
        ref = lower_precision(targets)
        every = same_precision(targets) if every_step is None else bool(every_step)
        for k in range(envelope):
            arms.append(Arm(f"{ref}~{k + 1}", ref, "envelope", perturb_seed=(seed * 1000 + k + 1) % 2**63,
                            reference=str(ref), every_step=every))
    return arms


def step_seed(perturb_seed: int, step: int) -> int:
    """The seed of an ``every_step`` envelope run's nudge after training step ``step`` (0-based): its own
    per run and step, the same on every rank of a data-parallel run (their weights stay equal)."""
    return (perturb_seed * 1_000_003 + step + 1) % 2**63


def perturb_(model: nn.Module, ulp: float, seed: int, scratch=None, slot: str | None = None) -> None:
    """Move every floating parameter by one ulp (relative) in a random direction, in place.

    Each element is multiplied by one of the two factors 1 - ulp, 1 + ulp (computed in the
    parameter's dtype), chosen by one 32-bit draw per element, ``torch.randint(0, 2)``, parameter
    after parameter. Two shortcuts, each the same values (tests/test_cheap_paths.py): randint writes
    the draws in the parameter's dtype (the same draws whatever dtype it writes), for a run of
    parameters of one dtype at once (the generator draws element after element, so one call of
    their total size draws what one call each does); and the factor is ``down + draw * (up - down)``
    where that arithmetic is exact in the dtype (``_factor_exact``, checked), instead of a bool
    tensor and ``torch.where``: a third of the time. With ``scratch`` (a ``stats.Scratch``) the draws
    go into a buffer it keeps: ``randint`` is ``empty(...).random_(low, high)``, and a fresh 47 MB
    (ResNet-18) is faulted in page by page, as long again as the draws; the envelope arms share one
    (``slot``, default ``PERTURB_SLOT``)."""
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.is_floating_point()]
    with torch.no_grad():
        i = 0
        while i < len(params):
            dtype = params[i].dtype
            j = i
            while j < len(params) and params[j].dtype == dtype:
                j += 1
            _perturb_run(params[i:j], ulp, gen, scratch, slot or PERTURB_SLOT)
            i = j


PERTURB_SLOT = "perturb"  # the Scratch slot of the draws (``run_training`` drops it once the arms are built)
STEP_PERTURB_SLOT = "perturb-step"  # the slot of the ``every_step`` nudges' draws (kept for the run)


def _perturb_run(params: list, ulp: float, gen: torch.Generator, scratch=None, slot: str = "perturb") -> None:
    """``perturb_`` for consecutive parameters of one dtype, drawing from ``gen`` in their order."""
    dtype = params[0].dtype
    down_f, up_f = 1 + torch.tensor([-1, 1], dtype=dtype) * ulp
    sizes = [p.numel() for p in params]
    exact = _factor_exact(down_f, up_f)
    kind = dtype if exact else torch.uint8
    draws = (scratch.flat(sum(sizes), kind, "cpu", slot=slot) if scratch is not None
             else torch.empty(sum(sizes), dtype=kind)).random_(0, 2, generator=gen)  # torch.randint's draws
    if exact:
        factors = draws.mul_(up_f - down_f).add_(down_f)
    else:
        factors = torch.where(draws.bool(), up_f, down_f)
    for p, f in zip(params, factors.split(sizes)):
        p.mul_(f.view(p.shape).to(p.device))


def nudged(x: torch.Tensor, ulp: float, seed: int) -> torch.Tensor:
    """A copy of the batch ``x`` with every element moved by one ulp (relative) in a random direction
    (``perturb_``'s draws and factors, from ``seed``): an ``every_step`` envelope run's inputs, so that every
    sum of the step (each layer's, the gradients' reductions) has its terms moved by about one rounding."""
    gen = torch.Generator().manual_seed(seed)
    down_f, up_f = 1 + torch.tensor([-1, 1], dtype=x.dtype) * ulp
    draws = torch.empty(x.numel(), dtype=torch.uint8).random_(0, 2, generator=gen)
    return x * torch.where(draws.bool(), up_f, down_f).view(x.shape).to(x.device)


def _factor_exact(down_f: torch.Tensor, up_f: torch.Tensor) -> bool:
    """Whether ``draw * (up - down) + down`` gives ``down`` and ``up`` exactly for draws 0 and 1."""
    draws = torch.tensor([0, 1], dtype=down_f.dtype)
    return torch.equal(draws.mul_(up_f - down_f).add_(down_f), torch.stack([down_f, up_f]))
