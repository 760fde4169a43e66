"""Data-parallel targets (``ddp:cpu:N``, ``ddp:cuda:N``): DistributedDataParallel over N processes.

A ``DDPRunner`` wraps the runner of the per-rank target (``ddp:cpu:2:bf16`` ->
the ``cpu:bf16`` runner) and answers everything numeric with it: each rank
runs exactly that kind of target on its slice of the global batch. What is
special is where the work runs: in N worker processes driven step by step by
its executor, ``rank-pool`` (``convcheck.ddp.executor``, gloo on the CPU, NCCL
on GPUs), which registers itself; this module knows it by that name only. It
is not registered in the mode registry: ``Target.parse`` builds it for the
``ddp:`` prefix.
"""

from __future__ import annotations

import torch

from convcheck.targets.runners.base import Runner
from convcheck.targets.runners.launcher import launched_world


class DDPRunner(Runner):
    """N processes, each one ``inner`` runner on 1/N of the batch, gradients averaged by DDP."""

    modes = ()
    devices = ("cpu", "cuda")
    executor = "rank-pool"

    def __init__(self, target, inner: Runner):
        super().__init__(target)
        self.inner = inner

    @property
    def world(self) -> int:
        return int(self.target.world)

    @property
    def backend(self) -> str:
        return "nccl" if self.target.device == "cuda" else "gloo"

    def describe(self) -> str:
        return (f"DistributedDataParallel, {self.world} processes over {self.backend}, "
                f"each {self.inner.describe()}")

    # -- numerics: those of one rank ----------------------------------------------------

    @property
    def param_dtype(self) -> torch.dtype:
        return self.inner.param_dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.inner.compute_dtype

    @property
    def precision(self):
        return self.inner.precision

    @property
    def torch_device(self) -> torch.device:
        return self.inner.torch_device

    @property
    def parity_loss_scale(self) -> float:
        return self.inner.parity_loss_scale

    def unavailable_reason(self) -> str | None:
        import torch.distributed as dist

        if not dist.is_available():
            return "this torch build has no torch.distributed"
        if self.backend == "gloo":
            return None if dist.is_gloo_available() else "this torch build has no gloo backend"
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        launched = launched_world()
        if launched is not None and launched.world == self.world:  # torchrun's ranks: this node's GPU only
            local = launched.local_rank or 0
            if visible <= local:
                return (f"{self.target} under torchrun: local rank {local} runs on GPU {local}, "
                        f"{visible} visible on this node")
        elif visible < self.world:
            return (f"{self.target} needs {self.world} CUDA GPU{'s' if self.world > 1 else ''}, {visible} visible "
                    f"(one process per GPU; ddp:cpu:{self.world} runs the same check over gloo on the CPU)")
        if not dist.is_nccl_available():
            return "this torch build has no NCCL backend"
        return None

    def _enter(self, stack) -> None:
        self.inner._enter(stack)

    def autocast(self):
        return self.inner.autocast()

    def place(self, model):
        return self.inner.place(model)

    def cast_input(self, x):
        return self.inner.cast_input(x)

    def make_grad_scaler(self):
        return self.inner.make_grad_scaler()

    def forward_loss(self, model, x, y, loss_fn):
        return self.inner.forward_loss(model, x, y, loss_fn)

    def backward(self, loss, scale: float = 1.0) -> None:
        self.inner.backward(loss, scale)

    def train_backward(self, loss, optimizer, scaler) -> None:
        self.inner.train_backward(loss, optimizer, scaler)

    def optimizer_step(self, optimizer, scaler):
        return self.inner.optimizer_step(optimizer, scaler)

    def local_backward(self, module, args, grad_output):
        return self.inner.local_backward(module, args, grad_output)
