"""Where the first NaN/Inf of a watched run comes from: the recorder's producer hooks (a mixin of ``Watch``).

Forward: the first call whose output holds NaN/Inf while its inputs did not - a leaf is the module, a module
with children its own code - read as each call ends (``sync="layer"``) or from the step's buffer at its end
(``deferred.resolve``, ``sync="step"``). Backward: a hook on each leaf's output (and the model's) sees the
gradient into it; the first that is not finite is named by the layer that consumed that output. The loss's
own op (exp, pow) from its autograd graph when the loss itself is Inf (``loss_op``).
"""

from __future__ import annotations

import math
import weakref

import torch

from convcheck.nested import tensors_in
from convcheck.watch import deferred as _deferred
from convcheck.runformat import statistics as _declared
from convcheck.watch import stacked as _stacked
from convcheck.watch import stats as _stats
from convcheck.watch.layouts import dense, stand_in
from convcheck.watch.snapshots import SnapshotTaker
from convcheck.watch.sourceline import caller_line, op_line


def floats(obj) -> list[torch.Tensor]:
    """The floating tensors of ``obj`` (a call's arguments, a layer's output), in ``nested.tensors_in``'s order; one
    that is not strided memory (a sparse adjacency, a nested tensor) as its values (``layouts.stand_in``), one
    with none to read (a meta tensor) left out."""
    if type(obj) is torch.Tensor:  # the common cases without the walk (a layer's output, its positional arguments)
        found = [obj] if obj.is_floating_point() else []
    elif type(obj) is tuple and all(type(o) is torch.Tensor for o in obj):
        found = [t for t in obj if t.is_floating_point()]
    else:
        found = [t for t in tensors_in(obj) if t.is_floating_point()]
    for t in found:
        if not dense(t):
            return [s for s in (t if dense(t) else stand_in(t) for t in found) if s is not None]
    return found


_OVERFLOWING = {"ExpBackward0": "exp", "Exp2Backward0": "exp2", "Expm1Backward0": "expm1",
                "PowBackward0": "pow", "PowBackward1": "pow", "PowBackward2": "pow"}


_LOSS_OPS = {**_OVERFLOWING, "LogBackward0": "log", "Log2Backward0": "log2", "Log10Backward0": "log10",
             "DivBackward0": "div", "SqrtBackward0": "sqrt", "RsqrtBackward0": "rsqrt"}
_LOSS_TIERS = ({"exp", "exp2", "expm1", "pow"}, {"log", "log2", "log10"}, {"div"}, {"sqrt", "rsqrt"})
_NORMS = {"NormBackward1", "NormBackward0", "LinalgVectorNormBackward0"}
# the patterns whose stable form a remedy names (``rules/numerics._OP_REMEDIES``): said in the producer's detail
_PATTERNS = {"log": "log of a softmax (softmax underflows to 0 at low precision, and log(0) is -inf): "
                    "F.log_softmax, or F.cross_entropy on the logits",
             "div": "division by a norm that reaches 0: add an eps (x / x.norm(...).clamp_min(eps), F.normalize)"}


def _pattern(node) -> str | None:
    """``log`` of a softmax, or ``div`` by a norm: the node and its inputs' types (a few levels down)."""
    kind = type(node).__name__
    inputs = [n for n, _ in node.next_functions if n is not None]
    if kind.startswith("Log") and any(type(n).__name__ in ("SoftmaxBackward0", "SigmoidBackward0") for n in inputs):
        return "log"
    if kind == "DivBackward0" and len(inputs) > 1:
        todo, seen = [node.next_functions[1][0]], 0
        while todo and seen < 8:
            n = todo.pop()
            seen += 1
            if n is None:
                continue
            if type(n).__name__ in _NORMS:
                return "div"
            todo += [m for m, _ in n.next_functions]
    return None


