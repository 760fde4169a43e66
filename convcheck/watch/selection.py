"""What a watch records, chosen by the script or by environment variables (issue 35): layers by name
pattern, steps by window or every N, ``w.pause()``/``w.resume()``, and when statistics are read.

Every step is still a line of ``steps.jsonl`` - its loss, learning rates, gradient norms and batch hashes, so
two runs stay aligned step by step - but the per-layer hooks record only the chosen layers on the chosen
steps while not paused (a step left out has ``"layers_recorded": false``); a layer left out gets no hook.

    CONVCHECK_WATCH_LAYERS=layer4,fc        fnmatch patterns over module names (``model.named_modules()``); a
                                            module with children stands for every layer inside it
    CONVCHECK_WATCH_STEPS=0-99,500          steps, or inclusive windows, comma-separated; ``500-`` is step 500 on
    CONVCHECK_WATCH_EVERY=10                every 10th step (0, 10, 20, ...)
    CONVCHECK_WATCH_SYNC=step|layer|auto    read statistics once a step (``deferred.py``) or as each layer
                                            runs; auto: once a step on an accelerator, as they run on the CPU
    CONVCHECK_WATCH_REPEATED_GRADS=together|each
                                            the gradients into a layer's repeated small calls in a step (a cell
                                            unrolled over time; ``stacked.py``): checked with its first call's
                                            (together, the default: a hook a call is most of the watch's cost
                                            there) or call by call, naming the call a first NaN/Inf came in at

Each variable, when set, replaces the script's argument; a bad value is one ``UsageError`` naming it.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass

from convcheck.errors import UsageError
from convcheck.steps import MAX_STEP, shown, step_windows, whole_number  # noqa: F401 - shared here too

ENV_LAYERS = "CONVCHECK_WATCH_LAYERS"
ENV_STEPS = "CONVCHECK_WATCH_STEPS"
ENV_EVERY = "CONVCHECK_WATCH_EVERY"
ENV_SYNC = "CONVCHECK_WATCH_SYNC"
ENV_REPEATED = "CONVCHECK_WATCH_REPEATED_GRADS"
SYNCS = ("auto", "step", "layer")
REPEATED = ("together", "each")


@dataclass(frozen=True)
class Selection:
    layers: tuple[str, ...] | None = None  # fnmatch patterns; None: every layer
    steps: tuple[tuple[int, int], ...] | None = None  # inclusive windows; None: every step
    every: int = 1
    sync: str = "auto"
    repeated_grads: str = "together"

    def layer_chosen(self, name: str) -> bool:
        """A layer whose name, or the name of a module it is inside, matches a pattern (``layer4`` is all of
        ResNet's fourth stage)."""
        if self.layers is None:
            return True
        parts = name.split(".")
        names = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        return any(fnmatch.fnmatchcase(n, p) for n in names for p in self.layers)

    def step_chosen(self, step: int) -> bool:
        if step % self.every:
            return False
        return self.steps is None or any(lo <= step <= hi for lo, hi in self.steps)

    def to_dict(self) -> dict:
        return {"layers": None if self.layers is None else list(self.layers),
                "steps": None if self.steps is None else [list(w) for w in self.steps], "every": self.every,
                "sync": self.sync, "repeated_grads": self.repeated_grads}


def _layers(value, what: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (str, list, tuple)):
        raise UsageError(f"{what}={shown(value, 80)} (of type {type(value).__name__}) is not a list of module-name patterns "
                         "(e.g. ['layer4.*', 'fc'] or 'layer4.*,fc')")
    items = [p.strip() for p in value.split(",")] if isinstance(value, str) else list(value)
    if not items or not all(isinstance(p, str) and p.strip() and len(p) <= 200 for p in items):
        raise UsageError(f"{what}={shown(value, 80)} is not a list of module-name patterns (e.g. 'layer4.*,fc')")
    return tuple(p.strip() for p in items)


def _windows(value, what: str) -> tuple[tuple[int, int], ...] | None:
    return None if value is None else step_windows(value, what)


def _every(value, what: str) -> int:
    return whole_number(value, what, lo=1, takes="a whole number of steps")


def _sync(value, what: str, among: tuple[str, ...] = SYNCS) -> str:
    text = value.strip().lower() if isinstance(value, str) else None
    if text not in among:
        raise UsageError(f"{what}={shown(value, 40)} is not one of {', '.join(among)}")
    return text


def selection(layers=None, steps=None, every=1, sync="auto", environ=None,
              repeated_grads="together") -> tuple[Selection, dict]:
    """The watch's ``Selection`` from its arguments, each replaced by its environment variable when set;
    and the variables that were set (recorded in the manifest's ``settings_from_env``)."""
    env = os.environ if environ is None else environ
    got = {k: env[k] for k in (ENV_LAYERS, ENV_STEPS, ENV_EVERY, ENV_SYNC, ENV_REPEATED) if env.get(k) is not None}
    sel = Selection(
        layers=_layers(got[ENV_LAYERS], ENV_LAYERS) if ENV_LAYERS in got else _layers(layers, "layers"),
        steps=_windows(got[ENV_STEPS], ENV_STEPS) if ENV_STEPS in got else _windows(steps, "steps"),
        every=_every(got[ENV_EVERY], ENV_EVERY) if ENV_EVERY in got else _every(every, "every"),
        sync=_sync(got[ENV_SYNC], ENV_SYNC) if ENV_SYNC in got else _sync(sync, "sync"),
        repeated_grads=_sync(got[ENV_REPEATED], ENV_REPEATED, REPEATED) if ENV_REPEATED in got
        else _sync(repeated_grads, "repeated_grads", REPEATED))
    return sel, got


def unmatched(sel: Selection, names) -> list[str]:
    """The layer patterns that match no module name: each a mistake the user should hear about at once."""
    names = list(names)
    return [p for p in (sel.layers or ()) if not any(fnmatch.fnmatchcase(n, p) for n in names)]
