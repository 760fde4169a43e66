"""A data-parallel target on the world torchrun launched: rank 0 compares, the other ranks serve.

Every rank runs ``convcheck compare`` with the same arguments. Rank 0's process
runs the comparison; the first data-parallel step starts its **relay**, a child
process that joins the world as rank 0 (``env://``: torchrun's ``MASTER_ADDR``
and ``MASTER_PORT``) so that the comparison's process never holds a process
group. Every other rank joins the world and **serves** (``serve_rank``, called
by the CLI instead of the comparison). The relay forwards each command it gets
from its parent (open a DDP copy, run a step, close it; ``LaunchedPool`` is
``RankPool``'s stand-in) to the others with ``broadcast_object_list``; each rank
runs it on its own ``RankState`` and the ranks' outcomes are gathered, so the
answer is rank 0's result or one line naming the rank that failed. At the end
of the comparison (``release_world``, however it ends) the relay tells the
ranks to exit and they exit 0. The job crosses to the other ranks pickled, so
the model and recipe must pickle, as for spawn.
"""

from __future__ import annotations

import itertools
import os
import pickle
import signal
import time
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from convcheck.ddp.launch import check_launch
from convcheck.ddp.rank_pool import collective_timeout, raise_rank_failure
from convcheck.errors import RunFailed, UsageError

_relay: "_Relay | None" = None
_ids = itertools.count(1)


def _join(backend: str, timeout_s: float) -> tuple[int, int]:
    """Join the launcher's world (one GPU per local rank with NCCL); ``(rank, world size)``."""
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0") or 0))
    dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


ERROR_KEY = "convcheck/ddp-error"  # in the launcher's store: the first failing rank's description


def _everywhere(states: dict, msg: tuple, rank: int, world: int, target=None):
    """Run ``msg`` on this rank. Rank 0 (the relay) gets ``("ok", 0, its result)`` or ``("error", rank,
    description)`` naming the root cause: a rank that fails posts its description to the launcher's
    store and leaves (its peers' collectives then fail), so rank 0 names it rather than its own
    connection error. A failing rank other than 0 raises the one line the CLI prints."""
    from convcheck.ddp.worker import RankState, describe_rank_failure

    try:
        if msg[0] == "open":
            states[msg[1]] = RankState(rank, world, msg[2])
        elif msg[0] == "call":
            return ("ok", 0, getattr(states[msg[1]], msg[2])(*msg[3]))
        elif msg[0] == "close":
            states.pop(msg[1], None)
        return ("ok", 0, None)
    except Exception as exc:  # noqa: BLE001 - one line naming the rank
        info = describe_rank_failure(exc)
        if rank != 0:
            _post(rank, info)
            raise_rank_failure(target, world, rank, info, _what(msg))
        peer = _posted()
        return ("error", peer[0], peer[1]) if peer and not info.get("convcheck") else ("error", 0, info)


def _what(msg: tuple) -> str:
    return {"open": "start-up", "close": "closing"}.get(msg[0]) or {"step": "a training step",
                                                                      "grads": "the parity step"}.get(msg[2], msg[2])


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: errors are named by the rank that sees them
        return None


def _post(rank: int, info: dict) -> None:
    store = _store()
    if store is not None:
        try:
            store.set(ERROR_KEY, pickle.dumps((rank, info)))
        except Exception:  # noqa: BLE001 - best effort: rank 0 then reports what it saw
            pass


def _posted(grace_s: float = 2.0):
    """``(rank, description)`` a peer posted, waiting up to ``grace_s`` for it; None if none did."""
    store = _store()
    deadline = time.monotonic() + grace_s
    while store is not None:
        try:
            if store.check([ERROR_KEY]):
                return pickle.loads(store.get(ERROR_KEY))
        except Exception:  # noqa: BLE001 - the store went with the world
            return None
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)
    return None


def _leave() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - leaving anyway
            pass


def relay_main(conn, backend: str, timeout_s: float) -> None:
    """Rank 0 of the world, in a child of the comparison: forward the parent's commands, answer them."""
    from convcheck.ddp.worker import describe_rank_failure, die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    try:
        rank, world = _join(backend, timeout_s)
        conn.send(("ok", rank, world))
        states: dict = {}
        while True:
            msg = conn.recv()
            dist.broadcast_object_list([msg], src=0)
            if msg[0] == "exit":
                break
            conn.send(_everywhere(states, msg, rank, world))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    except BaseException as exc:  # noqa: BLE001 - one line to the parent
        try:
            conn.send(("error", 0, describe_rank_failure(exc)))
        except (OSError, ValueError):
            pass
    finally:
        _leave()
        conn.close()
        os._exit(0)


