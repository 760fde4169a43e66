"""How the loop uses its GradScaler (issue 36): clipping the *scaled* gradients, the commonest misuse found.

With ``scaler=`` given, while the watch is open: ``unscale_``, ``step`` and ``scale`` are wrapped on the scaler's
classes (each class of its MRO that defines one), once for the whole process, each call routed by the scaler's
identity to the spy that watches it (issue 45: nothing is set on the scaler object, so ``pickle``, ``torch.save``
and ``copy.deepcopy`` of it inside the block work as without the watch, and a copy is not watched; other
scalers call straight through), and ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` on
``torch.nn.utils`` (the names a loop calls). A clip that runs while the scaler is
enabled and the loop has not called ``scaler.unscale_(optimizer)`` since the last step clipped the scaled
gradients: ``max_norm`` then bounds gradients ``scale`` times too large (65536 at first), so the true
gradients are clipped to ``max_norm / scale`` - a learning rate divided by the scale. The step is marked
``clip_before_unscale``. And ``scaler.scale`` is wrapped, with a process-wide optimizer step pre-hook (issue 47):
an optimizer step taken outside ``scaler.step`` on a step whose loss the enabled scaler scaled, with no
``scaler.unscale_`` before it (``scaler.scale(loss).backward(); optimizer.step()``), applied the scaled gradients
as they were - ``scale`` times too large - and skipped the Inf/NaN check: the step is marked
``step_without_scaler``. Every wrapper only records and calls through; all are restored on exit.
"""

from __future__ import annotations

import functools
import types

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

CLIPS = ("clip_grad_norm_", "clip_grad_value_")
METHODS = ("unscale_", "step", "scale")

# id(scaler) -> (scaler, [spies], names running): the scalers the open watches spy on, checked by identity
_SPIES: dict[int, tuple] = {}
# (owner, name) -> [what the owner itself held, the wrapper, how many spies need it]: a class's method or a clip
_PATCHED: dict[tuple, list] = {}


def _method(name: str, fn):
    """``fn`` (a scaler class's own ``name``) as the class holds it while a spy is open: a watched scaler's call
    seen by its spies around the call (once: a subclass's ``super().step`` inside it calls straight through)."""
    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        entry = _SPIES.get(id(self))
        if entry is None or entry[0] is not self or name in entry[2]:
            return fn(self, *args, **kwargs)
        spies, running = list(entry[1]), entry[2]
        running.add(name)
        try:
            for spy in spies:
                _guarded(spy, spy.before, name, args, kwargs)
            return fn(self, *args, **kwargs)  # the scaler's own call: its exceptions are the user's
        finally:
            running.discard(name)
            for spy in spies:
                _guarded(spy, spy.after, name)
    return method


def _guarded(spy, record, *args) -> None:
    """``record(*args)``, one of the spy's: an exception there is the watch's, handed to ``spy.on_error``
    (``Watch.fail``: recording stops) - never the loop's."""
    try:
        record(*args)
    except Exception as error:  # noqa: BLE001 - convcheck's own code
        spy.on_error(error, f"the GradScaler's spy ({getattr(record, '__name__', 'record')})")


def _clip(fn):
    @functools.wraps(fn)
    def clip(*args, **kwargs):
        for _, spies, _ in list(_SPIES.values()):
            for spy in spies:
                _guarded(spy, spy.clip)
        return fn(*args, **kwargs)
    return clip


def _patch(owner, name: str, wrap) -> bool:
    """``owner.name`` wrapped (once for all spies; counted): False where it cannot be (a built-in type)."""
    entry = _PATCHED.get((owner, name))
    if entry is None:
        own = vars(owner).get(name)
        wrapper = wrap(own)
        try:
            setattr(owner, name, wrapper)
        except (TypeError, AttributeError):
            return False
        entry = _PATCHED[(owner, name)] = [own, wrapper, 0]
    entry[2] += 1
    return True


def _unpatch(owner, name: str) -> None:
    entry = _PATCHED.get((owner, name))
    if entry is None:
        return
    entry[2] -= 1
    if entry[2] > 0:
        return
    del _PATCHED[(owner, name)]
    if vars(owner).get(name) is entry[1]:  # a patch the user made meanwhile stays
        setattr(owner, name, entry[0])


def _raise(error: Exception, where: str) -> None:
    raise error


def _own_methods(scaler) -> list[tuple]:
    """(class, name) for each class of the scaler's MRO that defines one of ``METHODS`` as a plain function."""
    return [(cls, name) for cls in type(scaler).__mro__ if cls is not object
            for name in METHODS if isinstance(vars(cls).get(name), types.FunctionType)]