def loss_op(loss, value: float, model_fns, limit: int = 512) -> dict:
    """``{"op": "exp"}``: the op of the loss's own code (its autograd graph from the loss back to the model's
    output, ``model_fns``) that made it Inf/NaN - the one overflowing op (exp, pow), else a log (of 0), a
    division, a root, by ``_LOSS_TIERS``; with ``detail`` when it is a known pattern (log of a softmax,
    division by a norm: ``_PATTERNS``); ``{}`` when the graph says nothing. Reads the graph's node types only
    (its saved tensors are freed by the backward)."""
    if not isinstance(loss, torch.Tensor) or loss.grad_fn is None or math.isfinite(value):
        return {}
    stop, seen, todo, found, patterns = set(model_fns), set(), [loss.grad_fn], set(), set()
    while todo and len(seen) < limit:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ in _LOSS_OPS:
            found.add(_LOSS_OPS[type(node).__name__])
            hit = _pattern(node)
            if hit is not None:
                patterns.add(hit)
        if node not in stop:
            todo += [n for n, _ in node.next_functions]
    if len(seen) >= limit:
        return {}
    for tier in _LOSS_TIERS:
        hit = sorted(found & tier)
        if len(hit) == 1:
            out = {"op": hit[0]}
            if hit[0] in patterns:
                out["detail"] = f"the loss is {value}: {_PATTERNS[hit[0]]}"
            return out
        if hit:
            return {}
    return {}


# the backward nodes that can turn finite gradients into Inf/NaN while their forward stayed finite: each
# divides by one of its inputs, or a power of it (exp's backward only multiplies by its finite result)
BACKWARD_OVERFLOWING = {"DivBackward0": "div", "ReciprocalBackward0": "reciprocal", "RsqrtBackward0": "rsqrt",
                        "SqrtBackward0": "sqrt", "LogBackward0": "log", "Log2Backward0": "log2",
                        "Log10Backward0": "log10", "PowBackward0": "pow", "PowBackward1": "pow",
                        "PowBackward2": "pow", "NormBackward1": "norm", "LinalgVectorNormBackward0": "norm"}


def backward_op(start, stops, limit: int = 512) -> set[str]:
    """The ops that can overflow in a backward (``BACKWARD_OVERFLOWING``) on the autograd graph from ``start``
    (a module's output node) down to ``stops`` (its children's output nodes); empty when the walk finds none or
    runs past ``limit`` nodes. Reads node types only."""
    if start is None:
        return set()
    found, whole = _graph_ops([start], stops, BACKWARD_OVERFLOWING, limit)
    return found if whole else set()


def _graph_ops(todo: list, stops, names: dict[str, str], limit: int) -> tuple[set[str], bool]:
    """``(the names, by ``names``, of the node types on the autograd graph from ``todo`` down to ``stops``,
    whether the walk ended within ``limit`` nodes)``. Reads node types only."""
    seen, found = set(), set()
    while todo and len(seen) < limit:
        node = todo.pop()
        if node is None or node in seen or node in stops:
            continue
        seen.add(node)
        if type(node).__name__ in names:
            found.add(names[type(node).__name__])
        todo += [n for n, _ in node.next_functions]
    return found, len(seen) < limit


# the forward ops that turn finite values into Inf/NaN, by how often they do: exp/pow overflow first, then a
# matmul's sum, then a division, log or root, then a plain sum or product (node types of the autograd graph)
FORWARD_OPS = {"ExpBackward0": "exp", "Exp2Backward0": "exp", "PowBackward0": "pow", "PowBackward1": "pow",
               "PowBackward2": "pow", "MmBackward0": "matmul", "BmmBackward0": "matmul", "AddmmBackward0": "matmul",
               "BaddbmmBackward0": "matmul", "AddbmmBackward0": "matmul", "DivBackward0": "div",
               "ReciprocalBackward0": "reciprocal", "LogBackward0": "log", "SqrtBackward0": "sqrt",
               "RsqrtBackward0": "rsqrt", "SumBackward0": "sum", "SumBackward1": "sum", "MulBackward0": "mul",
               "SoftmaxBackward0": "softmax", "ConvolutionBackward0": "convolution"}
_TIERS = ({"exp", "pow"}, {"matmul", "convolution"}, {"div", "reciprocal", "log", "sqrt", "rsqrt"},
          {"sum", "mul", "softmax"})


