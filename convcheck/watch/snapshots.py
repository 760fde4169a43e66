"""A snapshot step: every leaf layer's floating inputs and outputs, the parameters (as the step's
forward saw them) and their gradients (before the optimizer used them), held until the step ends and
then written as one ``snapshots/step_NNNNN.npz``. Copies are taken on the CPU; nothing is changed.

Cost (issue 25: a snapshot step <= 3x a bare step, memory bounded by the snapshot): a tensor seen
twice at the same version (a layer's output is the next layer's input; an in-place ReLU's input is its
output) is copied and written once, the other keys naming it (``same_as`` in the index); each array is
copied once (to float32 for half types, else a plain copy) and written from its own memory into the
archive. The taker holds at most ``budget`` bytes: past it, it drops what it holds and only counts, so
the step is skipped with its size (``over``), never half-written and never held whole in memory.

Off the training thread (issue 45: a snapshot step <= 1.5x a bare step): ``file`` hands the step's arrays and
its index entry to a ``SnapshotFile`` that the watch writes in the background (``snapshot_file.py``), hashed as
it is written; a call's ``worst`` measure is the max|x| its statistics measured already when they did
(``_largest``), and the parameters are hashed only when a second evaluation needs their SHA-256."""

from __future__ import annotations

import hashlib
import math
import weakref
from pathlib import Path

import numpy as np
import torch
from torch.nn.utils.rnn import PackedSequence

from convcheck.watch import stats as _stats
from convcheck.watch.keep import CallKeeper
from convcheck.watch.layouts import dense, kind, stand_in, stands_for
from convcheck.watch.snapshot_file import write_npz

STORED = {torch.float64: torch.float64, torch.float32: torch.float32, torch.bfloat16: torch.float32,
          torch.float16: torch.float32}
# a layer's non-floating tensor arguments (position ids, indices, masks), stored as they are (issue 43)
EXACT = {torch.int64: "int64", torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8",
         torch.bool: "bool"}
MAX_NOT_STORED = 50  # the "not stored" reasons one snapshot entry lists
MAX_SPEC_DEPTH = 8  # nesting of a call's recorded arguments (``arg_spec``)
MEMBER_SLACK = 512  # an .npz member's zip headers and .npy header: a bound, so the cap is never passed
FILE_SLACK = 4096


def _copy(t: torch.Tensor) -> tuple[np.ndarray, str] | None:
    if t.dtype not in STORED:
        return None
    src = t.detach()
    # torch's copy, not numpy's: a large array from numpy's allocator pays a page fault a page (a ResNet-18
    # snapshot step: +0.7 s against +0.2 s a run, /tmp script on the 2-core VM)
    if src.device.type == "cpu" and STORED[t.dtype] == t.dtype:  # the common case: one dispatch (a cell's call
        return src.clone(memory_format=torch.contiguous_format).numpy(), str(t.dtype)[6:]  # pays it 64 times)
    c = src.to("cpu", dtype=STORED[t.dtype]).contiguous()
    if c.data_ptr() == src.data_ptr():  # the same memory: the value may still change, so copy it once
        c = c.clone()
    return c.numpy(), str(t.dtype)[6:]


def _identity(t: torch.Tensor) -> tuple:
    """Which tensor memory and which state of it: the same key means the same values."""
    return (t.device.type, t.data_ptr(), t._version, t.dtype, tuple(t.shape), tuple(t.stride()))


def _stored_bytes(t: torch.Tensor) -> int:
    """What ``t`` takes in a snapshot: float64 as it is, the other floating dtypes as float32, the rest as they are."""
    if t.dtype in STORED:
        return t.numel() * (8 if STORED[t.dtype] == torch.float64 else 4)
    return t.numel() * t.element_size()


def _largest(outputs, measured: dict | None = None) -> float:
    """The largest max|x| of a call's floating outputs (Inf when one holds a NaN or Inf): its ``worst`` measure.
    ``measured``: the statistics (``stats.measure``) of ``outputs[0]``, when the watch measured them as the call
    ran - a call with that one output is not read again (the same ``aminmax``)."""
    stored = [t for t in outputs if t.dtype in STORED and t.numel()]
    if isinstance(measured, dict) and len(outputs) == 1 and len(stored) == 1:
        return math.inf if measured["nan"] or measured["inf"] else float(measured["max_abs"])
    if all(t.device.type == "cpu" for t in stored):  # a repeated call's, stacked: ``stats.largest``
        return max((_stats.largest(t) for t in stored), default=0.0)
    got = [torch.aminmax(t.detach()) for t in stored]
    if not got:
        return 0.0
    ends = torch.stack([torch.stack([lo.abs(), hi.abs()]).to(torch.float64) for lo, hi in got]).cpu()
    return math.inf if bool(torch.isnan(ends).any()) else float(ends.max())


