"""Helpers more than one renderer needs. A leaf: it imports no other ``convcheck.report`` module."""

from __future__ import annotations


def training_rule(cfg) -> str:
    """The convergence rule in words, with the ratio from ``cfg.tolerances``."""
    from convcheck.measure.train import CONVERGED_RULE

    return CONVERGED_RULE.format(ratio=cfg.tolerances.converged_loss_ratio)
