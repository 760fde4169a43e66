"""A stream of batches: made one at a time on the CPU, hashed, shared by every arm, never all held.

``DataStream`` wraps a source that can start over (``open_iter()`` gives a
fresh iterator from the first batch): parity takes ``first()``, training
iterates from the start again, and the two first batches must be bitwise the
same (a source with unseeded randomness is a usage error, not a finding). The
source's random draws (augmentations, shuffles with the global RNG) run with a
random state of their own, seeded from the run's seed and kept apart from the
arms' seeding, so a rerun gives the same batches. While training iterates,
the stream records each batch's SHA-256 and running input/label statistics.
"""

from __future__ import annotations

import hashlib
import math
import random
from typing import Callable, Iterator

import numpy as np
import torch

from convcheck.batch import batch_hash, check_batch, check_tensors, split_batch
from convcheck.errors import ConvcheckError, UsageError
from convcheck.exit_codes import first_line, resource_reason, user_code_error
from convcheck.nested import tensors_in

# summary.json lists at most this many per-batch hashes (plus one hash over all of them).
HASHES_LISTED = 1000
_DISTINCT_LABELS_KEPT = 100_000


class _OwnRandomState:
    """The global torch / numpy / python random states, swapped for the stream's own around each draw."""

    def __init__(self, seed: int):
        with _kept_global_rng():
            torch.manual_seed(seed)
            np.random.seed(seed % 2**32)
            random.seed(seed)
            self._state = _global_rng()

    def draw(self, fn):
        with _kept_global_rng():
            _set_global_rng(self._state)
            try:
                return fn()
            finally:
                self._state = _global_rng()


def _global_rng():
    return torch.random.get_rng_state(), np.random.get_state(), random.getstate()


def _set_global_rng(state) -> None:
    torch.random.set_rng_state(state[0])
    np.random.set_state(state[1])
    random.setstate(state[2])


class _kept_global_rng:
    def __enter__(self):
        self._saved = _global_rng()

    def __exit__(self, *exc):
        _set_global_rng(self._saved)


class _Stats:
    """Running summary of the first input tensor and of integer labels (to spot raw 0..255 pixels)."""

    def __init__(self):
        self.n, self.total, self.total_sq = 0, 0.0, 0.0
        self.x_min, self.x_max = math.inf, -math.inf
        self.samples = 0
        self.y_min = self.y_max = None
        self.labels: set[int] = set()

    def update(self, inputs, target) -> None:
        xs = [t for t in tensors_in(inputs, sort_keys=True) if t.is_floating_point()]
        if xs:
            x = xs[0].detach().double()
            self.n += x.numel()
            self.total += float(x.sum())
            self.total_sq += float((x * x).sum())
            self.x_min, self.x_max = min(self.x_min, float(x.min())), max(self.x_max, float(x.max()))
            self.samples += int(x.shape[0]) if x.dim() else 1
        ys = [t for t in tensors_in(target, sort_keys=True) if not t.is_floating_point() and t.dtype != torch.bool]
        if ys and ys[0].numel():
            y = ys[0]
            lo, hi = int(y.min()), int(y.max())
            self.y_min = lo if self.y_min is None else min(self.y_min, lo)
            self.y_max = hi if self.y_max is None else max(self.y_max, hi)
            if len(self.labels) < _DISTINCT_LABELS_KEPT:
                self.labels.update(torch.unique(y).tolist())

    def as_dict(self) -> dict:
        mean = self.total / self.n if self.n else math.nan
        var = max(self.total_sq / self.n - mean * mean, 0.0) if self.n else math.nan
        out = {"samples": self.samples, "x_min": self.x_min, "x_max": self.x_max, "x_mean": mean,
               "x_std": var**0.5 if self.n else math.nan}
        if self.y_min is not None:
            out.update(y_min=self.y_min, y_max=self.y_max, y_distinct=len(self.labels))
        return out


class DataStream:
    """Batches from ``open_iter`` (a fresh iterator from the first batch at each call), one at a time."""

    def __init__(self, source: str, open_iter: Callable[[], Iterator], *, steps: int, seed: int,
                 note: str | None = None, where: str = "the data", check_shapes: bool = True,
                 expects: dict | None = None):
        self.source, self.note, self.where = source, note, where
        self._expects = expects or {}  # check_batch's keywords for the first batch (the edge)
        self._open, self._steps, self._seed, self._check_shapes = open_iter, steps, seed, check_shapes
        self._first_hash: str | None = None
        self._shapes: list | None = None
        self._hashes: list[str] = []
        self._all = hashlib.sha256()
        self._stats = _Stats()

    def _items(self) -> Iterator[tuple[object, object]]:
        rng = _OwnRandomState(self._seed)
        it = rng.draw(self._open)
        for step in range(self._steps):
            try:
                item = rng.draw(lambda: next(it))
            except StopIteration:
                raise UsageError(f"{self.where} gave only {step} batches; --steps {self._steps} needs "
                                 f"{self._steps}") from None
            except Exception as exc:  # noqa: BLE001 - classified: whose data, whose code
                raise self._batch_failed(exc, step) from exc
            inputs, target = split_batch(item, self.where)
            check_tensors(inputs, target, self.where)
            if step == 0:
                check_batch(inputs, target, self.where, step, **self._expects)
            self._check_shape(inputs, target, step)
            yield inputs, target

    def _batch_failed(self, exc: Exception, step: int) -> BaseException:
        """Making batch ``step`` raised: the user's Dataset or factory (their line named), torch failing on
        their samples (collating samples of different shapes, a worker that died: the batch named), or the
        machine's limits and convcheck's own errors unchanged."""
        if isinstance(exc, ConvcheckError) or resource_reason(exc) is not None:
            return exc
        located = user_code_error(exc, f"making batch {step} of {self.where}")
        if located is not None:
            return located
        what = f"{type(exc).__name__}: {first_line(exc)}" if first_line(exc) else type(exc).__name__
        return UsageError(f"batch {step} of {self.where} could not be made: {what}")

    def _check_shape(self, inputs, target, step: int) -> None:
        shapes = [tuple(t.shape) for t in tensors_in(inputs, sort_keys=True) + tensors_in(target, sort_keys=True)]
        if self._shapes is None:
            self._shapes = shapes
        elif self._check_shapes and shapes != self._shapes:
            raise UsageError(f"{self.where} changed its batch shapes at batch {step}: {shapes} after {self._shapes} "
                             "(every batch must have the same shapes; drop the last, shorter batch)")

    def first(self) -> tuple[object, object]:
        """The first batch (for the one-step parity check)."""
        inputs, target = next(self._items())
        self._first_hash = batch_hash(inputs, target)
        return inputs, target

    def __iter__(self):
        for step, (inputs, target) in enumerate(self._items()):
            h = batch_hash(inputs, target)
            if step == 0 and self._first_hash is not None and h != self._first_hash:
                raise UsageError(f"{self.where} gave a different first batch on a second pass: it draws random "
                                 "numbers convcheck does not seed (seed them from the torch generator, or "
                                 "build the batches once)")
            if len(self._hashes) < HASHES_LISTED:
                self._hashes.append(h)
            self._all.update(bytes.fromhex(h))
            self._stats.update(inputs, target)
            yield inputs, target

    @property
    def hashes(self) -> tuple[str, ...]:
        """SHA-256 of each batch trained on (the first ``HASHES_LISTED``)."""
        return tuple(self._hashes)

    @property
    def all_hash(self) -> str:
        """One SHA-256 over every batch's hash, in order."""
        return self._all.hexdigest()

    def stats(self) -> dict:
        return self._stats.as_dict()
