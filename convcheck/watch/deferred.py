"""One device-to-host read per step (issue 35): a watched step's statistics kept on the device until it ends.

On an accelerator each read of a statistic (a ``tolist``, a ``float``) drains the device's queue: read at
every layer, that is ~60 waits a step for ResNet-18, ~160 for ResNet-50. Here each leaf's output statistics
(``stats.device_row``), each call's "did NaN/Inf come in / go out" flags, each gradient-into-an-output flag
and every parameter's gradient norm are computed where the tensors live and appended to one buffer; the step's
end reads that buffer once (one transfer per device) and finds from it, as the live hooks do:

- the forward producer: the first call, in the order the modules finished, whose output holds NaN/Inf while
  its inputs did not (a leaf: the module; a module with children: its own code);
- failing that, the backward producer: the first gradient into a leaf's output that is not finite, in the
  order backward made them, named by the layer that consumed that output (``Watch._grad_hook``'s rule).

What a live read gave and this gives otherwise (issue 43): the op inside the producer - ``op_probe.live_op`` needs
the call's inputs, gone by the step's end - is read from the autograd graph the step left (``producers.
forward_op``: node types only) with its line in the module's ``forward``, and the magnitude going into the
producer (``in_max``, the same one pass as the NaN/Inf flag it replaces) is read with the rest. Not given: a
snapshot begun at the first NaN/Inf. The watch therefore reads layer by
layer again from the step after a producer is found (``Watch.defer`` turns off), so the next NaN/Inf -
a GradScaler's skipped step recurs - is resolved to its op and snapshotted; the note says so.
"""

from __future__ import annotations

import math

import torch

from convcheck.watch import stats as _stats



class StepBuffer:
    """What one step's hooks computed on the device, in the order they ran, read back once by ``read``."""

    def __init__(self):
        self.parts: list[torch.Tensor] = []  # 1-D float64 pieces, in order
        self.calls: list[tuple] = []  # (kind, name, the leaf's dtype / the container's leaf call, [piece, ...])
        self.norm_names: list[str] = []
        self.norm_index: int | None = None
        self.sample_keys: tuple = ([], [])  # the sampled gradient entries' names and sizes (``recipe.sample_parts``)
        self.sample_index: int | None = None
        self.sampled: dict | None = None  # their values, once ``resolve`` has read the buffer

    def _put(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        self.parts.append(t.reshape(-1))
        return len(self.parts) - 1

    def leaf(self, name: str, out: torch.Tensor, others: list, inputs: list) -> None:
        """A leaf's call: its first output's statistics, whether its other outputs hold NaN/Inf, and its inputs'
        largest magnitude (NaN/Inf when they hold one: ``in_max``)."""
        self.calls.append(("leaf", name, _stats.dtype_name(out),
                           [self._put(_stats.device_row(out)), self._put(_stats.device_bad(others)),
                            self._put(in_max(inputs))]))

    def container(self, name: str, outs: list, inputs: list, same_as: int | None = None) -> None:
        """A module with children: whether its outputs hold NaN/Inf, its inputs' largest magnitude (``same_as``:
        the index in ``calls`` of the leaf whose output it hands on unchanged, measured already)."""
        out_bad = None if same_as is not None else self._put(_stats.device_bad(outs))
        self.calls.append(("container", name, same_as, [out_bad, self._put(in_max(inputs))]))

    def grad(self, name: str, grad: torch.Tensor, ref=None) -> None:
        """The gradient into ``name``'s output (backward order): whether it holds NaN/Inf (``ref``: a weak
        reference to that output, for ``Watch._consumer``)."""
        self.calls.append(("grad", name, ref, [self._put(_stats.device_bad([grad]))]))

    def norms(self, names: list[str], norms: torch.Tensor) -> None:
        """Every parameter's gradient norm (float64, one device), read with the rest."""
        self.norm_names, self.norm_index = list(names), self._put(norms.double())

    def samples(self, keys: list[str], sizes: list[int], values: torch.Tensor | None) -> None:
        """A few entries of every parameter's gradient (``recipe.sample_parts``), read with the rest."""
        if values is not None:
            self.sample_keys, self.sample_index = (keys, sizes), self._put(values.double())

    def read(self) -> list[list[float]]:
        """Each piece's values: one transfer per device (one in all on a model on one device)."""
        values: list = [None] * len(self.parts)
        by_device: dict = {}
        for i, p in enumerate(self.parts):
            by_device.setdefault(p.device, []).append(i)
        for idx in by_device.values():
            pieces = [self.parts[i] for i in idx]
            flat = torch.cat(pieces).tolist()  # the step's one read
            at = 0
            for i, p in zip(idx, pieces):
                values[i] = flat[at:at + p.numel()]
                at += p.numel()
        self.parts.clear()
        return values


def in_max(ts) -> torch.Tensor | None:
    """The largest ``|value|`` of the tensors ``ts`` as a float64 on their device, NaN or Inf when any holds one:
    one pass, as the NaN/Inf flag it replaces, and the magnitude going into the producer (issue 43)."""
    vals = [t.detach().abs().amax().double() for t in ts if t.numel()]
    if not vals:
        return None
    return torch.stack(vals).amax() if len(vals) > 1 else vals[0]


def resolve(buf: StepBuffer, consumer) -> tuple[dict, dict | None, dict | None]:
    """``(layers, norms, producer)`` of a step from its buffer: the layers' merged rows, the gradient norms
    (None when none were taken), and the first NaN/Inf producer as ``Watch._found``'s arguments
    (``{"layer", "direction", "kind", "detail"}`` and what else it names) or None. ``consumer(name, ref)``:
    what made a non-finite gradient into that output (``Watch._consumer``)."""
    values = buf.read()

    def bad(i):
        return i is not None and values[i][0] > 0

    def bad_in(i):  # ``in_max``: not finite when an input held NaN/Inf
        return i is not None and not math.isfinite(values[i][0])

    def going_in(i) -> dict:
        return {"input_max": values[i][0]} if i is not None else {}

    layers: dict = {}
    forward = backward = None
    calls: dict = {}  # each leaf's calls so far this step: the producer's call index (issue 48)
    outs_bad: list[bool] = []  # per call: its output holds NaN/Inf
    for kind, name, extra, idx in buf.calls:
        out_bad = False
        if kind == "leaf":
            row = _stats.row_of(values[idx[0]], extra)
            layers[name] = _stats.merge(layers.get(name), row)
            calls[name] = calls.get(name, -1) + 1
            out_bad = row["nan"] + row["inf"] > 0 or bad(idx[1])
            if forward is None and out_bad and not bad_in(idx[2]):
                forward = {"layer": name, "direction": "forward", "kind": "module", "detail": None,
                           "call": calls[name], **going_in(idx[2])}
        elif kind == "container":  # ``extra``: the leaf call whose output it hands on, or None
            out_bad = outs_bad[extra] if extra is not None else bad(idx[0])
            if forward is None and out_bad and not bad_in(idx[1]):
                forward = {"layer": name, "direction": "forward", "kind": "own code", "detail": None,
                           **going_in(idx[1])}
        elif backward is None and bad(idx[0]):  # a gradient into a leaf's output (``extra``: its reference)
            backward = {**consumer(name, extra), "direction": "backward", "detail": f"gradient into {name}'s output"}
        outs_bad.append(out_bad)
    if buf.sample_index is not None:
        from convcheck.watch.recipe import samples_of

        buf.sampled = samples_of(*buf.sample_keys, values[buf.sample_index])
    norms = None
    if buf.norm_index is not None:
        norms = dict(zip(buf.norm_names, values[buf.norm_index]))
    return layers, norms, forward or backward
