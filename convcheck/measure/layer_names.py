"""How parity rows name what they measure (torch-free: the diagnosis reads them).

A leaf module's row is labelled by its class (``Conv2d``); the row of a module with children
measures its *own code* (``parity.own_code``) and is labelled ``NaiveAttention (own code)``, or,
where NaN/Inf first appear in it, with the op that produced them: ``NaiveAttention (own code: bmm)``.
"""

from __future__ import annotations

OWN_CODE = "own code"


def own_code_label(module_type: str, op: str | None = None) -> str:
    """The ``module`` column of an own-code row: ``NaiveAttention (own code)``, or with the op
    that produced the first NaN/Inf: ``NaiveAttention (own code: bmm)``."""
    return f"{module_type} ({OWN_CODE}: {op})" if op else f"{module_type} ({OWN_CODE})"


def own_code_op(label: str) -> str | None:
    """The op named in an own-code label, if any."""
    marker = f"({OWN_CODE}: "
    return label.split(marker, 1)[1].rstrip(")") if marker in label else None


def is_own_code(label: str) -> bool:
    return f"({OWN_CODE}" in str(label)


# Normalisation layers by class name: what weight decay should skip, what a loss-reduction probe looks for.
NORM_MODULES = ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "LayerNorm", "GroupNorm")