def _sha(a: np.ndarray | None) -> str:
    return hashlib.sha256(memoryview(np.ascontiguousarray(a)).cast("B")).hexdigest() if a is not None else ""


def file_bound(nbytes: int, members: int) -> int:
    """The most an ``.npz`` of ``members`` arrays holding ``nbytes`` in all can take on disk."""
    return nbytes + MEMBER_SLACK * members + FILE_SLACK


class SnapshotFile:
    """One step's arrays ready to be written (``snapshot_file.write_npz``) and its index entry, whose ``bytes`` and
    ``sha256`` (``diff`` checks it: a changed snapshot is refused, never diagnosed) ``write`` fills in. The taker
    has let go of the arrays: they are held here until written."""

    def __init__(self, path: Path, members: list[tuple[str, np.ndarray]], entry: dict):
        self.path, self.members, self.entry = path, members, entry

    def write(self) -> dict:
        self.entry["bytes"], self.entry["sha256"] = write_npz(self.path, self.members)
        self.members = []  # freed once written
        return self.entry


class SnapshotTaker:
    """Collects one step's arrays within ``budget`` bytes (issue 48: which calls are kept is ``keep.py``'s);
    ``write`` saves them and returns the index entry."""

    def __init__(self, names: dict, partial: str | None = None, budget: int | None = None):
        self.arrays: dict[str, tuple[np.ndarray, str]] = {}
        self.same_as: dict[str, str] = {}
        self.seen: dict[tuple, tuple] = {}  # identity -> (first key, a weak reference to the tensor:
        # once it is gone, its memory may hold another tensor with the same identity, so no match)
        self.ident_of: dict[str, tuple] = {}  # a stored key -> the identity ``seen`` knows it by
        self.aliases: dict[str, list[str]] = {}  # a stored key -> the keys naming it (``same_as``)
        self.calls: dict[str, int] = {}
        self.call_keys: dict[tuple[str, int], list[str]] = {}  # a kept call -> its keys
        self.keeper = CallKeeper()
        self.specs: dict[str, dict] = {}  # "layer/k" -> the call's arguments as made (``arg_spec``)
        self.versions: dict[int, int] = {}  # each parameter's version in the current evaluation
        self.base: dict[int, int] = {}  # each parameter's version at the step's first forward
        self.hashes: dict[str, str] = {}  # each parameter's SHA-256 in the current evaluation
        self.first: dict[str, np.ndarray] = {}  # the first forward's parameters, hashed when a second evaluation comes
        self.evaluations: list[dict] = []  # the parameters each forward of the step ran with (``take_params``)
        self.stale: list[str] = []  # "layer/k": calls made after their parameters changed within an evaluation
        # "key: why" for each array not kept as the tensor it was (a sparse adjacency's values: ``layouts.py``)
        self.not_stored: list[str] = []
        self.params = False
        self.grads = False
        self.partial = partial
        self.budget = budget
        self.held = 0  # bytes of the arrays held
        self.reserve = (0, 0)  # bytes and arrays held back for the gradients
        self.over: int | None = None  # past the budget with the parameters alone: what they would have taken

    # --- the budget ---------------------------------------------------------------------------------
    def _fits(self, nbytes: int, members: int) -> bool:
        return self.budget is None or file_bound(self.held + self.reserve[0] + nbytes,
                                                 len(self.arrays) + self.reserve[1] + members) <= self.budget

    def _room(self, nbytes: int, members: int) -> bool:
        """Room for ``nbytes`` in ``members`` more arrays, made by letting go of calls without a role (newest
        first); False when it cannot be made."""
        while not self._fits(nbytes, members):
            victim = self.keeper.victim()
            if victim is None:
                return False
            self._let_go(victim)
        return True

    def _cost(self, tensors) -> tuple[int, int]:
        """The bytes and arrays ``tensors`` would add (a tensor held already, or twice among them, counts once)."""
        nbytes, members, idents = 0, 0, set()
        for t in tensors:
            if t.dtype not in STORED and t.dtype not in EXACT:
                continue
            if t.dtype in STORED:
                ident = _identity(t)
                first = self.seen.get(ident)
                if ident in idents or first is not None and first[1]() is not None:
                    continue
                idents.add(ident)
            nbytes += _stored_bytes(t)
            members += 1
        return nbytes, members

    def _let_go(self, call: tuple[str, int]) -> None:
        self.keeper.let_go(call)
        for key in self.call_keys.pop(call, []):
            self._forget(key)
        name = f"{call[0]}/{call[1]}"
        self.specs.pop(name, None)
        if name in self.stale:
            self.stale.remove(name)

    def _forget(self, key: str) -> None:
        """``key`` let go: an alias is dropped; a stored array passes to a key still naming it, else is freed."""
        first = self.same_as.pop(key, None)
        if first is not None:
            self.aliases[first].remove(key)
            return
        if key not in self.arrays:
            return
        names, ident = self.aliases.pop(key, []), self.ident_of.pop(key, None)
        seen = self.seen.get(ident) if ident is not None else None
        if names:
            heir = names[0]
            self.arrays[heir] = self.arrays.pop(key)
            del self.same_as[heir]
            for n in names[1:]:
                self.same_as[n] = heir
            self.aliases[heir] = names[1:]
            if ident is not None:
                self.ident_of[heir] = ident
                if seen is not None and seen[0] == key:
                    self.seen[ident] = (heir, seen[1])
            return
        self.held -= self.arrays.pop(key)[0].nbytes
        if seen is not None and seen[0] == key:
            del self.seen[ident]

    # --- what is taken ------------------------------------------------------------------------------
    def _put(self, key: str, t: torch.Tensor) -> np.ndarray | None:
        """``t`` under ``key`` (room made by the caller): copied, or named as the same tensor held already."""
        if t.dtype not in STORED:
            return None
        ident = _identity(t)
        first = self.seen.get(ident)
        if first is not None and first[1]() is not None:
            self.same_as[key] = first[0]
            self.aliases.setdefault(first[0], []).append(key)
            return self.arrays[first[0]][0]
        self.seen[ident] = (key, weakref.ref(t))
        self.ident_of[key] = ident
        got = _copy(t)
        self.arrays[key] = got
        self.held += got[0].nbytes
        return got[0]

    def _put_exact(self, key: str, t: torch.Tensor) -> None:
        """A non-floating tensor argument, stored in its own dtype (no rounding: it is an index or a mask)."""
        a = t.detach().to("cpu").contiguous().clone().numpy()
        self.arrays[key] = (a, EXACT[t.dtype])
        self.held += a.nbytes

    def take_call(self, layer: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor], args=None,
                  kwargs=None, module=None, measured: dict | None = None) -> None:
        """One leaf call: its floating inputs (``in/``) and outputs (``out/``); with ``args``/``kwargs`` (the call
        as made), anything else it was given - integer or bool tensors (``arg/``), numbers, None, tuples, nested
        structures, keyword arguments - as ``arg_spec`` in the index (``specs``), so the judge replays the call as
        it was made. Kept when it fits the budget or takes a role (``keep.py``; ``measured``: the statistics of its
        output, when the watch measured them, for its ``worst`` measure)."""
        k = self.calls.get(layer, 0)
        self.calls[layer] = k + 1
        if self.over is not None:
            return
        spec = arg_spec(args, kwargs or {}) if args is not None else None
        exact = spec.pop("exact") if spec is not None else []
        tensors = [(f"in/{layer}/{k}/{i}", t) for i, t in enumerate(inputs)] + \
            [(f"out/{layer}/{k}/{i}", t) for i, t in enumerate(outputs)]
        if spec is not None and not spec["plain"]:
            tensors += [(f"arg/{layer}/{k}/{j}", t) for j, t in enumerate(exact)]
        roles = self.keeper.arrive(layer, k, _largest(outputs, measured))
        if not self._room(*self._cost([t for _, t in tensors if stands_for(t) is None])):
            self.keeper.not_kept()
            return
        self.keeper.keep(layer, k, roles)
        if module is not None and self.params and any(
                self.versions.get(id(p), p._version) != p._version for p in module._parameters.values() if p is not None):
            # (its own parameters from the dict itself: ``parameters(recurse=False)``'s generator, ~10 us a call)
            self.stale.append(f"{layer}/{k}")  # its weights are no evaluation's: the judge leaves the call out
        keys = []
        for key, t in tensors:
            if stands_for(t) is not None:  # its values alone would replay as the argument they are not
                if len(self.not_stored) < MAX_NOT_STORED:
                    self.not_stored.append(f"{key}: a {stands_for(t)} tensor (not kept; its call is not replayed)")
                continue
            if key.startswith("arg/"):
                self._put_exact(key, t)
            elif t.dtype in STORED:
                self._put(key, t)
            else:
                continue
            keys.append(key)
        self.call_keys[(layer, k)] = keys
        if spec is not None and not spec["plain"]:
            spec.pop("plain")
            self.specs[f"{layer}/{k}"] = spec

    def take_params(self, params) -> None:
        """At each forward of the model: the parameters the first time (room held back for their gradients); later,
        when an optimizer moved some of them within the step (an LBFGS closure's evaluations, SAM's second pass, a
        GAN's second model), a new *evaluation*: its parameters' SHA-256 always, and those that moved since the
        step's start (``eval/<e>/<name>``) where the budget allows - the judge replays its calls with them."""
        params = [(n, p) for n, p in params if p.dtype in STORED and dense(p)]
        if not self.params:
            self._first_params(params)
        elif any(self.versions.get(id(p)) != p._version for _, p in params):
            self._evaluation(params)

    def _first_params(self, params) -> None:
        self.params = True
        grads = [p for _, p in params if p.requires_grad]
        self.reserve = (0, 0)
        nbytes, members = self._cost([p for _, p in params])
        need = (sum(_stored_bytes(p) for p in grads), len(grads))
        if not self._room(nbytes + need[0], members + need[1]):
            self.over = self.held + nbytes + need[0]
            self.drop()  # the parameters and gradients alone pass the budget: nothing of the step is kept
            return
        self.reserve = need
        for n, p in params:
            self.versions[id(p)] = self.base[id(p)] = p._version
            self.first[n] = self._put(f"param/{n}", p)
        # its SHA-256 is written only beside a second evaluation's: hashed then (``_hash_first``)
        self.evaluations.append({"calls": {}, "sha256": None})

    def _hash_first(self) -> None:
        """The first evaluation's parameters hashed, as a second evaluation begins."""
        if self.first:
            self.hashes.update((n, _sha(a)) for n, a in self.first.items())
            self.first.clear()
            if self.evaluations and self.evaluations[0]["sha256"] is None:
                self.evaluations[0]["sha256"] = self._state()

    def _evaluation(self, params) -> None:
        self._hash_first()
        e = len(self.evaluations)
        moved = [(n, p) for n, p in params if p._version != self.base.get(id(p), p._version)]
        kept = self._room(*self._cost([p for _, p in moved]))
        stored = {n: self._put(f"eval/{e}/{n}", p) for n, p in moved} if kept else {}
        for n, p in params:
            if self.versions.get(id(p)) != p._version:
                self.versions[id(p)] = p._version
                self.hashes[n] = _sha(stored[n] if n in stored else _copy(p)[0])
        self.evaluations.append({"calls": dict(self.calls), "sha256": self._state(), "kept": kept,
                                 "moved": len(moved)})

    def _state(self) -> str:
        return hashlib.sha256("".join(self.hashes[n] for n in sorted(self.hashes)).encode()).hexdigest()

    def take_grads(self, params) -> None:
        self.grads = True
        if self.over is not None:
            return
        self.reserve = (0, 0)  # the room held back for them
        for n, p in params:
            if f"grad/{n}" in self.arrays or f"grad/{n}" in self.same_as:
                self._forget(f"grad/{n}")  # read again at another optimizer's step (``optimizers=``): the later read
            if p.grad is not None and not dense(p.grad):  # a sparse gradient (Embedding(sparse=True)): not kept
                why = f"grad/{n}: a {kind(p.grad)} tensor (not kept)"
                if why not in self.not_stored and len(self.not_stored) < MAX_NOT_STORED:
                    self.not_stored.append(why)
            elif p.grad is not None and self._room(*self._cost([p.grad])):
                self._put(f"grad/{n}", p.grad)

    def nbytes(self) -> int:
        """What the file will take at most (or, past the budget, what it would have taken)."""
        if self.over is not None:
            return file_bound(self.over, len(self.seen))
        return file_bound(self.held, len(self.arrays))

    def drop(self) -> None:
        for held in (self.arrays, self.same_as, self.seen, self.ident_of, self.aliases, self.call_keys, self.specs,
                     self.first):
            held.clear()
        self.stale.clear()
        self.not_stored.clear()
        self.evaluations.clear()
        self.held = 0
        self.reserve = (0, 0)

    def write(self, folder, step: int) -> dict:
        """The step's file written here and now; its index entry."""
        return self.file(folder, step).write()

    def file(self, folder, step: int) -> SnapshotFile:
        """The step's arrays and index entry handed over to be written (in the background: ``recorder.py``), the
        entry's ``bytes`` and ``sha256`` filled in as the file is; the taker holds nothing after."""
        keys = sorted(self.arrays)
        rel = f"snapshots/step_{step:05d}.npz"
        members = [(f"a{i:05d}", self.arrays[k][0]) for i, k in enumerate(keys)]
        arrays = [{"key": k, "shape": list(self.arrays[k][0].shape), "dtype": self.arrays[k][1]} for k in keys]
        for k, first in sorted(self.same_as.items()):
            if first in self.arrays:
                arrays.append({"key": k, "shape": list(self.arrays[first][0].shape),
                               "dtype": self.arrays[first][1], "same_as": first})
        entry = {"step": step, "file": rel, "bytes": None, "sha256": None,  # filled in as the file is written
                 "partial": self.partial, "arrays": arrays}
        if self.specs:
            entry["calls"] = dict(self.specs)
        if self.stale:
            entry["stale_calls"] = list(self.stale)
        if self.not_stored:  # arrays not kept as the tensors they were, and why (``layouts.py``)
            entry["not_stored"] = list(self.not_stored)
        if len(self.evaluations) > 1:  # the parameters moved within the step: each forward's (``take_params``)
            entry["evaluations"] = [dict(e) for e in self.evaluations]
        kept = self.keeper.summary(self.budget)
        if kept is not None:  # calls let go over the budget: which were kept of each layer, and why (``keep.py``)
            entry["kept"] = kept
        self.drop()
        return SnapshotFile(Path(folder) / f"step_{step:05d}.npz", members, entry)