class ScalerSpy:
    def __init__(self, scaler, on_error=None):
        self.scaler = scaler
        self.on_error = on_error or _raise  # an exception of the spy's own, met inside the loop (``Watch.fail``)
        self.unscaled = False  # the loop called unscale_ itself since the last step
        self.inside_step = False
        self.clipped_scaled = False  # a clip ran on scaled gradients this step
        self.scaled = False  # the enabled scaler scaled a loss this step (``scaler.scale``)
        self.stepped_outside: set[int] = set()  # optimizers stepped outside scaler.step on those scaled gradients
        self.hook = None  # the optimizer step pre-hook's handle
        self.saved: list[tuple] = []
        self.optimizers: dict[int, str] = {}  # the optimizers this scaler stepped (id -> class name)
        # the learning rates as each step's first forward began, to see a scheduler step on a skipped step
        self.lr_first: list | None = None
        self.prev: tuple | None = None  # (skipped, lr_first) of the step before
        self.skips = self.moved_after_skip = 0

    def install(self) -> "ScalerSpy":
        s = self.scaler
        if not (hasattr(s, "unscale_") and hasattr(s, "step")):
            return self
        entry = _SPIES.get(id(s))
        if entry is None or entry[0] is not s:
            entry = _SPIES[id(s)] = (s, [], set())
        entry[1].append(self)
        for cls, name in _own_methods(s):
            if _patch(cls, name, functools.partial(_method, name)):
                self.saved.append((cls, name))
        utils = torch.nn.utils
        for name in CLIPS:
            if getattr(utils, name, None) is not None and _patch(utils, name, _clip):
                self.saved.append((utils, name))
        self.hook = register_optimizer_step_pre_hook(self._optimizer_step)
        return self

    def remove(self) -> None:
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        for owner, name in reversed(self.saved):
            _unpatch(owner, name)
        self.saved.clear()
        entry = _SPIES.get(id(self.scaler))
        if entry is not None and self in entry[1]:
            entry[1].remove(self)
            if not entry[1]:
                del _SPIES[id(self.scaler)]

    def before(self, name: str, args, kwargs) -> None:
        """The watched scaler's ``name`` called (``_method``): what it says of the loop's use."""
        if name == "unscale_":
            if not self.inside_step:
                self.unscaled = True
        elif name == "scale":
            if getattr(self.scaler, "is_enabled", lambda: True)():
                self.scaled = True
        elif name == "step":
            opt = args[0] if args else kwargs.get("optimizer")
            if opt is not None:
                self.optimizers[id(opt)] = type(opt).__name__
            self.inside_step = True

    def after(self, name: str) -> None:
        if name == "step":
            self.inside_step = False

    def clip(self) -> None:
        """A gradient clip ran: on scaled gradients when the scaler is enabled and nobody unscaled them."""
        enabled = getattr(self.scaler, "is_enabled", lambda: True)()
        if enabled and not self.unscaled and not self.inside_step:
            self.clipped_scaled = True

    def _optimizer_step(self, optimizer, args, kwargs):
        """Any optimizer's step: one taken outside ``scaler.step`` on gradients this scaler scaled and nobody
        unscaled applies them scaled."""
        _guarded(self, self._stepped, optimizer)
        return None

    def _stepped(self, optimizer) -> None:
        if self.scaled and not self.inside_step and not self.unscaled:
            self.stepped_outside.add(id(optimizer))

    def start(self, lrs: list) -> None:
        """A step's first forward: the learning rates it starts with."""
        if self.lr_first is None:
            self.lr_first = list(lrs)

    def notes(self) -> list[str]:
        """What the manifest says of the scaler's use beyond each step's record."""
        out = []
        if self.moved_after_skip:
            out.append(f"the learning rate moved on after {self.moved_after_skip} of the {self.skips} steps the "
                       "GradScaler skipped: the scheduler stepped although the optimizer did not (step it only when "
                       "the optimizer stepped: the scale did not drop in scaler.update())")
        if len(self.optimizers) < 2:
            return out
        return out + [f"one GradScaler stepped {len(self.optimizers)} optimizers ({', '.join(self.optimizers.values())}): "
                "each skips its step only when its own gradients hold Inf/NaN, and they share one scale (the AMP "
                "recipe for several optimizers: scaler.step on each, scaler.update once per iteration)"]

    def end_step(self, skipped: bool = False) -> dict:
        """This step's record (``{"clip_before_unscale": True}`` or nothing), then a fresh step."""
        out = {"clip_before_unscale": True} if self.clipped_scaled else {}
        # one the scaler steps elsewhere, or any when the loop never calls scaler.step (another optimizer trained
        # without AMP beside a scaled one - a GAN's - is not this)
        if self.stepped_outside and (not self.optimizers or self.stepped_outside & set(self.optimizers)):
            out["step_without_scaler"] = True
        self.unscaled = self.clipped_scaled = self.scaled = False
        self.stepped_outside = set()
        if self.prev is not None and self.prev[0] and self.prev[1] is not None and self.lr_first is not None \
                and self.lr_first != self.prev[1]:
            self.moved_after_skip += 1  # the step before was skipped, and this one began at another lr
        self.skips += bool(skipped)
        self.prev, self.lr_first = (bool(skipped), self.lr_first), None
        return out
