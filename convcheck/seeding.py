"""Seeding every random generator a run draws from, cheaply where no accelerator exists."""

from __future__ import annotations

import torch


def seed_all(seed: int) -> None:
    """``torch.manual_seed(seed)``; where no accelerator is available, only the CPU generator's.
    ``torch.manual_seed`` also queues a lazy seed for every accelerator module (CUDA, XPU, MTIA),
    each with a formatted stack trace (0.17 ms a call here, LeNet's parity seeds five times): seeds
    that could never run where there is no accelerator."""
    if torch.accelerator.is_available():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(int(seed))
