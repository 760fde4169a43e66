"""convcheck.nested: the one walk over nested tensors (batches, call arguments, outputs)."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import torch

from convcheck.nested import first_tensor, map_tensors, tensors_in

Pair = namedtuple("Pair", "x y")


@dataclass
class Held:
    t: torch.Tensor


def test_walks_tuples_named_tuples_lists_and_dicts_depth_first():
    a, b, c, d = (torch.tensor([float(i)]) for i in range(4))
    obj = (a, [Pair(b, 3), {"k": c}], "text", None, 1.5, d)
    assert [t.item() for t in tensors_in(obj)] == [0.0, 1.0, 2.0, 3.0]


def test_every_dtype_counts_and_a_dataclass_holds_none():
    i, f, flag = torch.tensor([1]), torch.tensor([1.0]), torch.tensor([True])
    assert tensors_in([i, f, flag, Held(f)]) == [i, f, flag]


def test_a_dicts_values_in_its_order_or_by_its_keys():
    one, two = torch.tensor([1.0]), torch.tensor([2.0])
    d = {"z": one, "a": two}
    assert tensors_in(d) == [one, two]
    assert tensors_in(d, sort_keys=True) == [two, one]
    assert tensors_in([{"z": one, "a": two}], sort_keys=True) == [two, one]  # nested dicts too
    assert tensors_in({2: one, 10: two}, sort_keys=True) == [two, one]  # keys ordered as strings: "10" < "2"


def test_first_tensor():
    t = torch.zeros(2)
    assert first_tensor({"out": (t, torch.ones(1))}) is t
    assert first_tensor((1, "x")) is None


def test_map_tensors_keeps_the_containers():
    x = {"a": (torch.ones(1), [torch.ones(2)]), "n": 3}
    out = map_tensors(x, lambda t: t * 2)
    assert set(out) == {"a", "n"} and out["n"] == 3
    assert isinstance(out["a"], tuple) and isinstance(out["a"][1], list)
    assert out["a"][0].item() == 2.0 and out["a"][1][0].tolist() == [2.0, 2.0]
    assert type(map_tensors(Pair(torch.ones(1), 1), lambda t: t)) is tuple  # a named tuple comes back plain
