"""A watched run's ``manifest.json``: what the watch knew of the run, written as the block starts (``complete``:
false) and again as it ends."""

from __future__ import annotations

import json

from convcheck.watch import stats as _stats
from convcheck.watch.compiled import fallback_random
from convcheck.runformat.layout import WATCH_SCHEMA
from convcheck.watch.settings import module_of


def manifest_of(w, complete: bool) -> dict:
    """The manifest of the ``Watch`` ``w`` as it stands."""
    return {
        "schema": WATCH_SCHEMA, "complete": complete, "steps": getattr(w, "recorded", 0),
        # the SHA-256 of steps.jsonl as written (diff checks it, as each snapshot file's in its entry)
        "steps_sha256": w.steps_sha.hexdigest(),
        "model": {"class": type(w.model).__name__, "module": module_of(type(w.model)),
                  "qualname": type(w.model).__qualname__, "device": w.device,
                  # the DataParallel / DDP the model was given in (its layers named as the model's own), or None
                  "wrapper": getattr(w, "wrapper", None),
                  "parameters": [{"name": n, "shape": list(p.shape), "dtype": _stats.dtype_name(p)}
                                 for n, p in w.params],
                  "layers": [w.names[m] for m in w.names if m in w.leaves],
                  # each leaf's class: compare's dead-unit detector reads the ReLUs' zeros (older runs: none)
                  "layer_types": {w.names[m]: type(m).__name__ for m in w.names if m in w.leaves},
                  # torch's own leaves as safe data, rebuilt by the judge without the run's code (``by_value.py``)
                  "leaf_specs": getattr(w, "leaf_specs", None)},
        # the model by value (``snapshots/model.pkl``, the script) and this user's signature of it, or None
        "code": getattr(w, "code", None),
        "optimizer": type(w.optimizer).__name__ if w.optimizer is not None else None,
        "optimizer_settings": getattr(w, "settings", None),
        "recipe": getattr(w, "recipe", None),  # the recipe whole (``recipe.recipe_of``), diffed before any tensor
        "scaler": w.scaler is not None, "fingerprint": w.fingerprint, "math_flags": w.flags,
        "first_nonfinite": w.producer, "snapshots": w.snapshot_index, "notes": list(w.notes),
        "max_bytes": w.max_bytes, "snapshot_bytes": getattr(w, "snapshot_bytes", None), "truncated": w.truncated,
        "skipped_snapshots": w.skipped,
        "settings_from_env": {k: list(v) if isinstance(v, tuple) else v for k, v in w.from_env.items()},
        "distributed": w.distributed, "stopped": getattr(w, "stopped", None),
        # an error in the watch's own code that stopped the recording (step, where, exception, message), or None
        "watch_error": getattr(w, "failed", None),
        "selection": w.selection.to_dict(),  # the layers and steps recorded (``selection.py``)
        # a DistributedSampler's shuffle and the epochs it was told (``sampler_use.py``), None without one
        "sampler": w.sampler.record() if w.sampler is not None else None,
        # how the model was compiled (None: not, so far as the watch knew at the start), and whether its
        # layers ran inside a compiled graph (only the model's output was recorded as a layer then)
        "compiled": {"how": w.compiled, "layers_hidden": w.hidden, "fallback_random": fallback_random()},
    }


def manifest_text(manifest: dict) -> str:
    """The manifest as written: one line a key, each value in JSON's compact form - the C encoder's (``indent``
    takes json's Python one: a snapshot's index of a few hundred arrays, 1.7 against 0.3 ms, paid as the block ends)."""
    return "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in manifest.items()) + "\n}\n"
