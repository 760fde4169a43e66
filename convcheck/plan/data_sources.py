"""Data sources beyond the built-in ones: the user's own data factory, and scikit-learn's digits.

``--data FILE.py:factory`` (or ``package.module:factory``, or ``data=callable``
in the API): ``factory()`` returns

* a ``torch.utils.data.Dataset`` (map-style): batched by a ``DataLoader`` with a
  seeded shuffle, ``--workers`` worker processes seeded from it, cycling
  through epochs when the run needs more batches than one epoch holds;
* an ``IterableDataset``: batched by a ``DataLoader`` in its own order;
* any other iterable: taken as the batches themselves (a list, a generator, a
  ``DataLoader`` of your own). The factory is called again to start over.

``--data digits``: the 1,797 8x8 handwritten digits scikit-learn ships
(``pip install 'convcheck[data]'``), upsampled to the model's input size and
standardised: a real data set that needs no download.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import torch
import torch.nn.functional as F

from convcheck.plan.seeded_data import check_labels, sample_source
from convcheck.plan.threads import single_threaded
from convcheck.errors import UsageError
from convcheck.plan.user_code import load_callable, one_line

DIGITS_CLASSES = 10


def user_source(spec, *, batch_size: int, seed: int, workers: int):
    """``(source name, note, open_iter)`` of a user's data factory."""
    if callable(spec):
        factory, name = spec, getattr(spec, "__name__", "data")
    else:
        factory, name = load_callable(str(spec), "data factory")
    made = _call(factory, name)
    if isinstance(made, torch.utils.data.IterableDataset):
        return f"factory:{name}", None, lambda: iter(_loader(made, batch_size, seed, workers, shuffle=False))
    if isinstance(made, torch.utils.data.Dataset) and hasattr(made, "__len__"):
        n = _length(made, name)
        if n == 0:
            raise UsageError(f"data factory {name!r} returned an empty dataset")
        note = (f"dataset {name!r} has {n} samples, fewer than one batch of {batch_size}: batches are shorter"
                if n < batch_size else None)
        return f"factory:{name}", note, lambda: _epochs(made, batch_size, seed, workers)
    if made is None or not hasattr(made, "__iter__"):
        raise UsageError(f"data factory {name!r} returned {type(made).__name__}, not a Dataset or an iterable "
                         "of batches")
    first = [made]  # the first call's result serves the first pass; later passes call the factory again

    def open_iter():
        it = first.pop() if first else _call(factory, name)
        return iter(it)
    return f"factory:{name}", None, open_iter


# a seeded shuffle draws a permutation of every index: 8 bytes each
MAX_SHUFFLED = 2**31


def _length(dataset, name: str) -> int:
    """``len(dataset)``, checked: a negative, non-integer or absurd length is the user's Dataset at fault."""
    try:
        n = len(dataset)
    except (ValueError, OverflowError, TypeError) as exc:  # torch's len() refuses a negative __len__
        raise UsageError(f"data factory {name!r} returned a Dataset whose __len__ is unusable: "
                         f"{one_line(exc)}") from None
    if n > MAX_SHUFFLED:
        raise UsageError(f"data factory {name!r} returned a Dataset of {n:,} samples: more than {MAX_SHUFFLED:,}, "
                         "too many to shuffle; give it a real length, or wrap a part of it in "
                         "torch.utils.data.Subset (a run needs --steps x --batch-size samples)")
    return n


def _call(factory, name: str):
    try:
        return factory()
    except Exception as exc:  # the user's code
        raise UsageError(f"data factory {name!r} raised {one_line(exc)}") from None


def _loader(dataset, batch_size: int, seed: int, workers: int, shuffle: bool, epoch: int = 0):
    g = torch.Generator().manual_seed((seed * 7919 + epoch) % 2**63)
    return torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, shuffle=shuffle, generator=g, num_workers=workers,
        drop_last=shuffle and len(dataset) >= batch_size, persistent_workers=False)


def _epochs(dataset, batch_size: int, seed: int, workers: int):
    """Seeded epochs one after another, each reshuffled (worker seeds derive from the same generator)."""
    for epoch in itertools.count():
        yield from _loader(dataset, batch_size, seed, workers, shuffle=True, epoch=epoch)


