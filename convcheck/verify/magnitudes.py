"""Which neighbours of a module the ``float32-module`` action keeps in float32 with it: the judge's magnitudes per
layer call (``judge_magnitudes``), the calls until the values are back in the target format's range
(``_until_in_range``) and the producers whose large values the module cancels (``_feeding``)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from convcheck.nested import tensors_in
from convcheck.targets.spec import Target


FEEDING_RATIO = 8.0  # a producer whose values are 8x the layer's result carries what the layer cancels






def judge_magnitudes(build, judge: Target, data, loss) -> list[tuple[str, float, bool]]:
    """One forward of the judge's float64 model on the first batch, no gradients: every module's largest
    output magnitude, in the order the calls finish (containers and the root left out: their output is
    their last child's). ``[]`` when it cannot be measured (the plan's model is run as training runs it)."""
    containers = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
    out: list[tuple[str, float, bool]] = []
    try:
        model = build(judge)
        x, y = data.first()
        handles = []
        for name, module in model.named_modules():
            if not name or isinstance(module, containers):
                continue

            def hook(m, args, output, _name=name):
                values = [t.detach().abs().max().item() for t in tensors_in(output)
                          if t.is_floating_point() and t.numel()]
                out.append((_name, max(values) if values else math.nan, False))
            handles.append(module.register_forward_hook(hook))
        try:
            with torch.no_grad():
                judge.runner.forward_loss(model, x, y, loss)
        finally:
            for h in handles:
                h.remove()
    except Exception:  # noqa: BLE001 - no magnitudes: the named module alone
        return []
    return out


def _inside(name: str, outer: str) -> bool:
    return name == outer or name.startswith(outer + ".")


def _until_in_range(calls, layer: str, largest: float) -> tuple[str, ...]:
    """The modules after ``layer`` that must stay in float32 with it: its output (the judge's magnitude)
    is beyond ``largest``, so every call until one whose output fits again (that one included: its input
    is still beyond), or up to the model's end. Empty when its output fits (an op inside its own code
    overflowed, or nothing is known)."""
    at = next((i for i, c in enumerate(calls) if c[0] == layer), None)
    if at is None or calls[at][2] or not calls[at][1] > largest:
        return ()
    out: list[str] = []
    for name, absmax, _ in calls[at + 1:]:
        if _inside(name, layer) or any(_inside(name, n) for n in out):
            continue
        out.append(name)
        if not absmax > largest:  # its output fits again (NaN: not measured, stop too)
            break
    return tuple(out)


def _upto(after, calls, largest: float) -> str:
    last = after[-1]
    fits = next((c[1] for c in calls if c[0] == last), math.nan)
    return f"until '{last}'" if fits <= largest else "to the model's end"


def _feeding(calls, layer: str) -> tuple[str, ...]:
    """The modules making an ill-conditioned ``layer``'s input, in call order: the call just before it,
    and the ones before that while their values (the judge's) stay ``FEEDING_RATIO`` times above the layer's
    result - they carry the large values (an offset) the layer cancels, which the format cannot hold."""
    at = next((i for i, c in enumerate(calls) if c[0] == layer), None)
    if at is None:
        return ()
    own = calls[at][1]
    out: list[str] = []
    for name, absmax, _ in reversed(calls[:at]):
        if _inside(name, layer) or any(_inside(name, n) or _inside(n, name) for n in out):
            continue
        if out and not (absmax > FEEDING_RATIO * own):
            break
        out.insert(0, name)
    return tuple(out)
