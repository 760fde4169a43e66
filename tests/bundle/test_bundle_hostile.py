"""Hostile bundles: each is a one-line error and exit 2, nothing executed, nothing written."""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest

from convcheck.bundle.reader import open_bundle
from convcheck.cli.main import main
from convcheck.errors import UsageError


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def _set_manifest(path: Path, m) -> None:
    (path / "manifest.json").write_text(json.dumps(m))


def _edit(fn):
    def damage(path: Path, tmp: Path) -> Path:
        m = _manifest(path)
        fn(m)
        _set_manifest(path, m)
        return path
    return damage


def _zip_of(path: Path, tmp: Path, extra: dict | None = None) -> Path:
    z = tmp / "bundle.zip"
    with zipfile.ZipFile(z, "w") as out:
        for f in sorted(path.rglob("*")):
            if f.is_file():
                out.write(f, f.relative_to(path).as_posix())
        for name, data in (extra or {}).items():
            out.writestr(name, data)
    return z


def truncated_zip(path, tmp):
    z = _zip_of(path, tmp)
    data = z.read_bytes()
    z.write_bytes(data[: len(data) // 2])
    return z


def zip_dotdot_member(path, tmp):
    return _zip_of(path, tmp, {"../evil.txt": b"x"})


def zip_absolute_member(path, tmp):
    return _zip_of(path, tmp, {"/etc/evil.txt": b"x"})


def zip_symlink_member(path, tmp):
    z = _zip_of(path, tmp)
    with zipfile.ZipFile(z, "a") as out:
        info = zipfile.ZipInfo("forward/link.npz")
        info.external_attr = (0o120777 << 16)
        out.writestr(info, "/etc/passwd")
    return z


def zip_member_claims_gigabytes(path, tmp):
    """forward/00000.npz in the zip is far larger than the shape its index declares."""
    big = tmp / "big"
    shutil.copytree(path, big)
    np.savez(big / "forward" / "00000.npz", a=np.zeros(3_000_000, np.float32))
    return _zip_of(big, tmp)


def _array(rel: str, **arrays):
    def damage(path: Path, tmp: Path) -> Path:
        np.savez(path / rel, **arrays)
        return path
    return damage


def _first_forward_shape(path):
    e = _manifest(path)["arrays"]["forward"][0]
    return tuple(e["shape"])


def wrong_shape(path, tmp):
    shape = _first_forward_shape(path)
    np.savez(path / "forward" / "00000.npz", a=np.zeros((shape[0], shape[1] - 1) + shape[2:], np.float32))
    return path


def flattened(path, tmp):
    np.savez(path / "forward" / "00000.npz", a=np.zeros(int(np.prod(_first_forward_shape(path))), np.float32))
    return path


def wrong_dtype(path, tmp):
    np.savez(path / "forward" / "00000.npz", a=np.zeros(_first_forward_shape(path), np.float16))
    return path


def larger_dtype(path, tmp):
    np.savez(path / "forward" / "00000.npz", a=np.zeros(_first_forward_shape(path), np.float64))
    return path


def int_array(path, tmp):
    np.savez(path / "forward" / "00000.npz", a=np.zeros(_first_forward_shape(path), np.int32))
    return path


def object_array(path, tmp):
    np.savez(path / "forward" / "00000.npz", a=np.array([{"x": 1}, None], dtype=object))
    return path


def pickled_array(path, tmp):
    """A raw pickle where an npz belongs (loads only with allow_pickle=True)."""
    import pickle

    (path / "forward" / "00000.npz").write_bytes(pickle.dumps({"a": [1, 2, 3]}))
    return path


def extra_array(path, tmp):
    np.savez(path / "forward" / "00000.npz", a=np.zeros(_first_forward_shape(path), np.float32), b=np.zeros(1))
    return path


def missing_array(path, tmp):
    (path / "grads" / "00000.npz").unlink()
    return path


def array_symlink(path, tmp):
    f = path / "forward" / "00000.npz"
    f.unlink()
    f.symlink_to("/etc/passwd")
    return path


def manifest_symlink(path, tmp):
    real = tmp / "elsewhere.json"
    shutil.copy(path / "manifest.json", real)
    (path / "manifest.json").unlink()
    (path / "manifest.json").symlink_to(real)
    return path


def bundle_symlink(path, tmp):
    link = tmp / "link"
    link.symlink_to(path)
    return link


def array_fifo(path, tmp):
    f = path / "forward" / "00000.npz"
    f.unlink()
    os.mkfifo(f)
    return path


def huge_manifest(path, tmp):
    with open(path / "manifest.json", "r+b") as f:
        f.truncate(65 * 1024 * 1024)  # sparse: claims 65 MiB, holds nothing
    return path


def not_json(path, tmp):
    (path / "manifest.json").write_text("{not json")
    return path


def no_manifest(path, tmp):
    (path / "manifest.json").unlink()
    return path


def manifest_is_list(path, tmp):
    _set_manifest(path, [1, 2, 3])
    return path


def a_plain_file(path, tmp):
    f = tmp / "plain.txt"
    f.write_text("hello")
    return f


CASES = {
    "truncated zip": (truncated_zip, "not a readable bundle zip"),
    "zip member with ..": (zip_dotdot_member, "not a plain relative path"),
    "zip member absolute": (zip_absolute_member, "not a plain relative path"),
    "zip member symlink": (zip_symlink_member, "symbolic link"),
    "zip member claims more than its shape": (zip_member_claims_gigabytes, "claims"),
    "unknown schema": (_edit(lambda m: m.update(schema="convcheck.bundle/9")), "schema 'convcheck.bundle/9'"),
    "no schema": (_edit(lambda m: m.pop("schema")), "schema None"),
    "model spec a number": (_edit(lambda m: m["model"].update(spec=5)), "model.spec is int"),
    "steps a string": (_edit(lambda m: m["config"].update(steps="2")), "config.steps is str"),
    "steps a bool": (_edit(lambda m: m["config"].update(steps=True)), "config.steps is bool"),
    "flagged a string": (_edit(lambda m: m["parity"]["rows"][0].update(flagged="yes")), "flagged is str"),
    "curve loss a string": (_edit(lambda m: m["training"]["curves"][0].update(loss="2.3")), "loss is str"),
    "arrays not an object": (_edit(lambda m: m.update(arrays=[])), "arrays is list"),
    "bad sha": (_edit(lambda m: m.update(init_sha256="zz")), "init_sha256 is not a SHA-256"),
    "bad dtype": (_edit(lambda m: m["arrays"]["forward"][0].update(dtype="object")), "not one of"),
    "negative shape": (_edit(lambda m: m["arrays"]["forward"][0].update(shape=[-1, 4])), "not a shape"),
    "file outside its group": (_edit(lambda m: m["arrays"]["forward"][0].update(file="manifest.json")),
                               "not a fresh forward"),
    "file with ..": (_edit(lambda m: m["arrays"]["forward"][0].update(file="../../etc/passwd")),
                     "not a plain relative path"),
    "claims gigabytes": (_edit(lambda m: m["arrays"]["forward"][0].update(shape=[100000, 100000, 100])), "GiB"),
    "absurd steps": (_edit(lambda m: m["config"].update(steps=10**9)), "config.steps = 1000000000 is outside"),
    "batch hashes missing": (_edit(lambda m: m.update(batch_sha256=[])), "lists 0 batches for 2 steps"),
    "fingerprint wrong": (_edit(lambda m: m.update(fingerprint={"schema": "x"})), "fingerprint: not a convcheck"),
    "row of another target": (_edit(lambda m: m["parity"]["rows"][0].update(target="cuda")), "not the recorded"),
    "curve of another arm": (_edit(lambda m: m["training"]["curves"][0].update(arm="x")), "not one of this run's"),
    "curve step missing": (_edit(lambda m: m["training"].update(curves=m["training"]["curves"][1:])),
                           "do not hold steps"),
    "nan detail missing in /2": (_edit(lambda m: m["training"].pop("nonfinite_detail")),
                                 "training.nonfinite_detail is missing"),
    "nan detail not an object": (_edit(lambda m: m["training"].update(nonfinite_detail={"cpu": [1]})),
                                 "training.nonfinite_detail['cpu'] is not an object"),
    "nan detail op a number": (_edit(lambda m: m["training"].update(nonfinite_detail={"cpu": {"op": 3}})),
                               "training.nonfinite_detail['cpu'].op holds int"),
    "nan detail magnitude a bool": (_edit(lambda m: m["training"].update(
        nonfinite_detail={"cpu": {"magnitude": True}})), "magnitude holds bool"),
    "nan detail unknown callable": (_edit(lambda m: m["training"].update(
        nonfinite_detail={"cpu": {"callable": "rm -rf"}})), "callable is 'rm -rf', not one of"),
    "manifest a list": (manifest_is_list, "manifest is list"),
    "manifest not json": (not_json, "not JSON"),
    "no manifest": (no_manifest, "manifest.json cannot be opened"),
    "manifest huge": (huge_manifest, "more than"),
    "wrong shape": (wrong_shape, "the index says"),
    "wrong dtype": (wrong_dtype, "the index says"),
    "float64 where float32 belongs": (larger_dtype, "more than"),
    "same size, other shape": (flattened, "the index says"),
    "int array": (int_array, "the index says"),
    "object array": (object_array, "not a plain array file"),
    "pickle": (pickled_array, "not a plain array file"),
    "extra array": (extra_array, "holds arrays"),
    "missing array": (missing_array, "grads/00000.npz cannot be opened"),
    "array symlink": (array_symlink, "symbolic link"),
    "manifest symlink": (manifest_symlink, "symbolic link"),
    "bundle symlink": (bundle_symlink, "symbolic link"),
    "array fifo": (array_fifo, "not a regular file"),
    "plain file": (a_plain_file, "not a readable bundle zip"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_bundle_is_one_line_exit_2(case, copy_a, bundles, tmp_path, capsys, monkeypatch):
    damage, expected = CASES[case]
    work = tmp_path / "work"
    work.mkdir()
    hostile = damage(copy_a, tmp_path)
    monkeypatch.chdir(work)
    before = sorted(p.name for p in tmp_path.iterdir())
    rc = main(["diff", str(hostile), str(bundles[1]), "--no-save"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert len(err) == 1 and err[0].startswith("convcheck: error: bundle "), err
    assert expected in err[0], err
    assert list(work.iterdir()) == []  # nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_the_valid_bundle_reads(bundles):
    for b in bundles:
        bundle = open_bundle(b)
        bundle.check_arrays()
        assert bundle["schema"] == "convcheck.bundle/2"


def test_open_bundle_raises_usage_error(copy_a):
    (copy_a / "manifest.json").write_text("[]")
    with pytest.raises(UsageError):
        open_bundle(copy_a)


def test_a_version_1_bundle_without_the_nan_detail_still_reads(copy_a):
    """``convcheck.bundle/1`` had no ``training.nonfinite_detail``: read without it (required from /2 on)."""
    m = _manifest(copy_a)
    m["schema"] = "convcheck.bundle/1"
    m["training"].pop("nonfinite_detail")
    _set_manifest(copy_a, m)
    bundle = open_bundle(copy_a)
    bundle.check_arrays()
    assert bundle["schema"] == "convcheck.bundle/1"