def arg_spec(args, kwargs: dict) -> dict:
    """A call's arguments as JSON: ``{"args": [...], "kwargs": {...}, "plain", "exact"}``. Each floating tensor
    is ``{"in": i}`` (the i-th floating tensor, in the order ``producers.floats`` lists them: ``in/layer/k/i``),
    a non-floating one ``{"arg": j, "dtype"}`` (``arg/layer/k/j``, kept in ``exact``), a number, string, bool or
    None ``{"v": value}`` (a non-finite float as its text), a tuple/list/dict ``{"tuple"|"list"|"dict": ...}``, a
    dtype or device by name; anything else ``{"opaque": its type}`` (the replay says it cannot rebuild it).
    ``plain``: the call took its floating tensors only, positionally (no spec needed)."""
    counts = {"in": 0}
    exact: list = []

    def enc(o, depth: int):
        if isinstance(o, torch.Tensor) and not dense(o):  # a sparse adjacency, a nested tensor: not kept
            if o.is_floating_point() and stand_in(o) is not None:
                counts["in"] += 1  # ``producers.floats`` lists its values in its place (``in/`` numbering)
            return {"opaque": f"a {kind(o)} tensor"}
        if isinstance(o, torch.Tensor):
            if o.dtype in STORED:
                counts["in"] += 1
                return {"in": counts["in"] - 1}
            if o.dtype in EXACT:
                exact.append(o)
                return {"arg": len(exact) - 1, "dtype": EXACT[o.dtype]}
            return {"opaque": f"a {str(o.dtype)[6:]} tensor"}
        if o is None or isinstance(o, (bool, int, str)):
            return {"v": o}
        if isinstance(o, float):
            return {"v": o} if o == o and abs(o) != float("inf") else {"float": repr(o)}
        if isinstance(o, torch.dtype):
            return {"dtype": str(o)[6:]}
        if isinstance(o, torch.device):
            return {"device": str(o)}
        if depth >= MAX_SPEC_DEPTH:
            return {"opaque": "a structure nested deeper than recorded"}
        if isinstance(o, PackedSequence):  # a packed batch of sequences (an RNN's input): its four fields
            return {"packed": [enc(x, depth + 1) for x in o]}
        if isinstance(o, tuple) and not hasattr(o, "_fields"):
            return {"tuple": [enc(x, depth + 1) for x in o]}
        if isinstance(o, list):
            return {"list": [enc(x, depth + 1) for x in o]}
        if isinstance(o, dict) and all(isinstance(k, str) for k in o):
            return {"dict": {k: enc(v, depth + 1) for k, v in o.items()}}
        return {"opaque": type(o).__name__[:60]}

    spec_args = [enc(a, 0) for a in args]
    spec_kwargs = {str(k): enc(v, 0) for k, v in kwargs.items()}
    plain = not spec_kwargs and all(set(a) == {"in"} for a in spec_args)
    return {"args": spec_args, "kwargs": spec_kwargs, "plain": plain, "exact": exact}
