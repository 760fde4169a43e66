"""Property-based: whatever a manifest or an array file holds, reading it is a bundle or a UsageError."""

from __future__ import annotations

import copy
import io
import json
import shutil

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from convcheck.bundle import reader
from convcheck.bundle.reader import BadField, check_manifest, open_bundle
from convcheck.errors import UsageError

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in list(obj.items())[:40]:
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):
            yield from _paths(v, prefix + (i,))


@FAST
@given(JSON)
def test_any_json_is_a_manifest_or_bad(value):
    try:
        check_manifest(value)
    except BadField:
        pass


@FAST
@given(data=st.data())
def test_one_field_replaced_is_a_manifest_or_bad(bundles, data):
    manifest = json.loads((bundles[0] / "manifest.json").read_text())
    paths = [p for p in _paths(manifest) if p]
    path = data.draw(st.sampled_from(paths))
    value = data.draw(JSON)
    m = copy.deepcopy(manifest)
    node = m
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    try:
        check_manifest(m)
    except BadField:
        pass


@FAST
@given(st.binary(max_size=2048))
def test_any_bytes_as_an_array_file_is_a_usage_error(tmp_path_factory, bundles, blob):
    dst = tmp_path_factory.mktemp("fuzz") / "A"
    shutil.copytree(bundles[0], dst)
    (dst / "forward" / "00000.npz").write_bytes(blob)
    b = open_bundle(dst)
    try:
        b.forward(0)
    except UsageError:
        pass


@FAST
@given(st.binary(max_size=4096))
def test_any_bytes_as_a_zip_is_a_usage_error(tmp_path_factory, blob):
    z = tmp_path_factory.mktemp("zip") / "b.zip"
    z.write_bytes(blob)
    try:
        open_bundle(z)
    except UsageError:
        pass


@FAST
@given(data=st.data())
def test_a_damaged_array_file_is_read_or_a_usage_error(tmp_path_factory, bundles, data):
    dst = tmp_path_factory.mktemp("flip") / "A"
    shutil.copytree(bundles[0], dst)
    f = dst / "forward" / "00000.npz"
    raw = bytearray(f.read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, min(len(raw) - 1, 400)))] = data.draw(st.integers(0, 255))
    f.write_bytes(bytes(raw[: data.draw(st.integers(1, len(raw)))]))
    try:
        b = open_bundle(dst)
        b.forward(0)
    except UsageError:
        pass


def test_an_array_file_whose_header_numpy_cannot_tokenize_is_a_usage_error(tmp_path_factory, bundles):
    """Found by the fuzz test above: a first byte changed and the file cut short made numpy read an
    ``.npy`` header that ends inside its dict, and tokenize raised TokenError through the reader."""
    dst = tmp_path_factory.mktemp("header") / "A"
    shutil.copytree(bundles[0], dst)
    f = dst / "forward" / "00000.npz"
    raw = bytearray(f.read_bytes())
    raw[0] = 4
    f.write_bytes(bytes(raw[:75520]))
    try:
        open_bundle(dst).forward(0)
    except UsageError as exc:
        assert "not a plain array file" in str(exc) or "cannot be read" in str(exc)
    header = b"\x93NUMPY\x01\x00" + (20).to_bytes(2, "little") + b"{'descr': '<f4', 'fo"
    f.write_bytes(header)
    try:
        open_bundle(dst).forward(0)
    except UsageError as exc:
        assert "not a plain array file" in str(exc)
