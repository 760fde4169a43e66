"""``RankMeasures``: what the ranks of a data-parallel arm measured, step by step, for its diagnostics.

``DDPArmState`` fills it; ``run_training`` keeps it, opaque, in
``TrainResult.arm_evidence[arm]``; the detectors of ``diagnostics`` read it and make ``DDPFinding``s.
(Not ``diagnose.watched_evidence.RankEvidence``: the findings of watched DDP runs' ranks, which the
verdict rules read.)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RankMeasures:
    # per step, {BatchNorm layer: (largest per-rank mean shift in global std, largest relative per-rank std change)}
    batchnorm: list[dict[str, tuple[float, float]]] = field(default_factory=list)
    slices: list[list[str]] = field(default_factory=list)  # per step, each rank's slice hash
    buffers: list[dict[str, float]] = field(default_factory=list)  # per step, {buffer: relative spread across ranks}
    # per step, the same as the step's first forward ends (a buffer equal before it and not after: set per rank)
    buffers_after: list[dict[str, float]] = field(default_factory=list)
    draws: dict | None = None  # from step 1: {"layers", "same_on_every_rank"} (modules drawing unshared numbers)
    rank_batch: int | None = None  # the samples each rank's slice holds (the global batch / the world size)
