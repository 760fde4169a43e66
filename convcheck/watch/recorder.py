"""``convcheck.watch(model, optimizer, out=...)``: the user's own loop recorded, its numerics untouched.

Forward hooks on every module (statistics of each leaf's output, the first non-finite producer, the
batch hash at the model's own call), a gradient hook on each leaf's output (the backward producer),
and the optimizer's step pre/post hooks (gradient norms, the step's end). Every hook only reads
detached tensors and draws no random number; all of them are removed on exit, normal or not.
The producer hooks are ``producers.py``'s, the once-a-step statistics ``deferred.py``'s, what is recorded
``selection.py``'s, a compiled model's hooks ``compiled.py``'s.
"""

from __future__ import annotations

import json
import hashlib
import math
import os
import sys
import weakref
import errno as _errno
from pathlib import Path

import torch

from convcheck.watch import stacked as _stacked
from convcheck.watch import fused as _fused
from convcheck.watch import stats as _stats
from convcheck.watch.batches import batch_hash, data_tensors, rounded_hashes
from convcheck.watch.functional_losses import MAX_TARGETS_PER_STEP, criterion as functional_criterion
from convcheck.watch.recipe import criterion_of, forward_state, grad_sample, loss_dtype, recipe_of, sample_parts
from convcheck.errors import UsageError
from convcheck.watch import arguments as _args
from convcheck.watch import deferred as _deferred
from convcheck.watch import attach as _attach
from convcheck.watch import several as _several
from convcheck.watch.compiled import HIDDEN, parallel, tracing, unwrap
from convcheck.watch.settings import check_optimizer, learning_rates, math_flags, optimizer_settings, step_loss
from convcheck.watch.settings import seed_everything  # noqa: F401 - convcheck.watch.seed_everything
from convcheck.runformat.layout import DEFAULT_MAX_BYTES, ENV_MAX_BYTES, MANIFEST, SNAPSHOTS, claim, from_env, prepare_out
from convcheck.runformat.layout import DEFAULT_SNAPSHOT_BYTES, ENV_SNAPSHOT_BYTES
from convcheck.runformat.layout import release, take
from convcheck.watch.snapshots import SnapshotTaker
from convcheck.watch.snapshot_file import BACKGROUND_FROM, Background, SnapshotWriteFailed
from convcheck.watch.manifest import manifest_of, manifest_text
from convcheck.watch.norms import grad_norms
from convcheck.watch.producers import STACKED, ProducerHooks, closure, floats, loss_op
from convcheck.runformat.ranks import rank_out
from convcheck.watch.sampler_use import SamplerSpy
from convcheck.watch.scaler_use import ScalerSpy
from convcheck.watch.selection import selection, unmatched


_NO_ROOM = (_errno.ENOSPC, _errno.EDQUOT, _errno.EFBIG)  # a write refused for room: the user's disk, not a bug


