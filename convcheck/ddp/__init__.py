"""Data-parallel targets (``ddp:cpu:N``, ``ddp:cuda:N``): the rank-pool executor and everything behind it.

The generic layer never imports this package: ``runners.ddp.DDPRunner`` names
its executor ``rank-pool``, and ``executor`` registers it (``convcheck.targets.executors``
imports it by name, from its ``PLUGINS``) together with the verdict rule of
``rules``. Torch-free to import (``executor`` runs a hook before torch loads).

- ``executor``: ``RankPoolExecutor``: parity, training arms, findings and the process hooks of a ``ddp:`` target
- ``worker``: one rank (process group, DDP-wrapped copy, its slice of the batch, BatchNorm probe)
- ``pool``: the parent's side (start, command, watch, one-line errors, shutdown)
- ``arm``: ``DDPArmState``, a data-parallel arm in ``run_training``'s lockstep loop
- ``evidence``: ``RankMeasures``, what an arm gathers for the diagnostics
- ``parity``: the DDP-averaged gradient of one step against the judge's
- ``builder``: ``ddp_builder``, the user's data-parallel settings mirrored in the model copies
- ``syncbn``: ``GlooSyncBatchNorm``, SyncBatchNorm for gloo on the CPU
- ``launch``: started by ``torchrun`` (``RANK``/``WORLD_SIZE``...)? and do the targets fit its world?
- ``launched``: the torchrun world serving the DDP arm (a relay as rank 0, the other ranks serving)
- ``probes``: what each rank measures for the diagnostics
- ``diagnostics``: per-rank BatchNorm statistics, a loss off by the world size... -> ``DDPFinding``
- ``rules``: verdict rule V009 ``ddp-setup`` (category ``setup``, sub-cause ``ddp``) over those findings
"""
