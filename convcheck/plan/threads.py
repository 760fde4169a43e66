"""How many CPU threads a run uses: the caller's setting where there is one, else the faster of 1 and the default.

On a machine whose cores are shared (another job keeping one of two cores busy), torch's default
intra-op threads can make every step wait for the busy core: a LeNet compare took 9.7-10.5 s at the
default against 6.1-6.2 s at one thread (issue 28). Unless the user set the count (``--threads N``,
``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``, or ``torch.set_num_threads`` called before convcheck), the
plan times one bare training step of the judge and of each target at 1 thread and at the default
on the first batch and on throwaway copies of the model, and keeps the faster
(``measure_choice``). The same count then serves every arm and the judge; the caller's count is put
back afterwards (the plugin and the API run in the user's process). Results at a given thread count
are unchanged; the count itself is reported (header line, summary.json), so a run is repeated
exactly with ``--threads N``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# One count's step this many times the other's settles the choice after one step each; else up to
# PROBE_ROUNDS_MAX alternating rounds, fewer for a slow step, so that the probe stays a few steps of a run.
CLEAR = 1.5
PROBE_ROUNDS_MAX = 3
PROBE_BUDGET_S = 2.0


@dataclass(frozen=True)
class ThreadChoice:
    """The intra-op thread count a run used and why. ``source``: ``option`` (``--threads``), ``env``
    (an environment variable), ``caller`` (``torch.set_num_threads`` before convcheck), ``single`` (one
    core), ``kept`` (not measured, e.g. a target whose work runs in other processes) or ``measured``;
    ``step_s``: the probe's median seconds per step (the judge's and the targets' together) at each count."""

    threads: int
    reason: str
    source: str
    step_s: dict = field(default_factory=dict)

    def line(self) -> str:
        """``threads: 1 (measured faster than 2)``: the header line."""
        return f"threads: {self.threads} ({self.reason})"

    def to_dict(self) -> dict:
        return {"count": self.threads, "reason": self.reason, "source": self.source,
                "probe_step_s": {str(n): s for n, s in self.step_s.items()}}


@contextlib.contextmanager
def single_threaded():
    """torch at one intra-op thread inside, the count before put back after: for numbers that must not depend
    on the thread count (the seeded data: a threaded kernel splits its work by the count, and a chunk's
    vectorised body and scalar tail round differently, so the last bits of an upsampling or a reduction move
    with the count). Cheap enough around a prototype or a small batch; not for training."""
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def torch_default_threads() -> int | None:
    """The count torch starts with when nothing sets it: this machine's physical cores (torch asks cpuinfo,
    which counts cores, not hyper-threads); None where the topology cannot be read (not Linux)."""
    cores = set()
    for cpu in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology"):
        try:
            with open(os.path.join(cpu, "physical_package_id")) as f:
                package = f.read().strip()
            with open(os.path.join(cpu, "core_id")) as f:
                core = f.read().strip()
        except OSError:
            continue
        cores.add((package, core))
    return len(cores) or None


def _env_setting() -> str | None:
    for name in reversed(ENV_VARS):  # torch reads MKL_NUM_THREADS last: it wins where both are set
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return name
    return None


def given_choice(requested: int | None) -> ThreadChoice | None:
    """The choice the user already made (or this machine makes), or None where it is to be measured."""
    current = torch.get_num_threads()
    if requested is not None:
        return ThreadChoice(int(requested), "set with --threads", "option")
    env = _env_setting()
    if env is not None:
        return ThreadChoice(current, f"set by {env}", "env")
    default = torch_default_threads()
    if default is None:
        return ThreadChoice(current, "kept: torch's default cannot be told from a caller's setting here", "kept")
    if current != default:
        return ThreadChoice(current, f"set by torch.set_num_threads; torch's default here is {default}", "caller")
    if current == 1:
        return ThreadChoice(1, "one core here", "single")
    return None


def measure_choice(steps: Sequence[Callable[[], None]], default: int) -> ThreadChoice:
    """``steps`` (the judge's and each target's bare step) timed together at 1 thread and at ``default``;
    the faster is kept (the default where they tie). One-thread steps first: a warm-up (the first
    call's one-time costs land there), then one step at each count; where one is ``CLEAR`` times the
    other that settles it (a busy core makes the default's step several times slower: one is enough),
    else more rounds alternate, as ``PROBE_BUDGET_S`` allows, and the medians decide. Leaves torch at
    ``default`` threads."""
    try:
        _timed(1, steps)
        times = {1: [_timed(1, steps)], default: [_timed(default, steps)]}
        one, other = times[1][0], times[default][0]
        if max(one, other) < CLEAR * min(one, other):
            times[default] = []  # that first step at the default was its warm-up
            rounds = max(1, min(PROBE_ROUNDS_MAX, int(PROBE_BUDGET_S / max(one + other, 1e-9))))
            for r in range(rounds):
                for n in ((default, 1) if r % 2 == 0 else (1, default)):
                    times[n].append(_timed(n, steps))
    finally:
        torch.set_num_threads(default)
    medians = {n: statistics.median(v) for n, v in times.items()}
    best = 1 if medians[1] < medians[default] else default
    other = default if best == 1 else 1
    return ThreadChoice(best, f"measured faster than {other}", "measured", medians)


def _timed(threads: int, steps: Sequence[Callable[[], None]]) -> float:
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    for step in steps:
        step()
    return time.perf_counter() - t0


def bare_step(build: Callable, target, batch, recipe) -> Callable[[], None]:
    """One plain training step of a throwaway copy of the model on ``target`` (forward, the recipe's loss,
    backward, the optimizer's step), as the target's runner takes it; a closure to run again."""
    runner = target.runner
    model = build(target)
    model.train()
    optimizer = recipe.make_optimizer([p for p in model.parameters() if p.requires_grad])
    scaler = runner.make_grad_scaler()
    inputs, labels = batch

    def step() -> None:
        with runner.applied():
            optimizer.zero_grad(set_to_none=True)
            _, loss = runner.forward_loss(model, inputs, labels, recipe.loss)
            runner.train_backward(loss, optimizer, scaler)
            runner.optimizer_step(optimizer, scaler)

    return step
