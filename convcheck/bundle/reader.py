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
import stat
import tokenize
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import numpy as np

from convcheck.bundle.schema import (
    ARRAY_GROUPS, CALLABLES, DETAIL_KINDS, MANIFEST, MAX_MANIFEST_BYTES, MAX_MEMBERS, MAX_TOTAL_BYTES, NPZ_SLACK,
    READABLE, SCHEMA, STORAGE, WATCH_SCHEMA,
)
from convcheck.errors import UsageError
from convcheck.files import array_load_error
from convcheck.measure.table_schema import ActivationRow, CurveRow, LayerGradRow, ParityRow, json_kinds
from convcheck.plan.stream import HASHES_LISTED

_NUM = (int, float)


class BadField(Exception):
    """A field of the manifest is wrong: the message says which (caught and prefixed with the bundle)."""


def safe_member(name: str) -> str:
    p = PurePosixPath(name)
    if not name or name.startswith(("/", "\\")) or p.is_absolute() or ".." in p.parts or "\\" in name \
            or (len(name) > 1 and name[1] == ":"):
        raise BadField(f"member {name!r} is not a plain relative path")
    return name


class BundleFiles:
    """The bundle's files, from a folder or a zip; ``read(name, limit)`` returns bytes."""

    def __init__(self, path: Path):
        self.path = path
        st = _lstat(path)
        if stat.S_ISLNK(st.st_mode):
            raise BadField("is a symbolic link; pass the bundle itself")
        if stat.S_ISDIR(st.st_mode):
            self.zip = None
        elif stat.S_ISREG(st.st_mode):
            try:
                self.zip = zipfile.ZipFile(path)
                infos = self.zip.infolist()
            except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
                raise BadField(f"not a readable bundle zip ({exc})") from None
            if len(infos) > MAX_MEMBERS:
                raise BadField(f"holds {len(infos)} members, more than a bundle ever has")
            self.members = {}
            for info in infos:
                name = safe_member(info.filename)
                if info.is_dir():
                    continue
                if stat.S_ISLNK(info.external_attr >> 16):
                    raise BadField(f"member {name!r} is a symbolic link")
                self.members[name] = info
        else:
            raise BadField("is neither a folder nor a .zip file")

    def read(self, name: str, limit: int) -> bytes:
        safe_member(name)
        if self.zip is not None:
            info = self.members.get(name)
            if info is None:
                raise BadField(f"{name} is missing")
            if info.file_size > limit:
                raise BadField(f"{name} claims {info.file_size} bytes, more than the {limit} it may hold")
            try:
                with self.zip.open(info) as f:
                    data = f.read(limit + 1)
            except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError, zlib.error) as exc:
                raise BadField(f"{name} cannot be read ({exc})") from None
        else:
            full = self.path
            for part in PurePosixPath(name).parts:  # no link anywhere on the way
                full = full / part
                st = _lstat(full, name)
                if stat.S_ISLNK(st.st_mode):
                    raise BadField(f"{name} is (or passes through) a symbolic link")
            if not stat.S_ISREG(st.st_mode):
                raise BadField(f"{name} is not a regular file")
            if st.st_size > limit:
                raise BadField(f"{name} is {st.st_size} bytes, more than the {limit} it may hold")
            try:
                with open(full, "rb") as f:
                    data = f.read(limit + 1)
            except OSError as exc:
                raise BadField(f"{name} cannot be read ({exc.strerror or exc})") from None
        if len(data) > limit:
            raise BadField(f"{name} is larger than the {limit} bytes it may hold")
        return data


def _lstat(path: Path, name: str | None = None):
    try:
        return os.lstat(path)
    except OSError as exc:
        raise BadField(f"{name + ' ' if name else ''}cannot be opened ({exc.strerror or exc})") from None


# --- field checks -------------------------------------------------------------

def get_field(d: dict, key: str, kind, where: str, *, optional: bool = False):
    if key not in d:
        if optional:
            return None
        raise BadField(f"{where}.{key} is missing")
    v = d[key]
    if v is None and optional:
        return None
    ok = isinstance(v, kind) and not (isinstance(v, bool) and kind is not bool and bool not in kinds_of(kind))
    if not ok:
        raise BadField(f"{where}.{key} is {type(v).__name__}, expected {_kind_name(kind)}")
    return v


def kinds_of(kind):
    return kind if isinstance(kind, tuple) else (kind,)


def _kind_name(kind) -> str:
    names = {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object",
             bool: "true/false"}
    return " or ".join(names.get(k, k.__name__) for k in kinds_of(kind))


def shape_field(v, where: str) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > 8 or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n
                                                        for n in v):
        raise BadField(f"{where} is not a shape (a list of at most 8 non-negative integers)")
    return tuple(v)


def dtype_field(v, where: str) -> str:
    if not isinstance(v, str) or v not in STORAGE:
        raise BadField(f"{where} is {v!r:.40}, not one of {', '.join(STORAGE)}")
    return v


def sha_field(v, where: str) -> str:
    if not isinstance(v, str) or len(v) != 64 or any(c not in "0123456789abcdef" for c in v):
        raise BadField(f"{where} is not a SHA-256 hex digest")
    return v


def nbytes_of(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * np.dtype(STORAGE[dtype]).itemsize


def _check_rows(rows, where: str, columns: dict) -> list[dict]:
    if not isinstance(rows, list):
        raise BadField(f"{where} is {type(rows).__name__}, expected a list")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise BadField(f"{where}[{i}] is {type(row).__name__}, expected an object")
        for col, kind in columns.items():
            get_field(row, col, kind, f"{where}[{i}]", optional=type(None) in kinds_of(kind))
    return rows


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


def check_fingerprint(d: dict) -> None:
    from convcheck.env.fingerprint import Fingerprint

    try:
        Fingerprint.from_dict(d)
    except UsageError as exc:
        raise BadField(f"fingerprint: {exc}") from None
