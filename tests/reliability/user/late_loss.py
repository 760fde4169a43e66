"""A user's loss that works for a while, then raises (issue 26: the error names its file, line and step)."""

import torch.nn.functional as F

CALLS = {"n": 0}


def loss(out, y):
    CALLS["n"] += 1
    if CALLS["n"] > 12:
        raise ValueError("label smoothing table is empty")
    return F.cross_entropy(out, y)


def always(out, y):
    raise KeyError("class_weights")
