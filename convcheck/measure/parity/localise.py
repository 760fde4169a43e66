"""Where a target differs from itself (issue 36): two runs from the same state, compared bitwise layer by layer.

``self_difference`` says a target's logits or gradients changed between two identical runs; this says where
that began. Both runs build the target's model afresh (the same initial weights), share the dropout masks and
seeds, and record every leaf call in order (its inputs and output) and every gradient into a leaf's output and
of each parameter. Then, in the order the work ran:

- forward: the first leaf call whose output differs while its inputs are equal is that layer's own forward
  (its op named by re-running the layer twice on the recorded input under a dispatch mode: the first op whose
  output differs with equal inputs - a kernel that sums in another order each call); a call whose inputs
  already differ was fed by the code between the layers (the parent's own code);
- backward, when the forward agrees: the first leaf (in the order backward reached them) whose parameter
  gradients or the gradient into its input differ while the gradient into its output is equal.

Nothing here changes the caller's models or random state beyond what ``self_difference`` already does.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from convcheck.capture import SharedDropoutMasks
from convcheck.nested import tensors_in
from convcheck.seeding import seed_all


def _leaves(model: nn.Module) -> dict:
    return {m: n for n, m in model.named_modules() if not any(True for _ in m.children())}


def _same(a, b) -> bool:
    if len(a) != len(b):
        return False
    return all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


class _Record:
    """One run: each leaf call's (name, inputs, output) in order, the gradients into leaf outputs in the order
    backward made them, and each parameter's gradient."""

    def __init__(self, model: nn.Module):
        self.model, self.names = model, _leaves(model)
        self.calls: list[tuple[str, list, list]] = []
        self.grads: list[tuple[str, torch.Tensor]] = []
        self.handles = [m.register_forward_hook(self._hook) for m in self.names]

    def _hook(self, module, args, output):
        name = self.names[module]
        ins = [t.detach().clone() for t in tensors_in(args, sort_keys=True) if t.is_floating_point()]
        outs = [t for t in tensors_in(output, sort_keys=True) if t.is_floating_point()]
        self.calls.append((name, ins, [t.detach().clone() for t in outs]))
        if outs and outs[0].requires_grad:
            outs[0].register_hook(lambda g, name=name: self.grads.append((name, g.detach().clone())) or None)

    def close(self) -> dict[str, torch.Tensor]:
        for h in self.handles:
            h.remove()
        return {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}


def _run(build, target, batch, seed: int, loss_fn) -> tuple[_Record, dict, nn.Module]:
    runner = target.runner
    x, y = batch
    seed_all(seed)
    model = build(target)
    rec = _Record(model)
    try:
        with runner.applied():
            with SharedDropoutMasks(model, seed):
                _, loss = runner.forward_loss(model, x, y, loss_fn)
            runner.backward(loss, runner.parity_loss_scale)
    finally:
        params = rec.close()
    return rec, params, model


class _OpOutputs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, list, list]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t.detach().clone() for t in tensors_in(list(args) + list((kwargs or {}).values()), sort_keys=True)]
        self.ops.append((str(func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else func),
                         ins, [t.detach().clone() for t in tensors_in(out, sort_keys=True)]))
        return out


def _op_in(module: nn.Module, inputs: list) -> str | None:
    """The first op of ``module``'s forward whose output differs between two runs on ``inputs`` while its
    inputs are equal (None when the two runs agree, or the module does not re-run on them)."""
    runs = []
    for _ in range(2):
        mode = _OpOutputs()
        try:
            with torch.no_grad(), mode:
                module(*inputs)
        except Exception:  # noqa: BLE001 - keyword arguments, a module that needs more than its tensors
            return None
        runs.append(mode.ops)
    for (name, ia, oa), (_, ib, ob) in zip(*runs):
        if _same(ia, ib) and not _same(oa, ob):
            return name
    return None


def first_difference(build, target, batch, seed: int, loss_fn) -> dict | None:
    """``{"layer", "direction", "kind", "op"?}`` where two runs of ``target`` from the same state first differ
    bitwise; None when they agree everywhere the leaves show (the difference is not chance)."""
    a, pa, model_a = _run(build, target, batch, seed, loss_fn)
    b, pb, _ = _run(build, target, batch, seed, loss_fn)
    for (name, ia, oa), (_, ib, ob) in zip(a.calls, b.calls):
        if _same(oa, ob):
            continue
        if not _same(ia, ib):
            return {"layer": name, "direction": "forward", "kind": "own code",
                    "detail": f"the input of '{name}' differs: the code that runs before it"}
        found = {"layer": name, "direction": "forward", "kind": "module"}
        module = dict(model_a.named_modules()).get(name)
        op = _op_in(module, ia) if module is not None else None
        if op is not None:
            found["op"] = op
        return found
    into = {}
    for (name, ga), (_, gb) in zip(a.grads, b.grads):  # backward order
        into[name] = torch.equal(ga, gb)
    for name, _, _ in reversed(a.calls):
        mine = [n for n in pa if n.rpartition(".")[0] == name or n == name]
        if into.get(name, True) and any(not torch.equal(pa[n], pb[n]) for n in mine if n in pb):
            return {"layer": name, "direction": "backward", "kind": "module"}
    for (name, ga), (_, gb) in zip(a.grads, b.grads):
        if not torch.equal(ga, gb):
            return {"layer": name, "direction": "backward", "kind": "module",
                    "detail": f"the gradient into '{name}''s output: the backward of what consumed it"}
    return None


def location_text(at: dict) -> str:
    """``layer 'agg' (forward, op shuffled_index_add)``."""
    op = f", op {at['op']}" if at.get("op") else ""
    kind = "own code, " if at.get("kind") == "own code" else ""
    text = f"layer '{at['layer']}' ({kind}{at['direction']}{op})"
    return text + (f": {at['detail']}" if at.get("detail") else "")