def forward_op(start, stops, limit: int = 512) -> str | None:
    """The op that most likely made a forward's first NaN/Inf, read from the autograd graph the step left (node
    types only, no re-run: ``sync="step"`` has no inputs left to re-run): the ops of ``FORWARD_OPS`` between
    ``start`` (the producer's output node; a child's node it hands on is stepped through) and ``stops`` (its
    children's output nodes), the first tier of ``_TIERS`` that holds any; several there: all named."""
    if start is None:
        return None
    found, _ = _graph_ops([n for n, _ in start.next_functions] if start in stops else [start], stops, FORWARD_OPS,
                          limit)
    for tier in _TIERS:
        hit = sorted(found & tier)
        if hit:
            return " or ".join(hit)
    return None


def closure(args, kwargs) -> bool:
    """``optimizer.step(closure)`` with a closure: the step's forward and backward run inside the call. ``args`` as
    torch's step hooks give them: the optimizer first, then what ``step`` was called with."""
    if args and isinstance(args[0], torch.optim.Optimizer):
        args = args[1:]
    return (args[0] if args else kwargs.get("closure")) is not None


def nonfinite(ts) -> bool:
    return any(not _stats.finite(t) for t in ts)


_WIDE = (torch.float32, torch.float64)


def wide_finite(g: torch.Tensor) -> bool:
    """True when ``g`` is a float32/float64 gradient whose sum is finite (so are its values); False otherwise
    (another dtype, a finite sum not read: ``stats.finite`` decides) - one op and one read, the gradient hooks'
    common case."""
    return g.dtype in _WIDE and not g.requires_grad and math.isfinite(g.sum().item())
STACKED = object()  # ``Watch._measure_leaf``: the call is stacked, measured at the next flush (``stacked.py``)



