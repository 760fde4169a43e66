"""How the loop uses its GradScaler (issue 36): clipping the *scaled* gradients, the commonest misuse found.

With ``scaler=`` given, while the watch is open: ``scaler.unscale_`` and ``scaler.step`` are wrapped on that
scaler object (its own attributes; the class is untouched), and ``torch.nn.utils.clip_grad_norm_`` /
``clip_grad_value_`` on ``torch.nn.utils`` (the names a loop calls). A clip that runs while the scaler is
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

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

CLIPS = ("clip_grad_norm_", "clip_grad_value_")


class ScalerSpy:
    def __init__(self, scaler):
        self.scaler = scaler
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
        for name, wrap in (("unscale_", self._unscale), ("step", self._step), ("scale", self._scale)):
            if not callable(getattr(s, name, None)):
                continue
            self.saved.append((s, name, s.__dict__.get(name)))
            setattr(s, name, wrap(getattr(s, name)))
        utils = torch.nn.utils
        for name in CLIPS:
            fn = getattr(utils, name, None)
            if fn is not None:
                self.saved.append((utils, name, fn))
                setattr(utils, name, self._clip(fn))
        self.hook = register_optimizer_step_pre_hook(self._optimizer_step)
        return self

    def remove(self) -> None:
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        for owner, name, old in reversed(self.saved):
            if owner is self.scaler and old is None:
                owner.__dict__.pop(name, None)  # the class's method shows again
            else:
                setattr(owner, name, old)
        self.saved.clear()

    def _unscale(self, fn):
        def unscale_(*args, **kwargs):
            if not self.inside_step:
                self.unscaled = True
            return fn(*args, **kwargs)
        return unscale_

    def _scale(self, fn):
        def scale(*args, **kwargs):
            if getattr(self.scaler, "is_enabled", lambda: True)():
                self.scaled = True
            return fn(*args, **kwargs)
        return scale

    def _optimizer_step(self, optimizer, args, kwargs):
        """Any optimizer's step: one taken outside ``scaler.step`` on gradients this scaler scaled and nobody
        unscaled applies them scaled."""
        if self.scaled and not self.inside_step and not self.unscaled:
            self.stepped_outside.add(id(optimizer))
        return None

    def _step(self, fn):
        def step(*args, **kwargs):
            opt = args[0] if args else kwargs.get("optimizer")
            if opt is not None:
                self.optimizers[id(opt)] = type(opt).__name__
            self.inside_step = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside_step = False
        return step

    def _clip(self, fn):
        def clip(*args, **kwargs):
            enabled = getattr(self.scaler, "is_enabled", lambda: True)()
            if enabled and not self.unscaled and not self.inside_step:
                self.clipped_scaled = True
            return fn(*args, **kwargs)
        clip.__wrapped__ = fn
        clip.__name__ = getattr(fn, "__name__", "clip")
        return clip

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
