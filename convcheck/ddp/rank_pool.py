"""The parent's side of a data-parallel target: N rank processes, driven one command at a time.

``RankPool`` starts the ranks with ``torch.multiprocessing`` (fork on the CPU:
the model factory, loss and recipe need not be picklable; spawn for CUDA,
which cannot fork, and on the CPU when ``CONVCHECK_DDP_START=spawn``: the job
is pickled, the model by its spec, the recipe by its config fields),
rendezvous on 127.0.0.1 at a free port, sends every rank the same command
(the same global batch: each rank cuts its slice) and waits for all answers,
watching the processes: a rank that raises or dies ends the run with one line
naming it (``RunFailed``), and ``close`` (also on error and Ctrl-C) stops and
reaps every rank, so none is left behind.
"""

from __future__ import annotations

import os
import pickle
import re
import socket
import time
from multiprocessing.connection import wait

import torch
import torch.multiprocessing as tmp

from convcheck.ddp.worker import RankJob, rank_main
from convcheck.errors import RunFailed, UsageError

DEFAULT_TIMEOUT_S = 300.0  # every collective; CONVCHECK_DDP_TIMEOUT overrides it (seconds)


MAX_TIMEOUT_S = 7 * 24 * 3600.0  # what a collective may wait at most (a week); past it torch's timedelta overflows


