"""A data-parallel arm in the lockstep training loop: the parent's proxy for N rank processes.

``DDPArmState`` offers what ``run_training`` uses of an ``ArmState`` (``arm``,
``model``, ``step``, ``step_index``, ``producer``, ``close``): each ``step``
sends the global batch to the ranks (``RankPool``), which train their
DDP-wrapped copies on their slices; rank 0's answer (the all-reduced mean
loss, gradient norms of the averaged gradient) comes back; its parameters
are written by rank 0 into tensors in shared memory and copied from there into
``model``, a mirror in this process that parameter distances to the judge and
the other arms read (its buffers come with the last step's answer). ``evidence``
(a ``RankMeasures``) keeps, per step, the per-rank BatchNorm statistics' deviation
from the global batch's, each rank's slice hash, the buffers that differ across
ranks, and from the first step the modules drawing unshared random numbers
(``convcheck.ddp.probes``): what ``diagnostics`` reads.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from convcheck.ddp.evidence import RankMeasures
from convcheck.ddp.rank_pool import collective_timeout, threads_per_rank
from convcheck.ddp.pool_choice import open_pool
from convcheck.ddp.worker import RankJob
from convcheck.errors import UsageError
from convcheck.measure.train.arms import Arm, perturb_


def check_batch_splits(x, world: int, target) -> None:
    from convcheck.batch import batch_size_of

    n = batch_size_of(x)
    if n % world:
        raise UsageError(f"target {target}: the global batch of {n} does not split evenly over {world} ranks "
                         f"(pick a --batch-size that is a multiple of {world})")


def slice_hashes(x, y, world: int) -> list[str]:
    """Each rank's slice of the global batch, hashed (its samples and targets)."""
    from convcheck.batch import batch_hash
    from convcheck.ddp.worker import rank_slice

    return [batch_hash(rank_slice(x, r, world), rank_slice(y, r, world)) for r in range(world)]


class DDPArmState:
    def __init__(self, arm: Arm, build, steps: int, recipe, sync_bn: bool = False):
        """``build(target)`` is called with the data-parallel target in the ranks (a builder may treat
        it differently: ``builder.ddp_builder``), with the per-rank target for the mirror here."""
        self.arm = arm
        self.runner = arm.target.runner
        inner = arm.target.per_rank
        self.model = build(inner)  # the mirror: rank 0's state after every step
        if arm.perturb_seed is not None:
            perturb_(self.model, self.runner.ulp, arm.perturb_seed)
        self.step_index = 0
        self.producer: tuple[int, str] | None = None
        self.losses: list[float] = []
        self.evidence = RankMeasures()
        # rank 0 writes its parameters here after every step (shared memory: nothing is pickled per step)
        self.shared = {n: torch.empty(p.shape, dtype=p.dtype).share_memory_() for n, p in self.model.named_parameters()}
        job = RankJob(arm=replace(arm, target=inner), build=build,  # every_step included: each rank nudges alike
                      target=arm.target,
                      steps=steps, recipe=recipe, timeout_s=collective_timeout(),
                      threads=threads_per_rank(self.runner.world), sync_bn=sync_bn, shared_params=self.shared)
        self.pool = open_pool(arm.target, job)

    def step(self, x, y, seed: int, rng_seed: int) -> dict:
        check_batch_splits(x, self.runner.world, self.arm.target)
        r = self.pool.call("step", x, y, seed, rng_seed, what=f"training step {self.step_index + 1}")
        self._mirror(r.pop("params", None), r.pop("buffers_state", None))
        producer = r.pop("producer")
        if self.producer is None and producer is not None:
            self.producer = (self.step_index, producer[1])
        self.evidence.batchnorm.append(r.pop("bn"))
        self.evidence.buffers.append(r.pop("buffers"))
        self.evidence.buffers_after.append(r.pop("buffers_after"))
        draws = r.pop("draws")
        if draws is not None:
            self.evidence.draws = draws
        self.evidence.slices.append(slice_hashes(x, y, self.runner.world))
        if self.evidence.rank_batch is None:
            from convcheck.batch import batch_size_of

            self.evidence.rank_batch = batch_size_of(x) // self.runner.world
        self.losses.append(r["loss"])
        return r

    @torch.no_grad()
    def _mirror(self, params: dict | None, buffers: dict | None) -> None:
        """Rank 0's parameters (shared memory, or the answer's) into the mirror; its buffers when sent."""
        source = params if params is not None else self.shared
        for n, p in self.model.named_parameters():
            p.copy_(source[n])
        for n, b in (self.model.named_buffers() if buffers else ()):
            b.copy_(buffers[n])

    def close(self) -> None:
        self.pool.close()
