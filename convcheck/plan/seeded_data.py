"""Seeded input batches, made once on the CPU in float64 and hashed.

Sources (the ``source`` string of :func:`load_batches`):

* ``None`` or ``"synthetic"``: learnable synthetic data. Each class has a smooth
  random prototype (low-resolution noise upsampled bilinearly, seeded from
  ``(seed, class)``); a sample is its prototype plus white Gaussian noise,
  scaled to roughly zero mean and unit std. Prototypes are made lazily, only
  for the classes that occur, at one thread (``threads.single_threaded``): the
  upsampling's and the std's last bits would otherwise depend on the thread
  count, and the batches must be the same bits at any count. The rest is
  exact elementwise arithmetic (a sum, a product), the same at any count.
  When the model has more than ``SYNTHETIC_MAX_CLASSES`` classes (ImageNet's 1000), labels are drawn from a
  seeded subset of that many classes, so that a few dozen steps can learn them.
* ``"mnist:DIR"``: MNIST IDX files (raw or gzipped) in DIR, normalised with the
  usual mean 0.1307 / std 0.3081.
* ``"npz:PATH"``: arrays ``x`` (N,C,H,W or N,H,W) and ``y`` (N,) used as given.

The files are read by ``convcheck.plan.data_files``; ``open_builtin`` gives the batches
of any of these sources one at a time (``convcheck.plan.stream`` streams them).

Every batch is a float64 ``x`` and an int64 ``y`` on the CPU; targets cast and
move them. ``Batches.hashes`` holds a SHA-256 per batch for the run record.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch

from convcheck.batch import batch_hash as _batch_hash
from convcheck.errors import UsageError
from convcheck.plan.data_files import read_mnist, read_npz
from convcheck.plan.threads import single_threaded

Batch = tuple[torch.Tensor, torch.Tensor]

SYNTHETIC_MAX_CLASSES = 10
SYNTHETIC_NOISE_STD = 1.0  # white noise, relative to a unit-std prototype
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081


@dataclass(frozen=True)
class Batches:
    """The batches every arm trains on, with one hash per batch."""

    source: str
    batches: tuple[Batch, ...]
    hashes: tuple[str, ...]
    note: Optional[str] = None

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)

    def __getitem__(self, i: int) -> Batch:
        return self.batches[i]

    def stats(self) -> dict:
        """Summary of all inputs and labels (to spot e.g. raw 0..255 pixels)."""
        n = 0
        total = 0.0
        total_sq = 0.0
        x_min, x_max = float("inf"), float("-inf")
        labels = []
        for x, y in self.batches:
            n += x.numel()
            total += float(x.sum())
            total_sq += float((x * x).sum())
            x_min = min(x_min, float(x.min()))
            x_max = max(x_max, float(x.max()))
            labels.append(y)
        y_all = torch.cat(labels)
        mean = total / n
        var = max(total_sq / n - mean * mean, 0.0)
        return {
            "samples": int(y_all.numel()),
            "x_min": x_min,
            "x_max": x_max,
            "x_mean": mean,
            "x_std": var**0.5,
            "y_min": int(y_all.min()),
            "y_max": int(y_all.max()),
            "y_distinct": int(torch.unique(y_all).numel()),
        }


def load_batches(
    source: Optional[str],
    *,
    input_shape: tuple[int, int, int],
    num_classes: int,
    batch_size: int,
    num_batches: int,
    seed: int,
) -> Batches:
    """Make ``num_batches`` batches of ``batch_size`` samples from ``source``."""
    input_shape = check_args(input_shape, num_classes, batch_size, num_batches)
    spec = "synthetic" if source is None else source.strip()
    kind, sep, arg = spec.partition(":")
    if kind == "synthetic" and not sep:
        return _synthetic(input_shape, num_classes, batch_size, num_batches, seed)
    x, y, origin, kind, path = _read_source(source, kind, arg, input_shape, num_classes)
    return _sample(f"{kind}:{path}", x, y, origin, batch_size, num_batches, seed, kind == "mnist")


def hash_state_dict(module_or_state_dict: Union[torch.nn.Module, Mapping]) -> str:
    """SHA-256 over names, shapes and float64 bytes of every tensor, in sorted key order."""
    if isinstance(module_or_state_dict, torch.nn.Module):
        state = module_or_state_dict.state_dict()
    else:
        state = module_or_state_dict
    h = hashlib.sha256()
    for name in sorted(state):
        value = state[name]
        if not isinstance(value, torch.Tensor):
            continue  # e.g. a module's extra state: not a number we train
        t = value.detach().to(device="cpu", dtype=torch.float64).contiguous()
        h.update(name.encode() + b"\0" + repr(tuple(t.shape)).encode() + b"\0")
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def batch_hash(x: torch.Tensor, y: torch.Tensor) -> str:
    """SHA-256 of one batch: the bytes of ``x`` then of ``y`` (contiguous, on the CPU)."""
    return _batch_hash(x, y)


# ---------------------------------------------------------------- helpers


def check_args(input_shape, num_classes, batch_size, num_batches) -> tuple[int, int, int]:
    try:
        shape = tuple(int(s) for s in input_shape)
    except (TypeError, ValueError):
        raise UsageError(f"input shape {input_shape!r} must be three integers (C, H, W)") from None
    if len(shape) != 3 or min(shape) < 1:
        raise UsageError(f"input shape {tuple(input_shape)} must be three positive sizes (C, H, W)")
    for name, value in (("num_classes", num_classes), ("batch_size", batch_size),
                        ("num_batches", num_batches)):
        if int(value) < 1:
            raise UsageError(f"{name} must be at least 1, got {value}")
    return shape


def _finish(source: str, batches: list[Batch], note: Optional[str]) -> Batches:
    batches = [(x.contiguous(), y.contiguous()) for x, y in batches]
    return Batches(
        source=source,
        batches=tuple(batches),
        hashes=tuple(batch_hash(x, y) for x, y in batches),
        note=note,
    )


def seeded_generator(seed: int, *salt) -> torch.Generator:
    """A CPU generator seeded from ``seed`` and ``salt`` (stable across runs and platforms)."""
    key = ":".join(str(s) for s in ("convcheck", seed) + salt).encode()
    g = torch.Generator(device="cpu")
    g.manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "big") >> 1)
    return g


# ---------------------------------------------------------------- synthetic


def _coarse(side: int) -> int:
    """Side of the coarse noise grid: features ~7 px wide, at most 16 cells a side."""
    return max(2, min(16, round(side / 7)))


def _prototype(shape: tuple[int, int, int], seed: int, label: int) -> torch.Tensor:
    """Smooth zero-mean unit-std pattern for one class: coarse noise, upsampled."""
    c, h, w = shape
    g = seeded_generator(seed, "prototype", label)
    coarse = torch.randn(1, c, _coarse(h), _coarse(w), generator=g, dtype=torch.float64)
    with single_threaded():  # the upsampling and the std round differently at each thread count (issue 44)
        p = torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)[0]
        return (p - p.mean()) / p.std().clamp_min(1e-12)


def _synthetic(shape, num_classes, batch_size, num_batches, seed) -> Batches:
    note, open_iter = _synthetic_source(shape, num_classes, batch_size, seed)
    return _finish("synthetic", list(itertools.islice(open_iter(), num_batches)), note)


def _synthetic_source(shape, num_classes, batch_size, seed):
    """(note, open_iter): ``open_iter()`` yields the synthetic batches from the first, without end."""
    note = None
    if num_classes > SYNTHETIC_MAX_CLASSES:
        pool = torch.randperm(num_classes, generator=seeded_generator(seed, "samples"))[:SYNTHETIC_MAX_CLASSES].sort().values
        note = (
            f"synthetic labels use {SYNTHETIC_MAX_CLASSES} of the {num_classes} classes "
            f"({', '.join(str(int(c)) for c in pool)}) so that a short run can learn them"
        )
    else:
        pool = torch.arange(num_classes)

    def open_iter():
        g = seeded_generator(seed, "samples")
        if num_classes > SYNTHETIC_MAX_CLASSES:
            torch.randperm(num_classes, generator=g)  # the draw that chose the pool
        prototypes: dict[int, torch.Tensor] = {}  # made lazily: only classes that occur
        scale = (1.0 + SYNTHETIC_NOISE_STD**2) ** -0.5
        while True:
            y = pool[torch.randint(len(pool), (batch_size,), generator=g)].to(torch.int64)
            noise = torch.randn((batch_size, *shape), generator=g, dtype=torch.float64)
            for label in y.tolist():
                if label not in prototypes:
                    prototypes[label] = _prototype(shape, seed, label)
            x = torch.stack([prototypes[label] for label in y.tolist()])
            x.add_(noise, alpha=SYNTHETIC_NOISE_STD).mul_(scale)
            yield x.contiguous(), y.contiguous()

    return note, open_iter


def _sample(source, x, y, origin, batch_size, num_batches, seed, is_mnist) -> Batches:
    note, open_iter = sample_source(x, y, origin, batch_size, num_batches, seed, is_mnist)
    return _finish(source, list(itertools.islice(open_iter(), num_batches)), note)


def sample_source(x, y, origin, batch_size, num_batches, seed, is_mnist):
    """(note, open_iter): batches of a seeded shuffle of the samples, cycling through it if short.
    Only the order (N integers) is held; each batch is gathered and converted when it is needed."""
    n = len(y)
    need = batch_size * num_batches
    order = torch.randperm(n, generator=seeded_generator(seed, "order")).numpy()
    note = f"{origin} has only {n} samples; cycled through them to fill {need}" if need > n else None

    def open_iter():
        for start in itertools.count(0, batch_size):
            idx = order[np.arange(start, start + batch_size) % n]
            xb = torch.from_numpy(np.ascontiguousarray(x[idx])).to(torch.float64)
            if is_mnist:
                xb = (xb / 255.0 - MNIST_MEAN) / MNIST_STD
            yield xb.contiguous(), torch.from_numpy(np.ascontiguousarray(y[idx])).to(torch.int64)

    return note, open_iter


def open_builtin(source, *, input_shape, num_classes, batch_size, steps, seed):
    """``(source name, note, open_iter)`` of a built-in source: synthetic, mnist:DIR or npz:PATH."""
    input_shape = check_args(input_shape, num_classes, batch_size, steps)
    spec = "synthetic" if source is None else source.strip()
    kind, sep, arg = spec.partition(":")
    if kind == "synthetic" and not sep:
        note, open_iter = _synthetic_source(input_shape, num_classes, batch_size, seed)
        return "synthetic", note, open_iter
    x, y, origin, kind, path = _read_source(source, kind, arg, input_shape, num_classes)
    note, open_iter = sample_source(x, y, origin, batch_size, steps, seed, kind == "mnist")
    return f"{kind}:{path}", note, open_iter


def _read_source(source, kind, arg, input_shape, num_classes):
    if kind not in ("mnist", "npz"):
        raise UsageError(
            f"unknown data source {source!r}: use 'synthetic', 'digits', 'mnist:DIR', 'npz:PATH' "
            "or path/file.py:factory"
        )
    if not arg:
        raise UsageError(f"data source {source!r} needs a path after '{kind}:'")
    path = os.path.abspath(os.path.expanduser(arg))
    if kind == "mnist":
        x, y, origin = read_mnist(path, input_shape)
    else:
        x, y, origin = read_npz(path, input_shape)
    check_labels(y, num_classes, origin)
    return x, y, origin, kind, path


def check_labels(y: np.ndarray, num_classes: int, origin: str) -> None:
    lo, hi = int(y.min()), int(y.max())
    if lo < 0 or hi >= num_classes:
        raise UsageError(
            f"{origin}: labels span {lo}..{hi}, outside 0..{num_classes - 1} for a "
            f"{num_classes}-class model"
        )
