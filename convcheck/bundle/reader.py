"""Reading a bundle, trusting nothing in it.

A bundle is a directory or a ``.zip``. Every member is a regular file named by a relative path
without ``..`` (symbolic links, devices, FIFOs, absolute names are refused); the manifest is read
with a size limit and checked field by field against ``convcheck.bundle/2 (and /1)``; every array is read
with ``allow_pickle=False``, no larger than the shape its index declares, and must have exactly that
shape and the storage dtype of its declared dtype. Contents are checked too (``schema``'s list): each
array file's SHA-256 where the index records one (older bundles have none), arrays finite where the
writer only writes finite ones, and the manifest's rows consistent with themselves and the arrays. Anything else is a one-line ``UsageError``
(exit 2) naming the bundle and what is wrong. Nothing is executed and nothing is written.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import tokenize
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from convcheck.runformat.schema import (
    ARRAY_GROUPS, CALLABLES, DETAIL_KINDS, MANIFEST, MAX_MANIFEST_BYTES, MAX_TOTAL_BYTES, NPZ_SLACK,
    READABLE, SCHEMA, STORAGE, WATCH_SCHEMA,
)
from convcheck.runformat.fields import (BadField, _check_rows, check_fingerprint, dtype_field, get_field,  # noqa: F401
                                        kinds_of, nbytes_of, sha_field, shape_field)
from convcheck.runformat.members import BundleFiles, safe_member  # noqa: F401
from convcheck.errors import UsageError
from convcheck.files import array_load_error
from convcheck.measure.table_schema import ActivationRow, CurveRow, LayerGradRow, ParityRow, json_kinds
from convcheck.plan.stream import HASHES_LISTED

_NUM = (int, float)


PARITY_COLUMNS = json_kinds(ParityRow)
CURVE_COLUMNS = json_kinds(CurveRow)
LAYER_GRAD_COLUMNS = json_kinds(LayerGradRow)
ACTIVATION_COLUMNS = json_kinds(ActivationRow)


def check_manifest(m) -> dict:
    """``m`` checked field by field (raises ``BadField``); returns the total bytes its arrays claim."""
    if not isinstance(m, dict):
        raise BadField(f"manifest is {type(m).__name__}, expected an object")
    schema = m.get("schema")
    if schema == WATCH_SCHEMA:
        raise BadField("is a watched run (convcheck.watch), not a recorded bundle: compare two watched runs, or "
                       "one against the float64 judge, with `convcheck diff`")
    if schema not in READABLE:
        raise BadField(f"schema {schema!r} is not {SCHEMA!r} (a newer convcheck, or not a bundle)")
    model = get_field(m, "model", dict, "manifest")
    get_field(model, "spec", str, "model")
    get_field(model, "task", str, "model")
    if model.get("source_sha256") is not None:
        sha_field(model["source_sha256"], "model.source_sha256")
    for key in ("input_shape",):
        if model.get(key) is not None:
            shape_field(model[key], f"model.{key}")
    get_field(model, "num_classes", int, "model", optional=True)
    for key in ("target", "judge", "convcheck_version", "data_source", "created"):
        get_field(m, key, str, "manifest")
    cfg = get_field(m, "config", dict, "manifest")
    for key, most in (("steps", 10**6), ("batch_size", 10**6), ("seed", 2**63), ("envelope", 100)):
        if not 0 <= get_field(cfg, key, int, "config") <= most:
            raise BadField(f"config.{key} = {cfg[key]} is outside 0..{most}")
    for option, h in get_field(m, "code_sha256", dict, "manifest").items():
        sha_field(h, f"code_sha256.{option}")
    get_field(m, "tolerances", dict, "manifest")
    get_field(m, "versions", dict, "manifest")
    get_field(m, "fingerprint", dict, "manifest")
    sha_field(get_field(m, "init_sha256", str, "manifest"), "init_sha256")
    sha_field(get_field(m, "batches_sha256", str, "manifest"), "batches_sha256")
    hashes = get_field(m, "batch_sha256", list, "manifest")
    if len(hashes) != min(cfg["steps"], HASHES_LISTED):
        raise BadField(f"batch_sha256 lists {len(hashes)} batches for {cfg['steps']} steps")
    for i, h in enumerate(hashes):
        sha_field(h, f"batch_sha256[{i}]")
    get_field(m, "data_stats", dict, "manifest")
    parity = get_field(m, "parity", dict, "manifest")
    for key in ("judge_loss", "loss", "self_difference"):
        get_field(parity, key, _NUM, "parity")
    if not all(isinstance(s, str) for s in get_field(parity, "stochastic_layers", list, "parity")):
        raise BadField("parity.stochastic_layers holds a non-string")
    _check_rows(get_field(parity, "rows", list, "parity"), "parity.rows", PARITY_COLUMNS)
    train = get_field(m, "training", dict, "manifest")
    _check_rows(get_field(train, "curves", list, "training"), "training.curves", CURVE_COLUMNS)
    _check_rows(get_field(train, "layer_grads", list, "training"), "training.layer_grads", LAYER_GRAD_COLUMNS)
    _check_rows(get_field(train, "activations", list, "training"), "training.activations", ACTIVATION_COLUMNS)
    for arm, v in get_field(train, "nonfinite_producer", dict, "training").items():
        if v is not None and not (isinstance(v, list) and len(v) == 2 and isinstance(v[0], int)
                                  and isinstance(v[1], str)):
            raise BadField(f"training.nonfinite_producer[{arm!r}] is not [step, layer] or null")
    weights = train.get("nonfinite_weights", {})  # optional: bundles before it was recorded
    if not isinstance(weights, dict) or not all(isinstance(v, bool) for v in weights.values()):
        raise BadField("training.nonfinite_weights is not an object of true/false")
    if schema != READABLE[0] or "nonfinite_detail" in train:  # required from /2 on
        _check_detail(get_field(train, "nonfinite_detail", dict, "training"))
    _check_names(m)
    _check_rows_content(m)
    return _check_arrays(get_field(m, "arrays", dict, "manifest"))


def _check_detail(details: dict) -> None:
    """``training.nonfinite_detail``: per arm an object whose known keys hold their kinds
    (``schema.DETAIL_KINDS``), ``callable`` one of ``CALLABLES``, any other key a scalar."""
    for arm, d in details.items():
        where = f"training.nonfinite_detail[{arm!r:.40}]"
        if not isinstance(d, dict):
            raise BadField(f"{where} is not an object")
        for key, v in d.items():
            kinds = DETAIL_KINDS.get(key, (str, int, float, bool, type(None)))
            allowed = kinds if isinstance(kinds, tuple) else (kinds,)
            if not isinstance(v, allowed) or (isinstance(v, bool) and bool not in allowed):
                raise BadField(f"{where}.{str(key):.40} holds {type(v).__name__}, not what it should")
        if "callable" in d and d["callable"] not in CALLABLES:
            raise BadField(f"{where}.callable is {str(d['callable'])!r:.40}, not one of {', '.join(CALLABLES)}")


_FINITE_PARITY = ("u", "floor", "bound", "propagated", "local")


def _check_rows_content(m: dict) -> None:
    """The rows say what their own numbers give: a parity row's ``flagged`` is recomputed from its local
    error, intrinsic error and floor (the run's tolerances); a row that counts no NaN/Inf has finite
    errors; a non-finite loss is marked ``nonfinite_loss``. A row edited by hand fails here."""
    from convcheck.numerics.tolerances import Tolerances

    try:
        tol = Tolerances(**m["tolerances"])
    except (TypeError, ValueError, UsageError) as exc:
        raise BadField(f"tolerances are not this convcheck's ({str(exc)[:80]})") from None
    for i, r in enumerate(m["parity"]["rows"]):
        where = f"parity.rows[{i}] ({r['kind']} {r['layer']!r:.40})"
        clean = not (r["nan"] or r["inf"] or r["input_nonfinite"] or r["grad_out_nonfinite"]
                     or r.get("grad_in_nonfinite"))
        for col in _FINITE_PARITY:
            v = r[col]
            if isinstance(v, bool) or (clean and not math.isfinite(v)) or (math.isfinite(v) and v < 0):
                raise BadField(f"{where}.{col} is {v!r}, not what the writer records for a row with no NaN/Inf")
        local, intrinsic, floor = r["local"], r["intrinsic"], r["floor"]
        flagged = tol.is_flagged(local, floor) and (math.isnan(intrinsic) or tol.is_flagged(intrinsic, floor))
        if flagged != r["flagged"]:
            raise BadField(f"{where}.flagged is {r['flagged']} but its local error {local:.3g} against its floor "
                       f"{floor:.3g} says {flagged}: the row was edited")
    for i, r in enumerate(m["training"]["curves"]):
        if not math.isfinite(r["loss"]) and not r["nonfinite_loss"]:
            raise BadField(f"training.curves[{i}] (arm {r['arm']!r:.40} step {r['step']}) has loss {r['loss']} but "
                       "nonfinite_loss false")


def _check_names(m: dict) -> None:
    """Every parity row is the recorded target's; every training row one of its arms (the target, the
    judge, the target's envelope runs ``target~k``); each arm's curve holds steps 0..steps-1 once."""
    target, judge, steps = m["target"], m["judge"], m["config"]["steps"]
    for i, r in enumerate(m["parity"]["rows"]):
        if r["target"] != target:
            raise BadField(f"parity.rows[{i}].target is {r['target']!r:.40}, not the recorded target {target!r}")
    arms = {target, judge, *(f"{target}~{k + 1}" for k in range(m["config"]["envelope"]))}
    seen: dict[str, list[int]] = {}
    for key in ("curves", "layer_grads", "activations"):
        for i, r in enumerate(m["training"][key]):
            if r["arm"] not in arms or not 0 <= r["step"] < steps:
                raise BadField(f"training.{key}[{i}] is arm {r['arm']!r:.40} step {r['step']}, not one of this run's")
            if key == "curves":
                seen.setdefault(r["arm"], []).append(r["step"])
    for arm in (target, judge):
        if sorted(seen.get(arm, [])) != list(range(steps)):
            raise BadField(f"training.curves of {arm} do not hold steps 0..{steps - 1} once each")


def _check_arrays(arrays: dict) -> int:
    total = 0
    files = set()
    for group in ARRAY_GROUPS:
        for i, e in enumerate(get_field(arrays, group, list, "arrays")):
            where = f"arrays.{group}[{i}]"
            if not isinstance(e, dict):
                raise BadField(f"{where} is {type(e).__name__}, expected an object")
            f = safe_member(get_field(e, "file", str, where))
            if not f.startswith(f"{group}/") or not f.endswith(".npz") or f in files:
                raise BadField(f"{where}.file {f!r} is not a fresh {group}/*.npz name")
            files.add(f)
            if e.get("sha256") is not None:
                sha_field(e["sha256"], f"{where}.sha256")
            if group == "snapshots":
                get_field(e, "step", int, where)
                continue
            get_field(e, "key" if group == "forward" else "param", str, where)
            total += nbytes_of(shape_field(e.get("shape"), f"{where}.shape"), dtype_field(e.get("dtype"), f"{where}.dtype"))
    params = get_field(arrays, "parameters", list, "arrays")
    per_snapshot = 0
    for i, p in enumerate(params):
        where = f"arrays.parameters[{i}]"
        if not isinstance(p, dict):
            raise BadField(f"{where} is {type(p).__name__}, expected an object")
        get_field(p, "name", str, where)
        per_snapshot += nbytes_of(shape_field(p.get("shape"), f"{where}.shape"), dtype_field(p.get("dtype"), f"{where}.dtype"))
    total += per_snapshot * len(arrays["snapshots"])
    if total > MAX_TOTAL_BYTES:
        raise BadField(f"its arrays claim {total / 1024**3:.1f} GiB, more than the {MAX_TOTAL_BYTES // 1024**3} GiB "
                   "limit of a bundle")
    return total


# --- the bundle ---------------------------------------------------------------

@dataclass
class Bundle:
    path: Path
    manifest: dict
    source: BundleFiles = field(repr=False)

    def __getitem__(self, key):
        return self.manifest[key]

    def _load(self, rel: str, expected: dict[str, tuple[tuple[int, ...], str]], sha256: str | None = None,
              finite: str | None = None) -> dict[str, np.ndarray]:
        """The arrays of ``rel``; its bytes must hash to ``sha256`` (when the index has one) and, with
        ``finite`` (why they must be), every value must be finite."""
        limit = sum(nbytes_of(s, d) + NPZ_SLACK for s, d in expected.values()) + NPZ_SLACK
        data = self.source.read(rel, limit)
        arrays = self._parse(rel, data, expected)  # what it is first (a damaged file says how), then whose
        if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
            raise BadField(f"{rel} does not hash to the SHA-256 its index records: the file was changed or swapped")
        if finite is not None:
            for key, a in arrays.items():
                if not np.isfinite(a).all():
                    raise BadField(f"{rel}: array {key} holds NaN/Inf, but {finite}")
        return arrays

    def _parse(self, rel: str, data: bytes, expected: dict[str, tuple[tuple[int, ...], str]]) -> dict:
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                if set(z.files) != set(expected):
                    raise BadField(f"{rel} holds arrays {sorted(z.files)[:4]}, expected {sorted(expected)[:4]}")
                out = {}
                for key, (shape, dtype) in expected.items():
                    a = z[key]
                    if a.dtype != np.dtype(STORAGE[dtype]) or tuple(a.shape) != shape:
                        raise BadField(f"{rel}: array {key} is {a.dtype}{list(a.shape)}, the index says "
                                   f"{STORAGE[dtype]}{list(shape)}")
                    out[key] = a
                return out
        except BadField:
            raise
        # numpy parses an array's header with tokenize and ast: a damaged one raises their errors
        except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError, TypeError, SyntaxError,
                tokenize.TokenError, RecursionError, zlib.error) as exc:
            raise BadField(f"{rel} is not a plain array file ({array_load_error(exc)})") from None

    def _wrap(self, fn, *args):
        try:
            return fn(*args)
        except BadField as exc:
            raise UsageError(f"bundle {self.path}: {exc}") from None

    def _clean_row(self, kind: str, name: str) -> bool:
        """The parity row of this array counts no NaN/Inf anywhere (so the array the writer saved is finite)."""
        field_name = "param" if kind == "grad" else "layer"
        rows = [r for r in self.manifest["parity"]["rows"] if r["kind"] == kind and r.get(field_name) == name]
        return bool(rows) and not any(r["nan"] or r["inf"] or r["input_nonfinite"] or r["grad_out_nonfinite"]
                                      or r.get("grad_in_nonfinite") for r in rows)

    def forward(self, i: int) -> np.ndarray:
        e = self.manifest["arrays"]["forward"][i]
        finite = "its parity row counts none" if self._clean_row("forward", e["key"]) else None
        return self._wrap(self._load, e["file"], {"a": (tuple(e["shape"]), e["dtype"])}, e.get("sha256"),
                          finite)["a"]

    def grad(self, i: int) -> np.ndarray:
        e = self.manifest["arrays"]["grads"][i]
        finite = "its parity row counts none" if self._clean_row("grad", e["param"]) else None
        return self._wrap(self._load, e["file"], {"a": (tuple(e["shape"]), e["dtype"])}, e.get("sha256"),
                          finite)["a"]

    def snapshot(self, step: int) -> list[np.ndarray] | None:
        """The parameters after ``step`` training steps, in the recorded order; None when not recorded."""
        entry = next((e for e in self.manifest["arrays"]["snapshots"] if e["step"] == step), None)
        if entry is None:
            return None
        params = self.manifest["arrays"]["parameters"]
        expected = {f"p{i:05d}": (tuple(p["shape"]), p["dtype"]) for i, p in enumerate(params)}
        curves = [r for r in self.manifest["training"]["curves"] if r["arm"] == self.manifest["target"]]
        weights_finite = not self.manifest["training"].get("nonfinite_weights", {}).get(self.manifest["target"]) \
            and not any(r["nonfinite_loss"] or r["nonfinite_grad"] for r in curves)
        finite = "training kept the weights finite" if weights_finite else None
        arrays = self._wrap(self._load, entry["file"], expected, entry.get("sha256"), finite)
        return [arrays[f"p{i:05d}"] for i in range(len(params))]

    def check_arrays(self) -> None:
        """Read every array once (``convcheck diff`` does, before any work)."""
        for i in range(len(self.manifest["arrays"]["forward"])):
            self.forward(i)
        for i in range(len(self.manifest["arrays"]["grads"])):
            self.grad(i)
        for e in self.manifest["arrays"]["snapshots"]:
            self.snapshot(e["step"])


def open_bundle(path: str | os.PathLike) -> Bundle:
    """The bundle at ``path`` (folder or zip), its manifest checked; arrays are read on demand."""
    path = Path(path)
    try:
        source = BundleFiles(path)
        data = source.read(MANIFEST, MAX_MANIFEST_BYTES)
        try:
            manifest = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise BadField(f"manifest.json is not JSON ({str(exc).splitlines()[0][:80]})") from None
        check_manifest(manifest)
        check_fingerprint(manifest["fingerprint"])
    except BadField as exc:
        raise UsageError(f"bundle {path}: {exc}") from None
    return Bundle(path, manifest, source)
