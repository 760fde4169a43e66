"""``convcheck.watch(model, optimizer, out=...)``: the user's own loop recorded, its numerics untouched.

Forward hooks on every module (statistics of each leaf's output, the first non-finite producer, the
batch hash at the model's own call), a gradient hook on each leaf's output (the backward producer),
and the optimizer's step pre/post hooks (gradient norms, the step's end). Every hook only reads
detached tensors and draws no random number; all of them are removed on exit, normal or not.
"""

from __future__ import annotations

import json
import hashlib
import math
import os
import random
import sys
from pathlib import Path

import torch

from convcheck.watch import stats as _stats
from convcheck.watch.batches import batch_hash, rounded_hashes
from convcheck.watch.compiled import HIDDEN, fallback_random, outside_graphs, tracing, unwrap
from convcheck.watch.settings import check_optimizer, math_flags, module_of, optimizer_settings, step_loss
from convcheck.watch.layout import DEFAULT_MAX_BYTES, ENV_MAX_BYTES, MANIFEST, SNAPSHOTS, WATCH_SCHEMA, claim, from_env, prepare_out
from convcheck.watch.snapshots import SnapshotTaker
from convcheck.watch.ranks import rank_out


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators (CPU and every accelerator) with ``seed``."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _floats(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() else []
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _floats(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _floats(o)]
    return []


_OVERFLOWING = {"ExpBackward0": "exp", "Exp2Backward0": "exp2", "Expm1Backward0": "expm1",
                "PowBackward0": "pow", "PowBackward1": "pow", "PowBackward2": "pow"}


def loss_op(loss, value: float, model_fns, limit: int = 512) -> dict:
    """``{"op": "exp"}``: the one op of the loss's own code (its autograd graph from the loss back to the
    model's output, ``model_fns``) that overflows to Inf, when the loss is Inf and that graph holds exactly
    one such op (exp, pow); ``{}`` otherwise. Reads the graph's node types only (its saved tensors are
    freed by the backward)."""
    if not isinstance(loss, torch.Tensor) or loss.grad_fn is None or not math.isinf(value):
        return {}
    stop, seen, todo, found = set(model_fns), set(), [loss.grad_fn], set()
    while todo and len(seen) < limit:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ in _OVERFLOWING:
            found.add(_OVERFLOWING[type(node).__name__])
        if node not in stop:
            todo += [n for n, _ in node.next_functions]
    return {"op": found.pop()} if len(found) == 1 and len(seen) < limit else {}


def _closure(args, kwargs) -> bool:
    """``optimizer.step(closure)`` with a closure: the step's forward and backward run inside the call."""
    return (args[0] if args else kwargs.get("closure")) is not None


def _nonfinite(ts) -> bool:
    return any(not _stats.finite(t) for t in ts)