def serve_rank(config) -> int:
    """Ranks 1..N-1 under torchrun (the CLI calls this instead of the comparison): serve until rank 0's
    relay says exit; 0 then. A lost rank 0 (its collectives time out) is one line, exit 3."""
    from convcheck.targets.spec import Target, parse_targets
    from convcheck.plan.user_code import one_line

    raw = config.targets
    targets = parse_targets(raw) if isinstance(raw, str) else [Target.parse(str(t)) for t in (raw or ())]
    world = check_launch(targets)
    ddp = next(t for t in targets if t.world)
    ddp.check_available()
    try:
        rank, size = _join(ddp.runner.backend, collective_timeout())
        states: dict = {}
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0][0] == "exit":
                return 0
            _everywhere(states, box[0], rank, size, ddp)
    except (RuntimeError, ValueError, OSError) as exc:  # not a ConvcheckError: those are this rank's own line
        raise RunFailed(f"{ddp}: rank {world.rank} of {world.world} lost rank 0 (it stopped or timed out): "
                        f"{one_line(exc)}") from None
    finally:
        _leave()


class _Relay:
    """The comparison's handle on its relay process (rank 0 of the launcher's world)."""

    def __init__(self, target, timeout_s: float):
        self.target, self.timeout_s, self.failed = target, timeout_s, False
        backend = target.runner.backend
        ctx = tmp.get_context("spawn" if backend == "nccl" else "fork")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=relay_main, args=(theirs, backend, timeout_s), daemon=True,
                                name="convcheck-relay-rank0")
        self.proc.start()
        theirs.close()
        self.world = self._answer("joining the world")[2]

    def ask(self, msg: tuple, what: str, target):
        try:
            self.conn.send(msg)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:  # pickling the job
            from convcheck.plan.user_code import one_line

            raise UsageError(f"target {target}: under torchrun the job goes to every rank pickled, and the model "
                             f"factory, loss, optimizer or schedule cannot be ({one_line(exc)}); give them as a "
                             "zoo name or FILE.py:fn / package.module:fn") from None
        except (BrokenPipeError, OSError):
            self._died(what)
        status, rank, payload = self._answer(what)
        if status == "error":  # the world is broken: close() stops the relay without asking
            self.failed = True
            raise_rank_failure(target, self.world, rank, payload, what)
        return payload

    def _answer(self, what: str):
        deadline = self.timeout_s * 2 + 30
        if not wait([self.conn, self.proc.sentinel], timeout=deadline):
            raise RunFailed(f"{self.target}: rank 0 of the torchrun world did not answer within {deadline:.0f} s "
                            f"during {what}")
        try:
            answer = self.conn.recv()
        except (EOFError, OSError):
            self._died(what)
        if answer[0] == "error" and what == "joining the world":
            raise_rank_failure(self.target, "the torchrun world", 0, answer[2], what)
        return answer

    def _died(self, what: str):
        self.failed = True
        self.proc.join(1.0)
        raise RunFailed(f"{self.target}: rank 0 of the torchrun world exited (code {self.proc.exitcode}) "
                        f"during {what}")

    def close(self) -> None:
        """Tell the ranks to exit (after a failure the world is broken: stop the relay, whose closed
        connections end the other ranks' waits)."""
        if not self.failed:
            try:
                self.conn.send(("exit",))
            except (BrokenPipeError, OSError, ValueError):
                pass
            self.proc.join(self.timeout_s + 5)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(2.0)
        self.conn.close()


class LaunchedPool:
    """``RankPool``'s stand-in under torchrun: one DDP copy on every rank of the launcher's world."""

    def __init__(self, target, job):
        global _relay
        if _relay is None:
            _relay = _Relay(target, job.timeout_s)
        self.target, self.world, self.relay = target, int(target.world), _relay
        self.procs: list = []  # the ranks are torchrun's, not this process's
        self.id = next(_ids)
        self.relay.ask(("open", self.id, job), "start-up", target)
        self.open = True

    def call(self, cmd: str, *args, what: str = ""):
        return self.relay.ask(("call", self.id, cmd, args), what or cmd, self.target)

    def close(self) -> None:
        if self.open and self.relay is _relay and self.relay.proc.is_alive() and not self.relay.failed:
            self.open = False
            try:
                self.relay.ask(("close", self.id), "closing", self.target)
            except (RunFailed, UsageError):
                pass


def release_world() -> None:
    """Tell the other ranks to exit and stop the relay (the end of a comparison under torchrun)."""
    global _relay
    relay, _relay = _relay, None
    if relay is not None:  # none started (rank 0 failed before its first DDP step): torchrun stops the ranks
        relay.close()
