"""The rank-pool executor: how a ``ddp:`` target's work runs (N rank processes), registered as ``rank-pool``.

``runners.ddp.DDPRunner`` names it; ``convcheck.targets.executors`` imports this module
by name (``PLUGINS``), and importing it registers the executor and the verdict
rule V009 (``rules``). Parity gets the ranks' DDP-averaged gradient rows
(``parity``), training a ``DDPArmState`` (``arm``), the diagnosis the findings of
``diagnostics``. Process hooks: OpenMP threads that sleep while they wait, the
torchrun world (``launch``, ``launched``: serve rank 0's arm from the other ranks,
check the targets fit the world, release it at the end) and the user's
data-parallel settings in the model copies (``builder``).

Torch-free to import: ``before_threads`` runs before torch loads; the rest is
imported when a method needs it.
"""

from __future__ import annotations

import os
import sys

from convcheck.ddp import rules  # noqa: F401 - registers verdict rule V009
from convcheck.targets.executors import ArmJob, Executor, ParityStep, TargetParity, register


class RankPoolExecutor(Executor):
    """A data-parallel target's ranks: processes started here (``pool.RankPool``) or torchrun's world."""

    name = "rank-pool"
    reads_judge_record = False  # its parity compares the averaged gradients only

    def parity(self, target, step: ParityStep) -> TargetParity:
        from convcheck.ddp.parity import ddp_parity

        loss, rows, _ = ddp_parity(target, step.build, step.batch, step.judge_grads, step.loss_fn, step.seed)
        return TargetParity(loss, rows)

    def training_arm(self, arm, job: ArmJob):
        from convcheck.ddp.arm import DDPArmState

        return DDPArmState(arm, job.build, job.steps, job.recipe)

    def findings(self, training, arm: str, parity=None) -> tuple:
        from convcheck.ddp.diagnostics import arm_findings

        return tuple(arm_findings(training, arm, parity))

    def before_threads(self, specs: list[str]) -> None:
        """A data-parallel target runs its ranks and this process on the same cores; OpenMP threads that
        spin while they wait (libgomp's default) then take the cores the ranks need. Measured on 2 busy
        cores (load ~3), lenet cpu,ddp:cpu:2, 20 steps: training 10-30 s by default, 3.6-3.9 s with
        OMP_WAIT_POLICY=PASSIVE. Set before torch loads, for data-parallel targets only; yours wins."""
        if any(s.startswith("ddp:") for s in specs) and "torch" not in sys.modules:
            os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    def serve(self, config) -> int | None:
        """Under torchrun, ranks 1..N-1 serve rank 0's data-parallel arm instead of comparing."""
        from convcheck.ddp.launch import launched_world

        launched = launched_world()
        if launched is None or launched.rank in (None, 0):
            return None
        from convcheck.ddp.torchrun import serve_rank

        return serve_rank(config)

    def check_targets(self, targets) -> None:
        from convcheck.ddp.launch import check_launch

        check_launch(targets)  # under torchrun: a ddp: target of the world's size (convcheck.ddp.torchrun)

    def release(self) -> None:
        """Under torchrun, the other ranks are told to exit when the comparison ends."""
        from convcheck.ddp.torchrun import release_world

        release_world()

    def wrap_builder(self, build, config):
        """``--ddp-sync-bn`` / ``--ddp-no-broadcast-buffers``: the data-parallel copies only."""
        if not (config.ddp_sync_bn or config.ddp_no_broadcast_buffers):
            return build
        from convcheck.ddp.builder import ddp_builder

        return ddp_builder(build, sync_bn=config.ddp_sync_bn, broadcast_buffers=not config.ddp_no_broadcast_buffers)


register(RankPoolExecutor())
