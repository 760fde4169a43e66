"""Data factories whose batches are wrong in one way each (issue 27: each once ended in exit 4).

The model they feed (``exits.py:good`` / ``conv1``) takes 1x4x4 inputs and gives 3 classes.
"""

import torch
from torch.utils.data import Dataset, TensorDataset


def _x(n=8, c=1):
    return torch.randn(n, c, 4, 4, generator=torch.Generator().manual_seed(0))


def _y(n=8):
    return torch.arange(n) % 3


class _Ragged(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.zeros(1, 4, 4 + i % 2), i % 3


def ragged_samples():
    return _Ragged()


def float_labels():
    return TensorDataset(_x(), _y().float())


class _Strings(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.zeros(1, 4, 4), ["cat", "dog", "bird"][i % 3]


def string_labels():
    return _Strings()


def two_d_labels():
    return TensorDataset(_x(), torch.stack([_y(), _y()], 1))


def labels_out_of_range():
    return TensorDataset(_x(), _y() + 5)


def three_channels():
    return TensorDataset(_x(c=3), _y())


def sizes_differ():
    return [(_x(4), _y(3))] * 8


def bare_tensors():
    return [_x(2)] * 8


def empty_batch():
    return [(_x(0), _y(0))] * 8


class _NegativeLength(Dataset):
    def __len__(self):
        return -1

    def __getitem__(self, i):
        return torch.zeros(1, 4, 4), 0


def negative_length():
    return _NegativeLength()


class _Huge(Dataset):
    def __len__(self):
        return 10**12

    def __getitem__(self, i):
        return torch.zeros(1, 4, 4), int(i % 3)


def huge():
    return _Huge()


def good():
    return TensorDataset(_x(), _y())


class _WorkerDies(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        import os

        if torch.utils.data.get_worker_info() is not None:
            os._exit(1)  # the worker process dies (killed, out of memory, a segfault in an extension)
        return torch.zeros(1, 4, 4), i % 3


def worker_dies():
    return _WorkerDies()