class Watch:
    """The context manager ``convcheck.watch`` returns; ``step(loss)`` ends a step (optional)."""

    def __init__(self, model: torch.nn.Module, optimizer=None, *, out, scaler=None, snapshot_steps=(0,),
                 snapshot_nonfinite: bool = True, max_bytes: int = DEFAULT_MAX_BYTES, force: bool = False):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"convcheck.watch: model is a {type(model).__name__}, not a torch.nn.Module")
        # torch.compile(model): the model inside is watched, the wrapper's own (eager) call carries the root hooks
        model, self.outer, self.compiled = unwrap(model)
        self.hidden = False  # a forward whose leaves ran inside a compiled graph (the watch saw none of them)
        self.from_env = from_env()  # CONVCHECK_SNAPSHOT_STEPS / CONVCHECK_WATCH_MAX_BYTES win over the script's
        snapshot_steps = self.from_env.get("snapshot_steps", snapshot_steps)
        max_bytes = self.from_env.get("max_bytes", max_bytes)
        if not (isinstance(max_bytes, int) and max_bytes > 0):
            raise ValueError(f"convcheck.watch: max_bytes={max_bytes!r} is not a positive integer")
        check_optimizer(model, optimizer)
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.out, self.distributed = rank_out(Path(out))  # under DDP: out/rank<k>
        self.force = force
        self.snapshot_steps = {int(s) for s in snapshot_steps}
        self.snapshot_nonfinite, self.max_bytes = snapshot_nonfinite, max_bytes
        self.names = {m: (n or type(m).__name__) for n, m in model.named_modules()}
        self.leaves = {m for m in self.names if not any(True for _ in m.children())}
        self.params = [(n, p) for n, p in model.named_parameters()]
        self.device = str(self.params[0][1].device) if self.params else "cpu"
        self.handles: list = []
        self.step_index, self.written, self.explicit = 0, 0, False
        self.producer: dict | None = None
        self.notes: list[str] = []
        self.truncated = False
        self.snapshot_index: list[dict] = []
        self.skipped: list[dict] = []
        self.steps_sha = hashlib.sha256()
        self._reset()

    # --- per-step state -------------------------------------------------------
    def _reset(self) -> None:
        self.layers: dict[str, dict] = {}
        self.order: list[str] = []
        self.hashes: list[str] = []
        self.rounded: list[dict | None] = []  # each batch's ``rounded_hashes``
        self.model_fns: list = []  # the autograd nodes of the model's output this step
        self.grad_norms: dict[str, float] | None = None
        self.lr_used: list[float] | None = None
        self.last_leaf: tuple | None = None
        self.eval_forwards = 0  # the model's calls with gradients on but in eval mode (model.train() forgotten?)
        self.leaf_calls = 0  # leaf hooks run this step (none in a forward compiled whole)
        self.stepped = self.pending = False
        self.taker = (SnapshotTaker(self.names, budget=self._budget()) if self._snapshotting(self.step_index)
                      else None)

    def _budget(self) -> int:
        """What a snapshot may take: the rest of max_bytes (a taker past it lets go of its copies)."""
        return max(self.max_bytes - self.written, 0)

    def _snapshotting(self, step: int) -> bool:
        return step in self.snapshot_steps

    # --- entering and leaving ---------------------------------------------------
    def __enter__(self) -> "Watch":
        prepare_out(self.out, self.force)
        from convcheck.env.collector import collect

        self.fingerprint = collect().to_dict()
        self.flags = math_flags()
        self.settings = optimizer_settings(self.optimizer)
        # the folder claimed before anything is written: a second watch started on it at once stops here
        self.steps_file = os.fdopen(claim(self.out), "w", encoding="utf-8")
        self._write_manifest(complete=False)
        self._install()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        if self.pending:
            self._end_step(loss=None)
        if self.layers or self.hashes:
            self.notes.append(f"step {self.step_index} was begun but not ended (no optimizer step); not recorded")
        self.steps_file.close()
        if exc_type is not None:  # an orderly stop: what was recorded is whole, and says where it stopped
            try:
                detail = " ".join(str(exc).split())[:200] if exc is not None else ""
            except Exception:  # noqa: BLE001 - an exception whose str() fails still closes the record
                detail = ""
            self.stopped = {"exception": exc_type.__name__, "message": detail, "step": self.step_index}
            self.notes.append(f"the watched block stopped with {exc_type.__name__} at step {self.step_index}"
                              + (f": {detail}" if detail else ""))
        self._write_manifest(complete=True)  # only a killed process leaves complete: false
        return False

    def _install(self) -> None:
        # the root's hooks never traced (they run at a compiled graph's edges); the others return at once
        # when traced, so a compiled graph holds nothing of the watch (``compiled.py``)
        self.handles.append(self.outer.register_forward_pre_hook(outside_graphs(self._root_pre), with_kwargs=True))
        self.handles.append(self.outer.register_forward_hook(outside_graphs(self._root_forward)))
        for mod in self.names:
            if mod is not self.model:
                self.handles.append(mod.register_forward_hook(self._forward))
        if self.optimizer is not None:
            self.handles.append(self.optimizer.register_step_pre_hook(self._pre_step))
            self.handles.append(self.optimizer.register_step_post_hook(self._post_step))

    # --- hooks ------------------------------------------------------------------
    def _recording(self) -> bool:
        return torch.is_grad_enabled() and self.model.training and not self.truncated

    def hash_batch(self, args, kwargs) -> None:
        """The step's batch: its exact hash and its ``rounded_hashes``."""
        self.hashes.append(batch_hash(args, kwargs))
        self.rounded.append(rounded_hashes(args, kwargs))

    def _root_pre(self, module, args, kwargs):
        if self.pending:
            self._end_step(loss=None)
        if torch.is_grad_enabled() and not self.model.training and not self.truncated:
            self.eval_forwards += 1  # not recorded (a validation pass without no_grad) unless it is all the step had
        if self._recording():
            self.hash_batch(args, kwargs)
            self.leaves_before = self.leaf_calls
            if self.taker is not None and not self.taker.params:
                self.taker.take_params(self.params)
        return None

    def _root_forward(self, module, args, output):
        if not self._recording():
            return None
        leaf = self.model in self.leaves
        if not leaf and self.leaf_calls == getattr(self, "leaves_before", self.leaf_calls) and self.leaves:
            self._hidden_forward(args, output)  # compiled whole: no leaf hook ran inside it
            return None
        return self._forward(self.model, args, output)

    def _hidden_forward(self, args, output) -> None:
        """A forward whose layers ran inside a compiled graph: the model's output recorded as its one layer."""
        if not self.hidden:
            self.hidden = True
            self.compiled = self.compiled or "a compiled call of the model"
            self.notes.append(f"{HIDDEN} (from step {self.step_index}; {self.compiled})")
        name = self.names[self.model]
        outs = _floats(output)
        row = None
        for t in outs[:1]:
            row = _stats.measure(t)
            self.layers[name] = _stats.merge(self.layers.get(name), row)
        if outs and name not in self.order:
            self.order.append(name)
        if self.taker is not None:
            self.taker.take_call(name, _floats(args), outs)
        self.model_fns = [t.grad_fn for t in outs if t.grad_fn is not None]
        self._check_producer(self.model, name, args, outs, row, leaf=True)

    def _forward(self, module, args, output):
        if tracing():  # inside a compiled graph: nothing of the watch is traced into it
            return None
        if not self._recording():
            return None
        name = self.names[module]
        outs = _floats(output)
        row = None
        if module in self.leaves:
            self.leaf_calls += 1
            for t in outs[:1]:
                row = _stats.measure(t)
                self.layers[name] = _stats.merge(self.layers.get(name), row)
            if name not in self.order:
                self.order.append(name)
        if self.taker is not None and module in self.leaves:
            self.taker.take_call(name, _floats(args), outs)
        if module is self.model:  # where the loss's own code begins (``loss_op`` stops there)
            self.model_fns = [t.grad_fn for t in outs if t.grad_fn is not None]
        self._check_producer(module, name, args, outs, row, leaf=module in self.leaves)
        return None

    def _check_producer(self, module, name, args, outs, row, leaf: bool) -> None:
        """The first NaN/Inf made by this call (its inputs finite), or a gradient hook on its output."""
        if self.producer is None:
            if row is not None:
                bad = row["nan"] + row["inf"] > 0 or _nonfinite(outs[1:])
                self.last_leaf = (outs[0], bool(bad))
            elif outs and self.last_leaf is not None and outs[0] is self.last_leaf[0] and len(outs) == 1:
                bad = self.last_leaf[1]  # a container handing on its last leaf's output: already measured
            else:
                bad = _nonfinite(outs)
            if outs and bad and not _nonfinite(_floats(args)):
                self._found(name, "forward", "module" if module in self.leaves else "own code")
                from convcheck.watch.replay import live_op  # once a run, at its first NaN/Inf

                self.producer.update(live_op(module, args))  # the op that made them
            elif outs and outs[0].requires_grad and (leaf or module is self.model):
                outs[0].register_hook(self._grad_hook(name))  # leaves and the model's output only: cheaper

    def _grad_hook(self, name: str):
        def hook(grad):
            if self.producer is None and not _stats.finite(grad):
                after = self.order.index(name) + 1 if name in self.order else len(self.order)
                consumer = self.order[after] if after < len(self.order) else "the loss"
                self._found(consumer, "backward", "module" if consumer != "the loss" else "own code",
                            detail=f"gradient into {name}'s output")
            return None
        return hook

    def _found(self, layer: str, direction: str, kind: str, detail: str | None = None) -> None:
        self.producer = {"layer": layer, "step": self.step_index, "direction": direction, "kind": kind,
                         "detail": detail}
        if self.snapshot_nonfinite and self.taker is None:
            self.taker = SnapshotTaker(self.names, partial=f"started at the first non-finite {direction} value",
                                       budget=self._budget())
            self.snapshot_steps.add(self.step_index)

    def _pre_step(self, optimizer, args, kwargs):
        self.lr_used = self._lrs()  # what this step used: a scheduler may change it before w.step
        if _closure(args, kwargs):  # step(closure): forward and backward run inside it (Lightning, LBFGS)
            return None
        self._read_grads()
        return None

    def _read_grads(self) -> None:
        self.grad_norms = self._norms()
        if self.taker is not None:
            self.taker.take_grads(self.params)

    def _post_step(self, optimizer, args, kwargs):
        if _closure(args, kwargs):  # the gradients the closure made (the update leaves them as they were)
            self._read_grads()
        self.stepped = True
        self.pending = not self.explicit  # ended at the next forward (or w.step, or exit)
        return None

    def _norms(self) -> dict[str, float]:
        """Every parameter's gradient norm: one ``_foreach_norm`` per dtype, one ``tolist`` for all."""
        named = [(n, p.grad.detach()) for n, p in self.params if p.grad is not None]
        if not named:
            return {}
        norms: list = [None] * len(named)
        by_dtype: dict = {}
        for i, (_, g) in enumerate(named):
            by_dtype.setdefault((g.dtype, g.device), []).append(i)
        for (dtype, _), idx in by_dtype.items():
            grads = [named[i][1] for i in idx]
            if _stats.reduce_dtype(grads[0]) is None and all(not g.is_sparse for g in grads):
                got = torch._foreach_norm(grads)
            else:
                got = [torch.linalg.vector_norm(g, dtype=_stats.reduce_dtype(g)) for g in grads]
            for i, v in zip(idx, got):
                norms[i] = v.detach().double()
        if len({v.device for v in norms}) == 1:  # one transfer (one sync on an accelerator) for all
            return dict(zip((n for n, _ in named), torch.stack(norms).tolist()))
        return {n: float(v) for (n, _), v in zip(named, norms)}

    # --- the user's call -----------------------------------------------------------
    def step(self, loss=None) -> None:
        """End the step: record ``loss`` (a tensor or number) with what the hooks saw since the last step."""
        self.explicit = True
        value = step_loss(loss)
        p = self.producer
        if value is not None and not math.isfinite(value) and (p is None or (
                p["step"] == self.step_index and p["direction"] == "backward")):
            # the loss is already non-finite in its forward: a backward NaN/Inf of this step came after it
            self._found("the loss", "forward", "own code", detail=f"the loss is {value}")
            self.producer.update(loss_op(loss, value, self.model_fns))
        if self.grad_norms is None:
            self.grad_norms = self._norms()
            if self.taker is not None and not self.taker.grads:
                self.taker.take_grads(self.params)
        self._end_step(loss=value)

    def _end_step(self, loss) -> None:
        record = {"step": self.step_index, "loss": loss, "lr": self.lr_used if self.lr_used is not None else self._lrs(), "batch_sha256": self.hashes,
                  "batch_rounded": self.rounded,
                  "grad_norms": self.grad_norms or {}, "stepped": self.stepped,
                  "layers": {n: _stats.finish(self.layers[n]) for n in self.order if n in self.layers}}
        if self.scaler is not None:
            record["scale"] = float(self.scaler.get_scale())
            record["skipped"] = not self.stepped
        if not self.hashes and self.eval_forwards and self.stepped:
            # the optimizer stepped on forwards run in eval mode only: training with BatchNorm's running
            # statistics and Dropout off - said once, and marked on every such step
            record["model_eval"] = True
            if not any(n.startswith("trained in eval mode") for n in self.notes):
                self.notes.append(f"trained in eval mode from step {self.step_index}: the model's forwards ran with "
                                  "model.training False (model.train() not called after an evaluation?); those "
                                  "steps' layers and batches are not recorded")
        if self.taker is not None:
            self._write_snapshot()
        line = json.dumps(record) + "\n"
        if not self.truncated:
            if self.written + len(line) > self.max_bytes:
                self._cap(f"the per-step record of step {self.step_index}")
            else:
                self.steps_file.write(line)
                self.steps_file.flush()
                self.steps_sha.update(line.encode("utf-8"))
                self.written += len(line)
                self.recorded = self.step_index + 1
        self.step_index += 1
        self._reset()

    def _lrs(self) -> list[float]:
        if self.optimizer is None:
            return []
        return [float(g["lr"]) if not isinstance(g["lr"], torch.Tensor) else float(g["lr"].detach())
                for g in self.optimizer.param_groups if "lr" in g]

    def _write_snapshot(self) -> None:
        size = self.taker.nbytes()
        if self.taker.over is not None or self.written + size > self.max_bytes:
            reason = (f"snapshot of step {self.step_index} ({size / 1e6:.1f} MB) not written: it would pass "
                      f"max_bytes={self.max_bytes} ({self.max_bytes / 1e6:.1f} MB, {self.written / 1e6:.1f} MB "
                      f"written before it); raise max_bytes or {ENV_MAX_BYTES} to keep it")
            self.skipped.append({"step": self.step_index, "bytes": size, "reason": reason})
            self.notes.append(reason)
            print(f"convcheck.watch: {reason}", file=sys.stderr)
            self.taker.drop()
            return
        entry = self.taker.write(self.out / SNAPSHOTS, self.step_index)
        self.written += entry["bytes"]
        self.snapshot_index.append(entry)

    def _cap(self, what: str) -> None:
        self.truncated = True
        self.notes.append(f"recording stopped at step {self.step_index}: {what} would pass "
                          f"max_bytes={self.max_bytes} ({self.max_bytes / 1e6:.1f} MB); raise max_bytes to keep more")
        print(f"convcheck.watch: {self.notes[-1]}", file=sys.stderr)

    def _write_manifest(self, complete: bool) -> None:
        from convcheck.files import atomic_write_text

        manifest = {
            "schema": WATCH_SCHEMA, "complete": complete, "steps": getattr(self, "recorded", 0),
            # the SHA-256 of steps.jsonl as written (diff checks it, as each snapshot file's in its entry)
            "steps_sha256": self.steps_sha.hexdigest(),
            "model": {"class": type(self.model).__name__, "module": module_of(type(self.model)),
                      "qualname": type(self.model).__qualname__, "device": self.device,
                      "parameters": [{"name": n, "shape": list(p.shape), "dtype": _stats.dtype_name(p)}
                                     for n, p in self.params],
                      "layers": [self.names[m] for m in self.names if m in self.leaves],
                      # each leaf's class: compare's dead-unit detector reads the ReLUs' zeros (older runs: none)
                      "layer_types": {self.names[m]: type(m).__name__ for m in self.names if m in self.leaves}},
            "optimizer": type(self.optimizer).__name__ if self.optimizer is not None else None,
            "optimizer_settings": getattr(self, "settings", None),
            "scaler": self.scaler is not None, "fingerprint": self.fingerprint, "math_flags": self.flags,
            "first_nonfinite": self.producer, "snapshots": self.snapshot_index, "notes": list(self.notes),
            "max_bytes": self.max_bytes, "truncated": self.truncated, "skipped_snapshots": self.skipped,
            "settings_from_env": {k: list(v) if isinstance(v, tuple) else v for k, v in self.from_env.items()},
            "distributed": self.distributed, "stopped": getattr(self, "stopped", None),
            # how the model was compiled (None: not, so far as the watch knew at the start), and whether its
            # layers ran inside a compiled graph (only the model's output was recorded as a layer then)
            "compiled": {"how": self.compiled, "layers_hidden": self.hidden, "fallback_random": fallback_random()},
        }
        atomic_write_text(self.out / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def watch(model, optimizer=None, *, out, scaler=None, snapshot_steps=(0,), snapshot_nonfinite: bool = True,
          max_bytes: int = DEFAULT_MAX_BYTES, force: bool = False) -> Watch:
    """``with convcheck.watch(model, optimizer, out="runs/gpu") as w:`` around the user's loop.

    Records at each ``optimizer.step()`` (or at ``w.step(loss)`` once the loop calls it, which also
    records the loss); ``scaler``: a ``torch.amp.GradScaler`` whose scale and skipped steps to record;
    ``snapshot_steps``: the steps whose every layer input/output, parameter and gradient is saved (and the
    step where anything first turns non-finite, unless ``snapshot_nonfinite=False``); ``max_bytes``: the
    most the run may write (a snapshot that would pass it is skipped with one warning, recorded in the
    manifest's ``skipped_snapshots``); ``force``: replace an earlier watched run in ``out``. The environment
    variables ``CONVCHECK_SNAPSHOT_STEPS=0,10,20`` and ``CONVCHECK_WATCH_MAX_BYTES=500M``, when set, replace
    ``snapshot_steps`` and ``max_bytes`` without touching the script."""
    return Watch(model, optimizer, out=out, scaler=scaler, snapshot_steps=snapshot_steps,
                 snapshot_nonfinite=snapshot_nonfinite, max_bytes=max_bytes, force=force)
