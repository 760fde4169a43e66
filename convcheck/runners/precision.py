"""A runner's precision model: unit roundoff of operands and of accumulation, per op class.

Unit roundoffs (FACTS.md): float64 2^-53, float32 2^-24, TF32 2^-11,
float16 2^-11, bfloat16 2^-8. Op classes: ``matmul`` (Linear, mm/bmm),
``conv`` (convolutions), ``elementwise`` (everything else: activations,
normalisation, pooling, additions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

U_FLOAT64 = 2.0**-53
U_FLOAT32 = 2.0**-24
U_TF32 = 2.0**-11
U_FLOAT16 = 2.0**-11
U_BFLOAT16 = 2.0**-8

OP_CLASSES = ("matmul", "conv", "elementwise")


@dataclass(frozen=True)
class OpPrecision:
    operand: float  # unit roundoff of the values an op reads (its inputs after any rounding)
    accumulate: float  # unit roundoff of the sums it forms


@dataclass(frozen=True)
class PrecisionModel:
    matmul: OpPrecision
    conv: OpPrecision
    elementwise: OpPrecision

    @classmethod
    def uniform(cls, u: float) -> "PrecisionModel":
        p = OpPrecision(u, u)
        return cls(p, p, p)

    def of(self, op_class: str) -> OpPrecision:
        return getattr(self, op_class)

    @property
    def working(self) -> float:
        """The coarsest operand roundoff of any op class: the precision the run works in."""
        return max(self.matmul.operand, self.conv.operand, self.elementwise.operand)

    def for_module(self, module: nn.Module) -> OpPrecision:
        return self.of(op_class(module))


def op_class(module: nn.Module) -> str:
    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    if isinstance(module, (nn.Linear, nn.Bilinear, nn.MultiheadAttention)):
        return "matmul"
    return "elementwise"