class ProducerHooks:
    """The producer half of ``Watch``: it reads ``self.producer``, ``self.buffer``, ``self.order``,
    ``self.last_leaf``, ``self.leaves``, ``self.model``, ``self.roots`` (the models called), ``self.taker``,
    ``self.each_grad``, ``self.grads_together`` and the snapshot settings."""

    def _note_call(self, module, name, args, outs, leaf: bool, inputs=None) -> None:
        """Who consumes what, for the backward producer: this call's floating inputs (by identity; ``inputs``: them,
        found already), its output's autograd node (a module's own code lies between its output node and its
        children's), and a leaf's calling line the first time it runs."""
        for t in floats(args) if inputs is None else inputs:
            if id(t) not in self.consumed or not leaf or not self.consumed[id(t)][2]:
                self.consumed[id(t)] = (name, weakref.ref(t), leaf)
        if outs and outs[0].grad_fn is not None:
            (self.leaf_nodes.add(outs[0].grad_fn) if leaf and module not in self.roots
             else self.out_nodes.__setitem__(name, outs[0].grad_fn))
            if leaf and self.buffer is not None:  # a deferred step's producer is named from its node (``forward_op``)
                self.__dict__.setdefault("leaf_out", {})[name] = outs[0].grad_fn
        if leaf and name not in self.call_lines:
            self.call_lines[name] = caller_line()

    def _consumer(self, name: str, ref) -> dict:
        """What made the first non-finite gradient into ``name``'s output (``ref``: a weak reference to it): the
        loss (it is the model's output), the leaf that took it as its input (its backward), or else the own
        code of the module that did (or of ``name``'s parent), with the one op there whose backward can
        overflow (``backward_op``) and its line."""
        t = ref() if ref is not None else None
        if t is not None and self.model_out is not None and self.model_out() is t:
            return {"layer": "the loss", "kind": "own code"}
        hit = self.consumed.get(id(t)) if t is not None else None
        owner = None
        if hit is not None and hit[1]() is t:
            if hit[2]:
                return {"layer": hit[0], "kind": "module", "source": self.call_lines.get(hit[0])}
            owner = hit[0]
        if owner is None:
            owner = name.rpartition(".")[0] or self.names[self.model]
        ops = backward_op(self.out_nodes.get(owner), self.leaf_nodes)
        if not ops:  # own code with nothing that overflows in a backward (a ReLU, a reshape) handed it on:
            return self._next_leaf(name)  # the layer that ran after ``name`` made it, its input gradient unhooked
        # one op: it and its line; several (x / (sqrt(...) + eps)): all of them, and the forward's line
        names = sorted(ops)
        op = names[0] if len(names) == 1 else None
        found = {"layer": owner, "kind": "own code", "op": op or " or ".join(names)}
        module = self.by_name.get(owner)
        src = op_line(module, op) if module is not None else None
        if src is not None:
            found["source"] = src
        return found

    def _next_leaf(self, name: str) -> dict:
        order = list(self.order)
        after = order.index(name) + 1 if name in self.order else len(order)
        if after >= len(order):
            return {"layer": "the loss", "kind": "own code"}
        return {"layer": order[after], "kind": "module", "source": self.call_lines.get(order[after])}

    def _check_producer(self, module, name, args, outs, row, leaf: bool) -> None:
        """The first NaN/Inf made by this call (its inputs finite), or a gradient hook on its output."""
        if self.producer is None:
            self._note_call(module, name, args, outs, leaf, self.stacked.calls[-1].inputs if row is STACKED and self.stacked.calls else None)
        if self.producer is None and self.buffer is not None:  # read at the step's end (``deferred.resolve``)
            if not leaf and outs:
                same = self.last_leaf is not None and outs[0] is self.last_leaf[0] and len(outs) == 1
                self.buffer.container(name, outs, floats(args), same_as=self.last_leaf[1] if same else None)
            if outs and outs[0].requires_grad and (leaf or module in self.roots):
                self._hook_grad(name, outs[0])
            return
        if row is STACKED:  # measured at the next flush, its producer check with it (``_flush_stacked``)
            self.last_leaf = (outs[0], None)
            if self.producer is None and outs[0].requires_grad:
                if self.each_grad:
                    self._hook_grad(name, outs[0])
                else:  # checked with the layer's first call (which backward reaches after it) and the parameters
                    self.grads_together[name] = self.grads_together.get(name, 0) + 1
            return
        if self.producer is None:
            if row is not None:
                bad = row["nan"] + row["inf"] > 0 or nonfinite(outs[1:])
                self.last_leaf = (outs[0], bool(bad))
            elif outs and self.last_leaf is not None and outs[0] is self.last_leaf[0] and len(outs) == 1 \
                    and self.last_leaf[1] is not None:
                bad = self.last_leaf[1]  # a container handing on its last leaf's output: already measured
            else:
                bad = nonfinite(outs)
            if bad and self.stacked.calls:  # a stacked call before this one may have made it: measured first
                self._flush_stacked()
                if self.producer is not None:
                    return
            if outs and bad and not nonfinite(floats(args)):
                self._found(name, "forward", "module" if module in self.leaves else "own code")
                if row is not None:  # which call of the step (a cell unrolled over time: its time index)
                    self.producer["call"] = self.layers[name]["calls"] - 1
                if module in self.leaves and self.call_lines.get(name):
                    self.producer["source"] = self.call_lines[name]  # the line of the forward that called it
                from convcheck.watch.op_probe import live_op  # once a run, at its first NaN/Inf

                self.producer.update(live_op(module, args))  # the op that made them (and its line in own code)
            elif outs and outs[0].requires_grad and (leaf or module in self.roots):
                # leaves and the model's output only: cheaper
                self._hook_grad(name, outs[0])

    def _flush_stacked(self, live: bool = True) -> None:
        """The stacked calls measured (``stacked.rows``) and merged into their layers' rows in the order they ran;
        the first whose output holds NaN/Inf while its inputs did not is the forward producer, as a call measured
        at once would have been. ``live``: the flush runs inside the forward (the module's parameters as the call
        saw them), so the op that made it is found by re-running the call (``op_probe.live_op``); at the step's
        end it is not (the parameters may have moved)."""
        calls = self.stacked.take()
        self.stacked_names.clear()
        if not calls:
            return
        changed = {c.name for c in calls if not c.exact()}  # held as they were, then changed in place
        for name in sorted(changed):
            self.notes.append(f"the output of {name} was changed in place after its call at step {self.step_index} "
                              "(an in-place op on it): that step's statistics of its repeated calls read the changed "
                              "values; from then on each call's output is copied as it returns")
        self.stacked.learn(calls)
        with torch.no_grad():  # outputs held as they are: stacking them records nothing for autograd
            rows = _stacked.rows([c.out for c in calls], [c.name for c in calls])
        others = [t for c in calls for t in c.others]
        any_bad_other = bool(others) and not _stacked.all_finite(others)
        first = None
        if not any_bad_other and not any(r["nan"] + r["inf"] for r in rows) and not _declared.extensions():
            by_layer: dict = {}  # all finite: each layer's calls merged at once (``stacked.merged``)
            for c, row in zip(calls, rows):
                by_layer.setdefault(c.name, []).append(row)
            for name, got in by_layer.items():
                self.layers[name] = _stats.merge(self.layers.get(name), _stacked.merged(got))
            return
        for c, row in zip(calls, rows):
            before = self.layers.get(c.name)
            self.layers[c.name] = _stats.merge(before, row)
            if first is None and self.producer is None and c.name not in changed and (
                    row["nan"] + row["inf"] > 0 or any_bad_other and nonfinite(c.others)):
                first = (c, before["calls"] if before is not None else 0)
        if first is None:
            return
        c, call = first
        if nonfinite(c.inputs):  # NaN/Inf came in: made before it (found by a container's or the loss's check)
            return
        module = self.by_name.get(c.name)
        self._found(c.name, "forward", "module")
        self.producer["call"] = call
        if self.call_lines.get(c.name):
            self.producer["source"] = self.call_lines[c.name]
        if any(t._version != v for t, v in zip(c.inputs, c.versions)):
            self.producer["detail"] = "its inputs were changed in place after the call (read at the forward's end)"
        elif live and module is not None:
            from convcheck.watch.op_probe import live_op  # once a run, at its first NaN/Inf

            self.producer.update(live_op(module, c.args))

    def _hook_grad(self, name: str, out: torch.Tensor) -> None:
        """The gradient into ``out`` seen by ``_grad_hook``: a pre-hook on the autograd node that made it (given that
        node's output gradients; ``out``'s by its ``output_nr``), a third of a tensor hook's registration cost (2
        against 7 us a call inside a step: paid at every call of a cell unrolled over time). Like a tensor hook
        registered at the call, it sees the gradient of the value the call returned even when ``out`` is later
        changed in place (an in-place ReLU after it); a user's own tensor hooks on ``out`` run before it. A
        tensor without a node (a leaf returned as it is) takes a tensor hook."""
        hook = self._grad_hook(name, weakref.ref(out))
        node = out.grad_fn
        if node is None:
            out.register_hook(hook)
            return
        nr = out.output_nr

        def pre(grads):
            g = grads[nr] if nr < len(grads) else None
            if g is None or self.producer is not None or self.failed is not None:
                return None
            try:  # the common case without more frames: a float32/float64 gradient whose values are all finite
                if self.buffer is None and wide_finite(g):
                    return None
            except Exception as error:  # noqa: BLE001 - the watch's own: recording stops, the backward goes on
                self.fail(error, f"the gradient hook on {name}'s output")
                return None
            return hook(g)
        node.register_prehook(pre)

    def _grad_hook(self, name: str, ref):
        def hook(grad):
            if self.failed is not None:
                return None
            try:
                self._grad_into(name, ref, grad)
            except Exception as error:  # noqa: BLE001 - the watch's own: recording stops, the backward goes on
                self.fail(error, f"the gradient hook on {name}'s output")
            return None
        return hook

    def _grad_into(self, name: str, ref, grad) -> None:
        if self.buffer is not None and self.producer is None:
            self.buffer.grad(name, grad, ref)
        elif self.producer is None and not _stats.finite(grad):
            found = self._consumer(name, ref)
            self._found(found.pop("layer"), "backward", found.pop("kind"),
                        detail=f"gradient into {name}'s output" + self._together_said())
            self.producer.update(found)
            if self.grads_together:
                self.producer["calls_unchecked"] = dict(self.grads_together)

    def _together_said(self) -> str:
        """What a backward producer found at this step cannot say: the repeated calls whose gradients got no hook of
        their own (``repeated_grads="together"``), where the first non-finite gradient may have come in."""
        if not self.grads_together:
            return ""
        n, names = sum(self.grads_together.values()), sorted(self.grads_together)
        names = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return (f"; {n} later calls of {names} at this step were not checked one by one (it may have come in at one "
                "of them; repeated_grads=\"each\" checks each)")

    def _found(self, layer: str, direction: str, kind: str, detail: str | None = None, ended: bool = False) -> None:
        self.producer = {"layer": layer, "step": self.step_index, "direction": direction, "kind": kind,
                         "detail": detail}
        if self.snapshot_nonfinite and self.taker is None and not ended:
            self.taker = SnapshotTaker(self.names, partial=f"started at the first non-finite {direction} value",
                                       budget=self._budget())
            self.snapshot_steps.add(self.step_index)

    def _scaler_skip(self) -> None:
        """A GradScaler skipped this step: the Inf/NaN in its scaled gradients is how it finds its scale (it
        skips and lowers it), not the run's first non-finite value; a backward producer found at this step is
        let go, with the partial snapshot begun for it. Counted for a note."""
        p = self.producer
        if self.scaler is None or self.stepped or p is None or p["step"] != self.step_index \
                or p["direction"] != "backward":
            return
        self.producer = None
        if self.taker is not None and self.taker.partial:
            self.taker.drop()
            self.taker = None
            self.snapshot_steps.discard(self.step_index)
        self.scaled_infs = self.scaled_infs + 1

    def producer_notes(self) -> list[str]:
        n = self.scaled_infs
        return [f"the scaled gradients held Inf/NaN at {n} steps the GradScaler skipped (how it lowers its scale): "
                "not taken as the run's first non-finite value"] if n else []

    def _resolve(self) -> None:
        """The step's one read of its device-side statistics (``deferred.py``): rows, norms, the producer."""
        buf = self.buffer
        if buf is None or not buf.calls and not buf.parts:
            return
        layers, norms, found = _deferred.resolve(buf, self._consumer)
        self.buffer = _deferred.StepBuffer()
        for n, row in layers.items():
            self.layers[n] = _stats.merge(self.layers.get(n), row)
        if norms is not None:
            self.grad_norms = norms
        if buf.sampled is not None:
            self.grad_sample = buf.sampled
        skipped = self.scaler is not None and not self.stepped and found is not None and found["direction"] == "backward"
        self.scaled_infs = self.scaled_infs + (skipped and self.producer is None)
        if found is not None and self.producer is None and not skipped:
            if found["direction"] == "forward":
                found.update(self._deferred_op(found))
            extra = {k: v for k, v in found.items() if k not in ("layer", "direction", "kind", "detail")}
            self._found(found["layer"], found["direction"], found["kind"], found["detail"], ended=True)
            self.producer.update(extra)
            self.defer = False
            named = "its op read from the autograd graph the step left" if found.get("op") else \
                "its op was not resolved"
            self.notes.append(f"the first non-finite value was found at the end of step {self.step_index}, where the "
                              f"watch reads its statistics once a step on {self.device}: {named} and no "
                              "snapshot was begun; from the next step each layer is read as it runs")

    def _deferred_op(self, found: dict) -> dict:
        """A forward producer found at a deferred step's end: its op (``forward_op``), the line that wrote it, and
        the largest magnitude that went into it (``deferred.in_max``), in the producer's words."""
        name, out = found["layer"], {}
        module = self.by_name.get(name)
        if found["kind"] == "own code":
            op = forward_op(self.out_nodes.get(name), self.leaf_nodes)
            src = op_line(module, op, first=True) if op and " or " not in op and module is not None else None
        else:
            node = getattr(self, "leaf_out", {}).get(name)
            op = FORWARD_OPS.get(type(node).__name__) if node is not None else None
            src = self.call_lines.get(name)
        if op:
            out["op"] = op
        if src is not None:
            out["source"] = src
        m = found.pop("input_max", None)
        if m is not None and math.isfinite(m):
            out["detail"] = (f"its inputs reach {m:.4g} (the largest |value| going in; read once at the step's end, "
                             "sync=\"step\")")
        return out