def collective_timeout() -> float:
    """``CONVCHECK_DDP_TIMEOUT`` (seconds, > 0, at most a week) or the default; anything else one ``UsageError``
    naming the variable (issue 47: ``'inf'`` overflowed, ``'²'`` or ``'-5'`` fell back to the default silently)."""
    raw = os.environ.get("CONVCHECK_DDP_TIMEOUT")
    if raw is None:
        return DEFAULT_TIMEOUT_S
    text = raw.strip()
    try:
        value = float(text) if text.isascii() and text else float("nan")
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_TIMEOUT_S:  # NaN too
        raise UsageError(f"CONVCHECK_DDP_TIMEOUT={raw!r:.40} is not a number of seconds in "
                                f"(0, {MAX_TIMEOUT_S:.0f}]")
    return value


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankPool:
    """``world`` rank processes of ``target``; ``call(cmd, *args)`` -> rank 0's answer."""

    def __init__(self, target, job: RankJob):
        self.target, self.world = target, int(target.world)
        self.timeout_s = job.timeout_s
        method = start_method(target)
        ctx = tmp.get_context(method)
        port = free_port()
        backend = target.runner.backend
        self.procs, self.conns = [], []
        try:
            for rank in range(self.world):
                mine, theirs = ctx.Pipe()
                p = ctx.Process(target=rank_main, args=(rank, self.world, port, theirs, job, backend),
                                name=f"convcheck-{target}-rank{rank}", daemon=True)
                _start(p, method, target)
                theirs.close()
                self.procs.append(p)
                self.conns.append(mine)
            self._gather("start-up")
        except BaseException:
            self.close()
            raise

    def call(self, cmd: str, *args, what: str = ""):
        for rank, conn in enumerate(self.conns):
            try:
                conn.send((cmd, args))
            except (BrokenPipeError, OSError):
                self._died(rank, what or cmd)
        return self._gather(what or cmd)[0]

    def _gather(self, what: str) -> list:
        answers: dict[int, object] = {}
        deadline = time.monotonic() + 2 * self.timeout_s + 30
        while len(answers) < self.world:
            pending = [r for r in range(self.world) if r not in answers]
            ready = wait([self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending],
                         timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RunFailed(f"{self.target}: rank {pending[0]} did not answer within "
                                f"{2 * self.timeout_s + 30:.0f} s during {what}")
            for r in pending:
                conn = self.conns[r]
                if conn in ready or conn.poll():
                    try:
                        status, rank, payload = conn.recv()
                    except (EOFError, OSError):
                        self._died(r, what)
                    if status == "error":
                        self._root_cause(what)  # a peer's death shows up as a connection error here
                        self._failed(rank, payload, what, [q for q in pending if q != rank and q not in answers])
                    answers[r] = payload
                elif self.procs[r].sentinel in ready:
                    self._died(r, what)
        return [answers[r] for r in range(self.world)]

    def _root_cause(self, what: str, grace_s: float = 1.0) -> None:
        """When a rank reports an error, a rank that died (killed, crashed) is the cause: name it."""
        deadline = time.monotonic() + grace_s  # a killed peer may still be tearing down
        while True:
            for rank, p in enumerate(self.procs):
                if p.exitcode is not None and p.exitcode != 0:
                    self._died(rank, what)
            if time.monotonic() >= deadline or all(p.exitcode is not None for p in self.procs):
                return
            time.sleep(0.02)

    def _died(self, rank: int, what: str):
        p = self.procs[rank]
        p.join(1.0)
        code = p.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited (code {code})"
        raise RunFailed(f"{self.target}: rank {rank} of {self.world} {how} during {what}")

    def _failed(self, rank: int, info: dict, what: str, silent: list[int] | None = None):
        raise_rank_failure(self.target, self.world, rank, info, what, silent)

    def close(self) -> None:
        """Stop every rank (politely, then SIGTERM, then SIGKILL) and reap it; safe to call twice."""
        for conn in self.conns:
            try:
                conn.send(("close", ()))
            except (BrokenPipeError, OSError, ValueError):
                pass
        deadline = time.monotonic() + 2.0  # a rank busy in a command gets SIGTERM after this
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []


def raise_rank_failure(target, world: int, rank: int, info: dict, what: str, silent: list[int] | None = None):
    """A rank's error as one line naming it: the same ConvcheckError class (the user's code, a usage error),
    else ``RunFailed``; a timeout names the ranks that had not answered (``silent``)."""
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", info["message"])  # gloo's source location
    message = f"{info['kind']}: {text}" if text else info["kind"]
    if silent and ("timed out" in message.lower() or "timeout" in message.lower()):
        names = ", ".join(str(q) for q in silent)
        message = f"{message} (rank {names} had not finished the step: the one that is stuck or slow)"
    if info.get("convcheck"):
        from convcheck import errors

        cls = getattr(errors, info["kind"], None)
        if isinstance(cls, type) and issubclass(cls, errors.ConvcheckError):
            raise cls(f"{target}: rank {rank} of {world} during {what}: {info['message']}")
    raise RunFailed(f"{target}: rank {rank} of {world} failed during {what}: {message}")


def start_method(target) -> str:
    """``spawn`` for CUDA (a forked child cannot use CUDA); on the CPU ``fork`` unless
    ``CONVCHECK_DDP_START=spawn`` (the spawn path, exercised on a CPU-only machine)."""
    if target.device != "cpu":
        return "spawn"
    raw = os.environ.get("CONVCHECK_DDP_START", "")
    how = raw.strip().lower() or "fork"
    if how not in ("fork", "spawn"):  # a misspelt 'spwan' ran fork silently
        raise UsageError(f"CONVCHECK_DDP_START={raw!r:.40} is not fork or spawn")
    return how


def _start(process, method: str, target) -> None:
    """Start one rank; with spawn its job is pickled: what cannot be is the user's to change (exit 2)."""
    try:
        process.start()
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        if method != "spawn" or process.pid is not None:
            raise
        from convcheck.plan.user_code import one_line

        raise UsageError(f"target {target}: its ranks are started with spawn, which pickles the model factory, "
                         f"loss, optimizer and schedule, and one of them cannot be ({one_line(exc)}); give them "
                         "as a zoo name or FILE.py:fn / package.module:fn, or as module-level functions, "
                         "not lambdas or local functions") from None


def threads_per_rank(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, world), torch.get_num_threads() // max(1, world))