# --- digits ------------------------------------------------------------------------------------------

def digits_source(*, input_shape, num_classes: int, batch_size: int, steps: int, seed: int):
    """``(source name, note, open_iter)`` of scikit-learn's digits at the model's input size."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise UsageError("--data digits needs scikit-learn: pip install 'convcheck[data]'") from None
    c, h, w = input_shape
    d = load_digits()
    x = torch.from_numpy(d.images.astype(np.float64))[:, None] / 16.0  # N, 1, 8, 8 in 0..1
    with single_threaded():  # the same bits at any thread count (issue 44)
        x = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False).expand(-1, c, -1, -1)
        x = ((x - x.mean()) / x.std()).contiguous().numpy()
    y = d.target.astype(np.int64)
    check_labels(y, num_classes, "digits")
    note, open_iter = sample_source(x, y, "digits", batch_size, steps, seed, False)
    return "digits", note, open_iter


# --- choosing the source -----------------------------------------------------------------------------

BUILTIN_KINDS = ("synthetic", "digits", "mnist", "npz")


def is_user_data(spec) -> bool:
    """A data factory (``FILE.py:factory``, ``package.module:factory`` or a callable), not a built-in
    source (``mnist:DIR`` is a folder even when DIR looks like a name)."""
    from convcheck.plan.user_code import is_user_spec

    if callable(spec):
        return True
    if not isinstance(spec, str) or spec.strip().partition(":")[0] in BUILTIN_KINDS:
        return False
    return is_user_spec(spec)


def data_input_shape(spec) -> tuple[int, int, int] | None:
    """One sample's ``(C, H, W)`` as a built-in data file tells it without loading it: ``npz:PATH`` from
    its ``x``'s header, ``mnist:DIR`` 1x28x28; None for every other source (or where it cannot be told)."""
    if not isinstance(spec, str):
        return None
    kind, sep, arg = spec.strip().partition(":")
    if kind == "mnist" and sep and arg:
        return (1, 28, 28)
    if kind == "npz" and sep and arg:
        from convcheck.plan.data_files import npz_input_shape

        return npz_input_shape(os.path.abspath(os.path.expanduser(arg)))
    return None


def open_data(spec, *, input_shape, num_classes, batch_size: int, steps: int, seed: int, workers: int = 0,
              task: str = "classification", loss=None):
    """The run's ``DataStream``: synthetic (default), mnist:DIR, npz:PATH, digits, or a user factory.
    Its first batch is checked at the edge (``batch.check_batch``): sizes, the model's input shape where
    it is known, and, for the default cross-entropy loss (``loss``) of a classification model, the labels."""
    from convcheck.plan.seeded_data import open_builtin
    from convcheck.plan.stream import DataStream

    if is_user_data(spec):
        source, note, open_iter = user_source(spec, batch_size=batch_size, seed=seed, workers=workers)
        where = f"data factory {source.split(':', 1)[1]!r}"
    elif task != "classification" and (spec is None or str(spec).strip() == "synthetic"):
        from convcheck.plan.synthetic_data import task_source

        source, note, open_iter = task_source(task, input_shape=input_shape, num_classes=num_classes,
                                              batch_size=batch_size, steps=steps, seed=seed)
        where = f"synthetic {task} data"
    elif isinstance(spec, str) and spec.strip() == "digits":
        source, note, open_iter = digits_source(input_shape=input_shape, num_classes=num_classes,
                                                batch_size=batch_size, steps=steps, seed=seed)
        where = "digits"
    else:
        source, note, open_iter = open_builtin(spec, input_shape=input_shape, num_classes=num_classes,
                                               batch_size=batch_size, steps=steps, seed=seed)
        where = source
    from convcheck.targets.runners.base import cross_entropy

    expects = {"input_shape": tuple(input_shape) if input_shape else None, "num_classes": num_classes,
               "class_labels": task == "classification" and loss is cross_entropy}
    return DataStream(source, open_iter, steps=steps, seed=seed, note=note, where=where, expects=expects)
