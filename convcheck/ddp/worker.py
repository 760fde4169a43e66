"""One rank of a data-parallel target: its process, its DDP-wrapped copy, its slice of each batch.

``rank_main`` runs in a worker process (started by ``convcheck.ddp.rank_pool``):
it joins the process group (gloo on 127.0.0.1, a timeout on every
collective), builds the arm's model from the shared initial weights through
the per-rank runner, wraps it in ``DistributedDataParallel`` and answers the
parent's commands one at a time: ``step`` (one training step on this rank's
rank-ordered slice of the global batch), ``grads`` (parity: one
forward/backward, no update, the DDP-averaged gradients). Rank 0 sends the
results back; every rank sends errors back, as one line naming the rank.
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from convcheck.capture import SharedDropoutMasks
from convcheck.ddp.probes import BatchNormProbe, BufferProbe, DrawProbe
from convcheck.ddp.syncbn import swap_sync_batchnorm
from convcheck.measure.train.arm_state import ArmState
from convcheck.measure.train.arms import Arm
from convcheck.nested import map_tensors


@dataclass
class RankJob:
    """What every rank needs to build its copy: inherited by fork (``ddp:cpu:N``), pickled for spawn
    (``ddp:cuda:N``, or ``CONVCHECK_DDP_START=spawn``): then ``build`` and ``recipe`` must pickle."""

    arm: Arm  # the arm with the per-rank target
    build: Callable  # build(target) -> model with the shared initial weights
    steps: int
    recipe: Any
    timeout_s: float
    threads: int
    sync_bn: bool = False  # convert BatchNorm to SyncBatchNorm (as --ddp-sync-bn does through the builder)
    target: Any = None  # the data-parallel target (build is called with it; None: the arm's)
    # {parameter: CPU tensor in shared memory}: rank 0 writes its parameters there after every step, so the
    # parent reads them without a copy through the pipe (None: they travel in the answer)
    shared_params: dict | None = None


def rank_slice(x, rank: int, world: int):
    """Rank ``rank``'s rank-ordered share of a global batch (tensors split on dim 0)."""
    def cut(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[0] // world
        return t.narrow(0, rank * n, n) if t.dim() else t
    return map_tensors(x, cut)


class RankDropoutMasks(SharedDropoutMasks):
    """The single-device arms' masks for the global batch, this rank's rows of them."""

    def __init__(self, model: nn.Module, seed: int, rank: int, world: int):
        super().__init__(model, seed)
        self.rank, self.world = rank, world

    def _keep(self, module, x, gen, rows=None):
        """The global batch's mask (the single-device arms' draw), this rank's rows of it."""
        keep = super()._keep(module, x, gen, rows=x.shape[0] * self.world)
        return keep.narrow(0, self.rank * x.shape[0], x.shape[0])


class RankState:
    """One rank's DDP-wrapped training state, built through the per-rank runner."""

    def __init__(self, rank: int, world: int, job: RankJob):
        self.rank, self.world, self.job = rank, world, job

        def build(target):
            model = job.build(job.target if job.target is not None else target)
            if job.sync_bn:
                model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
            return swap_sync_batchnorm(model) if target.device == "cpu" else model

        self.state = ArmState(job.arm, build, job.steps, job.recipe,
                              masks=lambda m: RankDropoutMasks(m, 0, rank, world))
        self.module = self.state.model
        self.probe = BatchNormProbe(self.module)
        self.buffers = BufferProbe(self.module)
        cuda = job.arm.target.device == "cuda"  # NCCL: this rank's GPU (set in rank_main), collectives on it
        self.draws = DrawProbe(self.module, cuda)  # the first training step only
        self.comm_device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        # the user's DDP setting where convcheck mirrors it (--ddp-no-broadcast-buffers: ddp_builder)
        self.state.model = _wrap(self.module, [self.comm_device] if cuda else None,
                                 bool(getattr(job.build, "broadcast_buffers", True)))

    def _mean(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(t)
        return float(t[0]) / self.world

    def step(self, x, y, seed: int, rng_seed: int) -> dict | None:
        r = self.state.step(rank_slice(x, self.rank, self.world), rank_slice(y, self.rank, self.world),
                            seed, rng_seed)
        self.state.step_index += 1
        r["loss"] = self._mean(r["loss"])
        r["nonfinite_loss"] = not math.isfinite(r["loss"])
        r["bn"] = self.probe.deviations(self.world)
        r["buffers_after"] = self.buffers.spreads_after(self.comm_device)
        r["buffers"] = self.buffers.spreads(self.comm_device)
        r["draws"] = self.draws.finish(self.comm_device) if self.draws.active else None
        if self.rank != 0:
            return None
        self._publish(r)
        r["producer"] = self.state.producer
        return r

    @torch.no_grad()
    def _publish(self, r: dict) -> None:
        """Rank 0's parameters into the shared tensors (or the answer); its buffers on the last step only
        (nothing in the parent reads a mirror's buffers before the run ends)."""
        shared = self.job.shared_params
        if shared is None:
            r["params"] = {n: p.detach().to("cpu", copy=True) for n, p in self.module.named_parameters()}
        else:
            for n, p in self.module.named_parameters():
                shared[n].copy_(p.detach())
        if self.state.step_index >= self.job.steps:
            r["buffers_state"] = {n: b.detach().to("cpu", copy=True) for n, b in self.module.named_buffers()}

    def grads(self, x, y, seed: int, scale: float) -> dict | None:
        """Parity: one forward/backward on this rank's slice, no update; rank 0 returns the averaged
        gradients (unscaled), the all-reduced mean loss and the BatchNorm deviations."""
        runner = self.state.runner
        masks = self.state.masks
        masks.seed, masks._calls = seed, 0
        model = self.state.model
        for p in model.parameters():
            p.grad = None
        with runner.applied():
            _, loss = runner.forward_loss(model, rank_slice(x, self.rank, self.world),
                                          rank_slice(y, self.rank, self.world), self.state.loss_fn)
            runner.backward(loss, scale)
        mean_loss = self._mean(float(loss.detach()))
        bn = self.probe.deviations(self.world)
        if self.rank != 0:
            return None
        grads = {n: p.grad.detach().cpu() / scale for n, p in self.module.named_parameters() if p.grad is not None}
        return dict(loss=mean_loss, grads=grads, bn=bn)


def _wrap(module: nn.Module, device_ids, broadcast_buffers: bool) -> DistributedDataParallel:
    if broadcast_buffers:
        return DistributedDataParallel(module, device_ids=device_ids)
    import warnings

    with warnings.catch_warnings():  # torch >= 2.10 deprecates it, yet asks to keep it for rank-local buffers
        warnings.simplefilter("ignore", FutureWarning)
        return DistributedDataParallel(module, device_ids=device_ids, broadcast_buffers=False)


def die_with_parent() -> None:
    """Linux: this process gets SIGTERM when the parent dies (no orphans after a killed parent)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the closed pipe ends the loop instead
        pass


def rank_main(rank: int, world: int, port: int, conn, job: RankJob, backend: str = "gloo") -> None:
    """A worker process: join the group, build, answer commands until ``close`` or the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops us
    die_with_parent()
    torch.set_num_threads(max(1, job.threads))
    try:
        if backend == "nccl":  # one GPU per rank: ddp:cuda:N runs on GPUs 0..N-1
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=job.timeout_s))
        state = RankState(rank, world, job)
        conn.send(("ok", rank, None))
        while True:
            cmd, args = conn.recv()
            if cmd == "close":
                break
            conn.send(("ok", rank, getattr(state, cmd)(*args)))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as one line
        try:
            conn.send(("error", rank, describe_rank_failure(exc)))
        except (OSError, ValueError):
            pass
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - already failing or closing
                pass
        conn.close()
        os._exit(0)


def describe_rank_failure(exc: BaseException) -> dict:
    from convcheck.errors import ConvcheckError

    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return dict(kind=type(exc).__name__, message=text, convcheck=isinstance(exc, ConvcheckError),
                exit_code=getattr(exc, "exit_code", 3), where=traceback.format_exc(limit=-1).strip().splitlines()[-3:])
