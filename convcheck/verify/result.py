"""``Verification``: what re-running the failing arm with each remedy applied showed (immutable)."""

from __future__ import annotations

import math
from dataclasses import dataclass

VERIFIED, NOT_VERIFIED, NO_ACTION, SKIPPED = "verified", "not verified", "no action", "skipped"


@dataclass(frozen=True)
class Attempt:
    """One re-run: the action (``kind``, ``text``, the ``snippet`` to paste), the arm re-run, its losses
    and outcome, whether it ``verified`` and the one line that says why; ``seconds`` it took."""

    kind: str
    text: str
    snippet: str
    arm: str
    verified: bool
    line: str
    losses: tuple[float, ...]
    converged: bool
    final_gap: float  # |final loss - the judge's| / the judge's
    allowed_gap: float
    seconds: float
    # what made the re-run's first NaN/Inf ("" when it stayed finite): "the optimizer step (Adam, eps 1e-08)
    # makes the weights of '5' NaN/Inf", "'head' produces it (exp)"; ``by_optimizer``: the former kind
    cause: str = ""
    by_optimizer: bool = False
    # the judge's losses of this re-run when the action changed the recipe (the judge re-run with it), else ()
    judge_losses: tuple[float, ...] = ()

    def to_dict(self) -> dict:
        return {"kind": self.kind, "action": self.text, "snippet": self.snippet, "arm": self.arm,
                "verified": self.verified, "line": self.line, "converged": self.converged,
                "losses": [_num(v) for v in self.losses], "final_gap": _num(self.final_gap),
                "allowed_gap": _num(self.allowed_gap), "seconds": round(self.seconds, 4), "cause": self.cause,
                "judge_losses": [_num(v) for v in self.judge_losses]}


@dataclass(frozen=True)
class Verification:
    """The verify stage's result. ``status``: ``verified`` (an action made the arm converge and track the
    judge), ``not verified`` (every action tried failed: the diagnosis is doubtful), ``no action`` (no remedy
    of this verdict is one convcheck can apply), ``skipped`` (``--no-verify``, an ``ok`` verdict, or a cost
    above the default's budget: ``reason`` says which). ``line`` is what the terminal, summary.json and
    ``assert_parity`` show. ``untried`` counts the fitting actions not run (the default stops after one);
    ``cost_ratio`` is the re-runs' time over one training run of one arm."""

    status: str
    line: str
    attempts: tuple[Attempt, ...] = ()
    untried: tuple[str, ...] = ()
    reason: str = ""
    cost_ratio: float = 0.0

    @property
    def verified(self) -> Attempt | None:
        return next((a for a in self.attempts if a.verified), None)

    def __bool__(self) -> bool:
        return self.status == VERIFIED

    def to_dict(self) -> dict:
        return {"status": self.status, "line": self.line, "attempts": [a.to_dict() for a in self.attempts],
                "untried": list(self.untried), "reason": self.reason, "cost_ratio": _num(self.cost_ratio)}


def _num(v: float):
    return float(v) if math.isfinite(v) else None