class Watch(ProducerHooks):
    """The context manager ``convcheck.watch`` returns; ``step(loss)`` ends a step (optional)."""

    def __init__(self, model: torch.nn.Module | None = None, optimizer=None, *, out, scaler=None, snapshot_steps=(0,),
                 snapshot_nonfinite: bool = True, max_bytes: int = DEFAULT_MAX_BYTES, force: bool = False,
                 layers=None, steps=None, every: int = 1, sync: str = "auto", models=None, optimizers=None,
                 snapshot_bytes: int = DEFAULT_SNAPSHOT_BYTES, repeated_grads: str = "together"):
        # several models / optimizers: one ``Models`` container, one ``Optimizers`` view (``several.py``)
        model, optimizer, self.optimizers = _several.gather(model, optimizer, models, optimizers)
        _args.check_model(model)  # each argument of the wrong kind one UsageError naming it (``arguments.py``)
        _args.check_out(out), _args.check_scaler(scaler), _args.check_flag(force, "force")
        _args.check_flag(snapshot_nonfinite, "snapshot_nonfinite")
        # torch.compile(model): the model inside is watched, the wrapper's own (eager) call carries the root hooks
        model, self.outer, self.compiled = unwrap(model)
        # DataParallel / DDP: the model inside is watched under its own layer names, the wrapper's call is the root
        model, self.wrapper = parallel(model)
        if self.wrapper is not None and self.compiled is None:
            model, _, self.compiled = unwrap(model)
        self.hidden = False  # a forward whose leaves ran inside a compiled graph (the watch saw none of them)
        self.spy = self.sampler = None  # how the loop uses its GradScaler and DistributedSampler (from __enter__)
        self.scaled_infs = 0  # steps a GradScaler skipped whose scaled backward held Inf/NaN (``producers``)
        self.from_env = from_env()  # CONVCHECK_SNAPSHOT_STEPS / CONVCHECK_WATCH_MAX_BYTES win over the script's
        # CONVCHECK_WATCH_LAYERS, ... too
        self.selection, chosen_by_env = selection(layers, steps, every, sync, repeated_grads=repeated_grads)
        self.each_grad = self.selection.repeated_grads == "each"  # a gradient hook on every repeated call
        self.from_env.update(chosen_by_env)
        snapshot_steps = self.from_env.get("snapshot_steps", snapshot_steps)
        max_bytes = self.from_env.get("max_bytes", max_bytes)
        _args.check_max_bytes(max_bytes)
        self.snapshot_bytes = _args.check_max_bytes(self.from_env.get("snapshot_bytes", snapshot_bytes),
                                                    "snapshot_bytes")
        check_optimizer(model, optimizer)
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.out, self.distributed = rank_out(Path(out))  # under DDP: out/rank<k>
        self.force = force
        self.snapshot_steps = set(_args.snapshot_steps(snapshot_steps))
        self.snapshot_nonfinite, self.max_bytes = snapshot_nonfinite, max_bytes
        # the user's layer names: a compiled or FSDP-wrapped child's wrapper parts taken out (``attach.user_name``)
        wrapped = _attach.parallel_prefixes(model)  # a DataParallel child: its ``module.`` is not the user's
        self.names = {m: (_attach.user_name(n, wrappers=wrapped) or type(m).__name__) for n, m in model.named_modules()}
        self.leaves = {m for m in self.names if not any(True for _ in m.children())}
        wrong = unmatched(self.selection, [n for m, n in self.names.items() if m is not model])
        if wrong:
            some = ", ".join(n for n, _ in list(model.named_modules())[1:6])
            raise UsageError(f"convcheck.watch: layers pattern {wrong[0]!r} matches no module of the model "
                             f"(its modules: {some}, ...)")
        self.paused = False
        self.by_name = {n: m for m, n in self.names.items()}
        self.call_lines: dict = {}  # each leaf's calling line in its parent's forward, from its first call
        self.params = [(_attach.user_name(n, wrappers=wrapped), p) for n, p in model.named_parameters()]
        self.param_ids = {id(p) for _, p in self.params}  # an optimizer made inside the block is found by them
        self.roots = _several.roots(model)  # the modules whose own call is the model's (each model of several)
        self.device = str(self.params[0][1].device) if self.params else "cpu"
        # on an accelerator the step's statistics stay there until it ends, read once (``deferred.py``)
        self.defer = {"step": True, "layer": False}.get(self.selection.sync, self.device.split(":")[0] != "cpu")
        self.handles: list = []
        self.step_index, self.written, self.explicit = 0, 0, False
        self.producer: dict | None = None
        self.notes: list[str] = []
        self.truncated = False
        self.failed: dict | None = None  # an error in the watch's own code stopped the recording (``fail``)
        self.snapshot_index: list[dict] = []
        self.skipped: list[dict] = []
        self.steps_sha = hashlib.sha256()
        # the snapshot being written in the background (``snapshot_file.py``; at most one) and the step records held
        # behind it until it is whole: (line, steps recorded with it)
        self.writing: Background | None = None
        self.held: list[tuple[str, int]] = []
        self._reset()

    # --- per-step state -------------------------------------------------------
    def _reset(self) -> None:
        # the models' outputs of this step and the last one, held until then: a recurrent state carried over
        # detached, a generator's fakes handed to a discriminator are the process's, not data
        self.made_before, self.made = getattr(self, "made", []), []
        self.loss_dtype: str | None = None  # the dtype of the loss handed to ``w.step`` (``recipe.loss_dtype``)
        self.closure_step = False  # the optimizer stepped with a closure (``_pre_step``)
        self.layers: dict[str, dict] = {}
        self.order: dict[str, None] = {}  # the leaves in the order they first ran (a dict: looked up every call)
        self.hashes: list[str] = []
        self.rounded: list[dict | None] = []  # each batch's ``rounded_hashes``
        self.targets: list[str] = []  # the hashes of what the loss modules were given besides the model's output
        self.targets_rounded: list[dict | None] = []
        self.model_fns: list = []  # the autograd nodes of the model's output this step
        self.grad_norms: dict[str, float] | None = None
        self.grad_sample: dict | None = None  # a few entries of each gradient (``recipe.grad_sample``)
        self.forward_state: dict | None = None  # autocast and odd module modes at the step's first forward
        self.lr_used: list[float] | None = None
        self.last_leaf: tuple | None = None
        self.eval_forwards = 0  # the model's calls with gradients on but in eval mode (model.train() forgotten?)
        self.leaf_calls = 0  # leaf hooks run this step (none in a forward compiled whole)
        self.buffer = _deferred.StepBuffer() if self.defer else None  # this step's device-side statistics
        # who consumed what this step (``producers._note_call``): inputs by identity, output nodes
        self.consumed: dict = {}
        self.out_nodes: dict = {}
        self.leaf_nodes: set = set()
        self.model_out = None  # a weak reference to the model's output
        self.chosen = self.selection.step_chosen(self.step_index) and not self.paused  # its layers recorded
        self.stepped = self.pending = False
        self.stepped_by: set = set()  # the optimizers that stepped this step (it ends once all have)
        self.backward_end = False  # without an optimizer: the end of the backward queued (``_backward_end``)
        # repeated small calls waiting to be measured together (``stacked.py``); the layers copied at the call kept
        before = getattr(self, "stacked", None)
        self.stacked = _stacked.Stacked() if before is None else \
            _stacked.Stacked(trusted=before.trusted, copied=before.copied)
        self.grads_together: dict[str, int] = {}  # the stacked calls this step whose gradient got no hook of its own
        self.stacked_names: set = set()  # the layers with a call stacked this step
        self.taker = (SnapshotTaker(self.names, budget=self._budget()) if self._snapshotting(self.step_index)
                      else None)

    def _budget(self) -> int:
        """What a snapshot may take: snapshot_bytes, or the rest of max_bytes when less (``keep.py`` chooses the
        calls kept within it); a snapshot still being written is waited for first (its exact size counts)."""
        self._settle()
        return min(self.snapshot_bytes, max(self.max_bytes - self.written, 0))

    def _snapshotting(self, step: int) -> bool:
        return step in self.snapshot_steps

    # --- entering and leaving ---------------------------------------------------
    def __enter__(self) -> "Watch":
        # the folder locked first (``layout.take``): of watches started at once on it, one goes on, the others stop here
        self.lock = take(self.out)
        try:
            return self._enter()
        except BaseException:
            self.lock = release(self.lock)
            raise

    def _enter(self) -> "Watch":
        prepare_out(self.out, self.force)
        from convcheck.env.collector import collect

        self.fingerprint = collect(device=self.device).to_dict()  # its SDPA probe on the model's own device
        self.flags = math_flags()
        self.settings = optimizer_settings(self.optimizer)
        self.recipe = recipe_of(self)  # diffed first (``recipe.py``)
        _fused.ready()  # the statistics' one pass compiled or loaded now, not inside the first step
        # the folder claimed before anything is written: a second watch started on it at once stops here
        self.steps_file = os.fdopen(claim(self.out), "w", encoding="utf-8")
        self._record_model()  # what the judge rebuilds the layers from (``by_value.py``, issue 43)
        self._write_manifest(complete=False)
        self._install()
        # clip before unscale_? a DistributedSampler told no epoch? (an error of theirs stops the recording: ``fail``)
        self.spy = ScalerSpy(self.scaler, self.fail).install() if self.scaler is not None else None
        self.sampler = SamplerSpy(self.fail).install()
        return self

    def _record_model(self) -> None:
        from convcheck.runformat.by_value import leaf_specs, record_model

        try:
            self.leaf_specs = leaf_specs({self.names[m]: m for m in self.names if m in self.leaves})
            self.code, why = record_model(self.model, self.out, self.max_bytes // 4)  # a share of the cap
            self.written += (self.code or {}).get("bytes", 0)
        except Exception as exc:  # noqa: BLE001 - never the user's loop's failure: said in the notes
            self.code, why = None, f"the model was not recorded by value ({type(exc).__name__})"
        if why:
            self.notes.append(why)

    def __exit__(self, exc_type, exc, tb) -> bool:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        if self.spy is not None:
            self.spy.remove()
        if self.sampler is not None:
            self.sampler.remove()
        try:  # the block's end is the user's code too: an error of the watch's here stops nothing of theirs
            self._close_steps()
            self._settle()  # a snapshot still being written: whole, and indexed, before the manifest names it
        except Exception as error:  # noqa: BLE001 - said in the manifest (``fail``)
            self.fail(error, "the block's end")
        self.steps_file.close()
        if exc_type is not None:  # an orderly stop: what was recorded is whole, and says where it stopped
            try:
                detail = " ".join(str(exc).split())[:200] if exc is not None else ""
            except Exception:  # noqa: BLE001 - an exception whose str() fails still closes the record
                detail = ""
            self.stopped = {"exception": exc_type.__name__, "message": detail, "step": self.step_index}
            self.notes.append(f"the watched block stopped with {exc_type.__name__} at step {self.step_index}"
                              + (f": {detail}" if detail else ""))
        try:
            self._write_manifest(complete=True)  # only a killed process leaves complete: false
        except Exception as error:  # noqa: BLE001 - the run is left complete: false, said on stderr
            print(f"convcheck.watch: the manifest of {self.out} was not written ({type(error).__name__}: "
                  f"{error}); the run is unreadable (convcheck's fault, please report it)", file=sys.stderr)
        self.lock = release(getattr(self, "lock", None))
        return False

    def _close_steps(self) -> None:
        """What the block's end records: the scaler's and the producer's notes, a step left pending."""
        if self.failed is not None:
            return
        if self.spy is not None:
            self.notes += self.spy.notes()
        self.notes += self.producer_notes()
        if self.pending:
            self._end_step(loss=None, where="the block's end")
        if self.layers or self.hashes:
            self.notes.append(f"step {self.step_index} was begun but not ended (no optimizer step); not recorded")

    def fail(self, error: Exception, where: str) -> None:
        """An error in convcheck's own code, met inside the user's loop (a hook, ``w.step``, a wrapper): the watch
        records nothing more for the rest of the block - what it wrote stays, the manifest's ``watch_error`` and
        ``truncated`` and a note say where it stopped (``diff`` reads it as a record cut there) - and the loop runs
        on exactly as without the watch. Once; one line on stderr. A snapshot written in the background is waited
        for first (what was recorded before stays whole); its own failure (``SnapshotWriteFailed``) is said as
        the end of its step would have said it, that step's record and those after it not kept."""
        if self.failed is not None:
            return
        if not isinstance(error, SnapshotWriteFailed):
            try:
                self._settle()
            except SnapshotWriteFailed as first:  # it failed before this error: the recording stopped there
                error = first
            except Exception:  # noqa: BLE001 - the error at hand is said
                pass
        if isinstance(error, SnapshotWriteFailed):
            self.step_index, where, error = error.step, error.where, error.error
        try:
            message = " ".join(str(error).split())[:200]
        except Exception:  # noqa: BLE001 - an exception whose str() fails is still named
            message = ""
        self.failed = {"step": self.step_index, "where": where, "exception": type(error).__name__, "message": message}
        self.truncated = True  # nothing more is recorded (``_recording``)
        self.taker, self.pending = None, False
        for h in self.handles:  # routes nothing more here (torch's hooks stay until the block ends: ``attach``)
            h.detach()
        whose = "the disk is full or over its quota where the run is written: free some space or give another " \
            "out=" if isinstance(error, OSError) and error.errno in _NO_ROOM else "convcheck's fault, please report it"
        self.notes.append(f"recording stopped at step {self.step_index}: convcheck.watch failed in {where} "
                          f"({type(error).__name__}" + (f": {message}" if message else "") + f") - {whose}; "
                          "the training loop ran on, unrecorded")
        print(f"convcheck.watch: {self.notes[-1]}", file=sys.stderr)
        try:
            self._write_manifest(complete=False)
        except Exception:  # noqa: BLE001 - written again as the block ends
            pass

    def _install(self) -> None:
        # the root's hooks never traced (they run at a compiled graph's edges); the others return at once
        # when traced, so a compiled graph holds nothing of the watch (``compiled.py``)
        # process-wide hooks routed by identity (``attach.py``): nothing is added to the model or the optimizer, so
        # a pickle, a deep copy or an AveragedModel of either is what it is without the watch
        every_layer = self.selection.layers is None
        layers = [mod for mod, name in self.names.items()
                  if mod is not self.model and mod not in self.roots
                  and (every_layer or mod in self.leaves and self.selection.layer_chosen(name))]
        roots = [self.outer] if self.roots == [self.model] else self.roots
        self.handles.append(_attach.attach(self, roots, layers, self.optimizers))

    # --- hooks ------------------------------------------------------------------
    def _recording(self) -> bool:
        return torch.is_grad_enabled() and self.model.training and not self.truncated

    def _layers_now(self) -> bool:
        """Whether the layer hooks record now: a chosen step, not paused (``selection.py``)."""
        return self.chosen and not self.paused and self._recording()

    def pause(self) -> None:
        """Stop recording layers (each step still records its loss, gradient norms and batch) until ``resume``."""
        self.paused = True
        self.chosen = False

    def resume(self) -> None:
        """Record layers again: from now on, on the steps the selection chooses."""
        self.paused = False
        self.chosen = self.selection.step_chosen(self.step_index)

    def hash_batch(self, args, kwargs) -> None:
        """The step's batch: its exact hash and its ``rounded_hashes``."""
        data = data_tensors(args, kwargs, self.made_before + self.made)  # model-made inputs are not data
        self.hashes.append(batch_hash(data, {}))
        self.rounded.append(rounded_hashes(data, {}))

    def _root_pre(self, module, args):
        if self.pending:
            self._end_step(loss=None, where=f"the forward pre-hook of {type(module).__name__}")
        if torch.is_grad_enabled() and not self.model.training and not self.truncated:
            self.eval_forwards += 1  # not recorded (a validation pass without no_grad) unless it is all the step had
        if self._recording():
            if self.spy is not None:
                self.spy.start(learning_rates(self.optimizer))
            if self.forward_state is None:
                self.forward_state = forward_state(self.model, self.names, self.device, self.params)
            self.leaves_before = self.leaf_calls
            if self.taker is not None:  # the first forward's parameters, or a closure evaluation's (``snapshots``)
                self.taker.take_params(self.params)
        return None

    def made_elsewhere(self, module, args, kwargs, output) -> None:
        """The output of an outermost call of a module no watch holds (``attach._post``): made by the process; a
        loss module's class and settings go into the recipe (``recipe.criterion_of``), the data it was given
        besides the model's output - the targets, the labels - is hashed as a batch is."""
        if self._recording():
            found = criterion_of(module)
            if found is not None:
                if found not in self.recipe.setdefault("criteria", []):
                    self.recipe["criteria"].append(found)
                self._hash_targets(data_tensors(args, kwargs, self.made_before + self.made))
            self.made.extend(t.detach() for t in floats(output))  # its memory held, not its graph

    def functional_loss(self, name: str, bound) -> None:
        """A loss of ``torch.nn.functional`` called outside any loss module (``functional_losses``): recorded as the
        module of that loss would be - its class and settings in the recipe, its target hashed."""
        if self._recording():
            found, given = functional_criterion(name, bound)
            if found not in self.recipe.setdefault("criteria", []):
                self.recipe["criteria"].append(found)
            self._hash_targets(data_tensors(tuple(given), {}, self.made_before + self.made))

    def _hash_targets(self, data: list) -> None:
        """A loss's targets hashed as a batch is, the first ``MAX_TARGETS_PER_STEP`` calls of a step (a loss called
        once per time step of a sequence is called thousands of times)."""
        if len(self.targets) < MAX_TARGETS_PER_STEP:
            self.targets.append(batch_hash(data, {}))
            self.targets_rounded.append(rounded_hashes(data, {}))

    def _root_forward(self, module, args, kwargs, output):
        if not self._recording():
            return None
        self.hash_batch(args, kwargs)  # at the call's end: a process-wide pre-hook is given no kwargs (``attach.py``)
        # the model's outputs are not data when fed back (``batches.data_tensors``): their memory held (so that no
        # other tensor takes it), not their autograd graph (freed where the loop frees it: 0.9 ms a step, char_gru)
        self.made.extend(t.detach() for t in floats(output))
        if not self.optimizers and not self.backward_end:  # optimizer=None: a step ends with its backward
            grad_out = next((t for t in floats(output) if t.requires_grad), None)
            if grad_out is not None:
                self.backward_end = True
                grad_out.register_hook(self._queue_backward_end)
        if not self._layers_now():  # a step the selection leaves out, or paused: the loss's op still found
            self.model_fns = [t.grad_fn for t in floats(output) if t.grad_fn is not None]
            return None
        inner = self.model if module is self.outer else module  # the model called (one of several)
        leaf = inner in self.leaves
        if not leaf and self.leaf_calls == getattr(self, "leaves_before", self.leaf_calls) and self.leaves \
                and (self.selection.layers is None or self.compiled is not None):
            self._hidden_forward(args, output, kwargs)  # compiled whole: no leaf hook ran inside it
            return None
        return self._forward(inner, args, output, kwargs)

    def _hidden_forward(self, args, output, kwargs=None) -> None:
        """A forward whose layers ran inside a compiled graph: the model's output recorded as its one layer."""
        if not self.hidden:
            self.hidden = True
            self.compiled = self.compiled or "a compiled call of the model"
            self.notes.append(f"{HIDDEN} (from step {self.step_index}; {self.compiled})")
        name = self.names[self.model]
        outs = floats(output)
        row = self._measure_leaf(name, args, outs)
        if self.taker is not None:  # the call as made (a compiled run's backends are re-run on it: ``backends.py``)
            self.taker.take_call(name, floats((args, kwargs or {})), outs, args, kwargs, measured=row)
        self.model_fns = [t.grad_fn for t in outs if t.grad_fn is not None]
        self.model_out = weakref.ref(outs[0]) if outs else None
        self._check_producer(self.model, name, args, outs, row, leaf=True)

    def _forward(self, module, args, output, kwargs=None):
        if tracing():  # inside a compiled graph: nothing of the watch is traced into it
            return None
        if not self._layers_now():
            return None
        name = self.names[module]
        outs = floats(output)
        row = None
        if module in self.leaves:
            self.leaf_calls += 1
            row = self._measure_leaf(name, args, outs)
        if self.taker is not None and module in self.leaves:  # the call as made: ints, tuples, kwargs (issue 43)
            self.taker.take_call(name, floats((args, kwargs or {})), outs, args, kwargs, module, measured=row)
        if module in self.roots:  # where the loss's own code begins (``loss_op`` stops there)
            self.model_fns = [t.grad_fn for t in outs if t.grad_fn is not None]
            self.model_out = weakref.ref(outs[0]) if outs else None
        self._check_producer(module, name, args, outs, row, leaf=module in self.leaves)
        if module in self.roots and self.stacked.calls:  # the forward's end: its repeated calls measured
            self._flush_stacked()
        return None

    def _measure_leaf(self, name: str, args, outs) -> dict | None:
        """A leaf call's statistics: measured now (its row), or left on the device for the step's end (None)."""
        if outs and name not in self.order:
            self.order[name] = None
        if not outs:
            return None
        if self.buffer is not None:
            self.buffer.leaf(name, outs[0], outs[1:], floats(args) if self.producer is None else [])
            self.last_leaf = (outs[0], len(self.buffer.calls) - 1)
            return None
        if self.stacked.takes(outs[0], seen=name in self.layers or name in self.stacked_names):
            # a layer's repeated small call: measured with the others at the forward's end (``stacked.py``)
            self.stacked_names.add(name)
            if self.stacked.add(name, outs, args, floats(args) if self.producer is None else []):
                self._flush_stacked()
            return STACKED
        if name in self.stacked_names and self.stacked.calls:  # measured now: its calls waiting measured first
            self._flush_stacked()
        row = _stats.measure(outs[0])
        self.layers[name] = _stats.merge(self.layers.get(name), row)
        return row

    def found_optimizer(self, optimizer) -> bool:
        """An optimizer met stepping the watched parameters that the watch was not given (made inside the block,
        or ``optimizer=None``): taken as the run's when it has none (``attach._adopt``), its settings as now."""
        if self.optimizer is not None:  # said once: its steps are not this run's (``optimizers=`` takes several)
            self.notes.append(f"another optimizer ({type(optimizer).__name__}) stepped the watched parameters from step "
                              f"{self.step_index}; only the one given is recorded (optimizers=[...] records several)")
            return False
        self.optimizer, self.settings = optimizer, optimizer_settings(optimizer)
        self.optimizers.append(optimizer)
        self.notes.append(f"optimizer {type(optimizer).__name__} found stepping the model's parameters at step "
                          f"{self.step_index} (not passed to convcheck.watch)")
        return True

    def _pre_step(self, optimizer, args, kwargs):
        self.lr_used = learning_rates(self.optimizer)  # what this step used: a scheduler may change it before w.step
        if closure(args, kwargs):  # step(closure): forward and backward run inside it (Lightning, LBFGS)
            self.closure_step = True  # LBFGS may move the parameters between the closure's evaluations
            return None
        self._read_grads(optimizer)
        return None

    def _read_grads(self, optimizer=None) -> None:
        self.grad_norms = self._norms(optimizer)
        self._sample_grads()
        if self.taker is not None:
            self.taker.take_grads(self.params)

    def _sample_grads(self) -> None:
        """A few entries of every gradient: read now, or with a deferred step's one read (``recipe.py``)."""
        if self.buffer is None:
            self.grad_sample = grad_sample(self.params)
        else:
            self.buffer.samples(*sample_parts(self.params))

    def _post_step(self, optimizer, args, kwargs):
        if closure(args, kwargs):  # the gradients the closure made (the update leaves them as they were)
            self._read_grads(optimizer)
        self.stepped = True
        self.stepped_by.add(id(optimizer))  # several optimizers (a GAN's): the step ends once each has stepped
        self.pending = not self.explicit and len(self.stepped_by) >= len(self.optimizers)  # at the next forward
        return None

    def _norms(self, optimizer) -> dict:
        """The gradient norms at ``optimizer``'s step: every parameter's, or with several optimizers the ones it
        holds (read at once), added to those the others read this step."""
        if len(self.optimizers) < 2 or optimizer is None:
            return grad_norms(self.params, self.buffer)
        mine = _several.held(optimizer)
        return {**(self.grad_norms or {}), **grad_norms([(n, p) for n, p in self.params if id(p) in mine])}

    def _queue_backward_end(self, grad):
        """Without an optimizer (a manual update): the step's gradients are read when its backward ends."""
        if self.failed is None:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
        return None

    def _backward_end(self) -> None:
        try:
            self._read_backward()
        except Exception as error:  # noqa: BLE001 - the watch's own (``fail``)
            self.fail(error, "the end of a backward")

    def _read_backward(self) -> None:
        if self.optimizers or self.failed is not None:  # one was found stepping meanwhile: its hooks read the step
            return
        self._read_grads()
        self.stepped = True  # the loop's own update follows (seen in the next step's parameters)
        self.pending = not self.explicit
        return None

    # --- the user's call -----------------------------------------------------------
    def step(self, loss=None) -> None:
        """End the step: record ``loss`` (a tensor or number) with what the hooks saw since the last step."""
        if self.failed is not None:
            return
        value = step_loss(loss)  # a loss that is no scalar: the user's UsageError
        try:
            self._step(loss, value)
        except Exception as error:  # noqa: BLE001 - the watch's own: recording stops, the loop goes on (``fail``)
            self.fail(error, "w.step")

    def _step(self, loss, value) -> None:
        self.explicit = True
        self._flush_stacked(live=False)
        self.loss_dtype = loss_dtype(loss, self.model_fns)
        if self.grad_norms is None:
            self.grad_norms = grad_norms(self.params, self.buffer)
            self._sample_grads()
            if self.taker is not None and not self.taker.grads:
                self.taker.take_grads(self.params)
        self._resolve()
        p = self.producer
        if value is not None and not math.isfinite(value) and (p is None or (
                p["step"] == self.step_index and p["direction"] == "backward")):
            # the loss is already non-finite in its forward: a backward NaN/Inf of this step came after it
            self._found("the loss", "forward", "own code", detail=f"the loss is {value}", ended=self.defer)
            self.producer.update(loss_op(loss, value, self.model_fns))
        self._end_step(loss=value, where="w.step")

    def _end_step(self, loss, where: str = "the step's end") -> None:
        """The step recorded; ``where``: what ended it (a failure of its snapshot's write is said there)."""
        _attach.outermost()
        self._flush_stacked(live=False)  # calls made outside the model's forward (its end flushes the others)
        self._resolve()
        self._scaler_skip()
        self._producer_call()
        record = {"step": self.step_index, "loss": loss, "lr": self.lr_used if self.lr_used is not None else learning_rates(self.optimizer), "batch_sha256": self.hashes,
                  "batch_rounded": self.rounded,
                  **({"target_sha256": self.targets, "target_rounded": self.targets_rounded} if self.targets else {}),
                  "grad_norms": self.grad_norms or {}, "stepped": self.stepped,
                  "layers": {n: _stats.finish(self.layers[n]) for n in self.order if n in self.layers}}
        record.update(self.forward_state or {})
        if self.loss_dtype:
            record["loss_dtype"] = self.loss_dtype
        if self.closure_step and len(self.hashes) > 1:  # the closure's evaluations, each a forward of the model
            record["closure_evaluations"] = len(self.hashes)
        if self.grad_sample:
            record["grad_sample"] = self.grad_sample
        norms = record["grad_norms"].values()
        if self.grads_together and any(isinstance(v, float) and not math.isfinite(v) for v in norms):
            record["grads_unchecked"] = dict(self.grads_together)  # a parameter's gradient non-finite: said where
        if not self.chosen:
            record["layers_recorded"] = False  # left out by the selection, or paused
        if self.scaler is not None:
            record["scale"] = float(self.scaler.get_scale())
            record["skipped"] = not self.stepped
            record.update(self.spy.end_step(not self.stepped) if self.spy is not None else {})
        if not self.hashes and self.eval_forwards and self.stepped:
            # the optimizer stepped on forwards run in eval mode only: training with BatchNorm's running
            # statistics and Dropout off - said once, and marked on every such step
            record["model_eval"] = True
            if not any(n.startswith("trained in eval mode") for n in self.notes):
                self.notes.append(f"trained in eval mode from step {self.step_index}: the model's forwards ran with "
                                  "model.training False (model.train() not called after an evaluation?); those "
                                  "steps' layers and batches are not recorded")
        if self.taker is not None:
            self._write_snapshot(where)
        line = json.dumps(record) + "\n"
        if not self.truncated:
            self._record_line(line)
        self.step_index += 1
        self._reset()

    def _producer_call(self) -> None:
        """A forward producer found this step keeps its call index only when its layer was called more than once
        in the step (a recurrent cell: the time step that made the first NaN/Inf, issue 48)."""
        p = self.producer
        if p is not None and p["step"] == self.step_index and "call" in p \
                and self.layers.get(p["layer"], {}).get("calls", 1) < 2:
            del p["call"]

    def _record_line(self, line: str) -> None:
        """A step's record, within ``max_bytes``: written, or held while a snapshot is written in the background (a
        record that only the snapshot's exact size lets in or not waits for it; held records follow it into
        ``steps.jsonl``, or go with it when it fails)."""
        if self.writing is not None and (self.writing.done()
                                         or self.written + self.writing.bound + len(line) > self.max_bytes):
            self._settle()
        if self.written + len(line) > self.max_bytes:
            self._cap(f"the per-step record of step {self.step_index}")
            return
        self.written += len(line)
        if self.writing is not None:
            self.held.append((line, self.step_index + 1))
        else:
            self._emit(line, self.step_index + 1)

    def _emit(self, line: str, recorded: int) -> None:
        self.steps_file.write(line)
        self.steps_file.flush()
        self.steps_sha.update(line.encode("utf-8"))
        self.recorded = recorded

    def _settle(self) -> None:
        """The snapshot being written in the background waited for: its entry indexed, the step records held behind
        it written; its failure raised (``SnapshotWriteFailed``, said by ``fail`` as at the end of its step)."""
        pending, self.writing = self.writing, None
        if pending is None:
            return
        try:
            entry = pending.wait()
        except SnapshotWriteFailed:
            self.held.clear()  # its step's record and those after it: the recording stopped at its step
            raise
        self.written += entry["bytes"]
        self.snapshot_index.append(entry)
        held, self.held = self.held, []
        for line, recorded in held:
            self._emit(line, recorded)

    def _write_snapshot(self, where: str) -> None:
        """The step's snapshot handed to a thread of its own (``snapshot_file.Background``): the loop goes on while it
        is written, hashed as it is (issue 45)."""
        self._settle()  # one at a time (settled already when this step's budget was taken)
        size = self.taker.nbytes()
        if self.taker.over is not None or self.written + size > self.max_bytes:
            reason = (f"snapshot of step {self.step_index} ({size / 1e6:.1f} MB) not written: its parameters and "
                      f"gradients alone pass its budget ({self.taker.budget / 1e6:.1f} MB: snapshot_bytes="
                      f"{self.snapshot_bytes}, max_bytes={self.max_bytes} with {self.written / 1e6:.1f} MB written "
                      f"before it); raise snapshot_bytes ({ENV_SNAPSHOT_BYTES}) or max_bytes ({ENV_MAX_BYTES}) to "
                      "keep it")
            self.skipped.append({"step": self.step_index, "bytes": size, "reason": reason})
            self.notes.append(reason)
            print(f"convcheck.watch: {reason}", file=sys.stderr)
            self.taker.drop()
            return
        file = self.taker.file(self.out / SNAPSHOTS, self.step_index)
        self.writing = Background(file.write, self.step_index, where, size)
        if size < BACKGROUND_FROM:  # a small one waited for at once: its write overlaps little, contends for the GIL
            self._settle()          # with the loop, and would hold the step records behind it (a kill loses them)

    def _cap(self, what: str) -> None:
        self.truncated = True
        self.notes.append(f"recording stopped at step {self.step_index}: {what} would pass "
                          f"max_bytes={self.max_bytes} ({self.max_bytes / 1e6:.1f} MB); raise max_bytes to keep more")
        print(f"convcheck.watch: {self.notes[-1]}", file=sys.stderr)

    def _write_manifest(self, complete: bool) -> None:
        from convcheck.files import atomic_write_text

        atomic_write_text(self.out / MANIFEST, manifest_text(manifest_of(self, complete)))


def watch(model=None, optimizer=None, *, out, scaler=None, snapshot_steps=(0,), snapshot_nonfinite: bool = True,
          max_bytes: int = DEFAULT_MAX_BYTES, force: bool = False, layers=None, steps=None, every: int = 1,
          sync: str = "auto", models=None, optimizers=None, snapshot_bytes: int = DEFAULT_SNAPSHOT_BYTES,
          repeated_grads: str = "together") -> Watch:
    """``with convcheck.watch(model, optimizer, out="runs/gpu") as w:`` around the user's loop.

    Records at each ``optimizer.step()`` (or at ``w.step(loss)`` once the loop calls it, which also
    records the loss); ``scaler``: a ``torch.amp.GradScaler`` whose scale and skipped steps to record;
    ``snapshot_steps``: the steps whose every layer input/output, parameter and gradient is saved (and the
    step where anything first turns non-finite, unless ``snapshot_nonfinite=False``); ``snapshot_bytes``: the
    most one snapshot step holds, in memory and on disk (default 256 MiB): past it, each layer keeps its first,
    last, worst (largest max|x|) and first non-finite calls and the earliest others that fit, the rest counted in
    the snapshot's ``kept`` and said by ``diff``; ``max_bytes``: the most the run may write (a snapshot gets the
    rest when less than ``snapshot_bytes``; one whose parameters and gradients alone pass its budget is skipped
    with one warning, recorded in the manifest's ``skipped_snapshots``); ``force``: replace an earlier watched
    run in ``out``. The environment variables ``CONVCHECK_SNAPSHOT_STEPS=0,10,20``,
    ``CONVCHECK_WATCH_MAX_BYTES=500M`` and ``CONVCHECK_SNAPSHOT_BYTES=64M``, when set, replace ``snapshot_steps``,
    ``max_bytes`` and ``snapshot_bytes`` without touching the script.

    What is recorded (``selection.py``; each has an environment variable too): ``layers``, module-name patterns
    (``["layer4.*", "fc"]``; the others get no hook); ``steps``, steps or windows (``range(100, 200)``,
    ``"0-99,500"``); ``every``, every N-th step; ``sync``: ``"step"`` reads the statistics once a step (the
    default on an accelerator), ``"layer"`` as each layer runs (the default on the CPU; on a GPU it also names
    the op of the first NaN/Inf and snapshots it at once). Steps left out still record their loss, gradient
    norms and batch. ``w.pause()`` / ``w.resume()`` around a phase the loop wants left out. ``repeated_grads``:
    ``"together"`` (the default) checks the gradients into a layer's second and later small calls in a step (a
    cell unrolled over time) with its first call's and the parameters' (a first non-finite gradient found then
    says that it may have come in at one of them); ``"each"`` hooks every call, at about 20 us a call.

    Several models and optimizers (a GAN): ``models={"G": G, "D": D}`` (or a list: named by class) and
    ``optimizers=[opt_g, opt_d]``; layers are named ``G.fc``..., a step ends once every optimizer has stepped
    (``several.py``). ``optimizer=None``: an optimizer that steps the model's parameters is found at its first
    step; with none at all (a manual update) each backward ends a step. ``convcheck.watch.current()`` is the
    innermost open watch, for ``w.step(loss)`` deep in the user's functions. Nothing is attached to the model or
    the optimizer (``attach.py``): saving, copying or averaging them inside the block works as without it."""
    return Watch(model, optimizer, out=out, scaler=scaler, snapshot_steps=snapshot_steps,
                 snapshot_nonfinite=snapshot_nonfinite, max_bytes=max_bytes, force=force, layers=layers, steps=steps,
                 every=every, sync=sync, models=models, optimizers=optimizers, snapshot_bytes=snapshot_bytes,
                 repeated_grads=repeated_grads)
