"""The fingerprint record: immutable, JSON round trip, atomic save, clear errors on bad files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from convcheck.env import SCHEMA, Fingerprint, load, save
from convcheck.env.fingerprint import anonymise_uuid, redact_uuids
from convcheck.errors import UsageError

DATA = Path(__file__).parents[1] / "data" / "env"
FIXTURES = sorted(p.name for p in DATA.glob("*.json"))


@pytest.mark.parametrize("name", FIXTURES)
def test_fixtures_round_trip(name):
    fp = load(DATA / name)
    d = fp.to_dict()
    assert d["schema"] == SCHEMA
    again = Fingerprint.from_dict(json.loads(json.dumps(d)))
    assert again == fp
    assert isinstance(again.gpus, tuple) and all(isinstance(g.capability, tuple) for g in again.gpus)


def test_fingerprint_is_immutable():
    fp = load(DATA / "h100_healthy.json")
    with pytest.raises(dataclasses.FrozenInstanceError):
        fp.source = "x"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        fp.gpus[0].ecc_enabled = False  # type: ignore[misc]


def test_from_dict_tolerates_missing_and_unknown_keys():
    fp = Fingerprint.from_dict({"schema": SCHEMA, "torch": {"version": "2.4.0", "new_field": 1},
                                "gpus": [{"name": "NVIDIA A100-PCIE-40GB", "capability": "8.0"}]})
    assert fp.torch.version == "2.4.0" and fp.gpus[0].capability == (8, 0) and fp.gpus[0].index == 0
    assert fp.driver.version is None and fp.math.recorded


def test_raw_uuid_in_json_is_anonymised_on_load():
    raw = "GPU-9e2f6a1b-3c4d-5e6f-7a8b-9c0d1e2f3a4b"
    fp = Fingerprint.from_dict({"schema": SCHEMA, "gpus": [{"name": "x", "uuid": raw}]})
    assert fp.gpus[0].uuid_hash == anonymise_uuid(raw)
    assert raw not in json.dumps(fp.to_dict())
    assert anonymise_uuid(anonymise_uuid(raw)) == anonymise_uuid(raw)
    assert redact_uuids(f"GPU 0: A100 (UUID: {raw})") == f"GPU 0: A100 (UUID: {anonymise_uuid(raw)})"


def test_save_is_atomic_and_loads_back(tmp_path):
    fp = load(DATA / "a100_tf32.json")
    target = tmp_path / "sub" / "fp.json"
    save(fp, target)
    assert [p.name for p in target.parent.iterdir()] == ["fp.json"]  # no temp file left behind
    back = load(target)
    assert dataclasses.replace(back, source=fp.source) == fp


def test_save_to_an_unwritable_place_is_a_usage_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(UsageError, match="cannot write"):
        save(load(DATA / "a100_tf32.json"), blocker / "fp.json")


@pytest.mark.parametrize("content,match", [
    ("{not json", "invalid JSON"),
    ('{"schema": "something/else"}', "not a convcheck fingerprint"),
    ('{"schema": "convcheck.fingerprint/1", "gpus": [3]}', "malformed"),
    ('{"schema": "convcheck.fingerprint/1", "torch": "2.1"}', "malformed"),
    ("hello, this is a shopping list", "neither a convcheck fingerprint"),
])
def test_unparsable_input_is_a_one_line_usage_error(tmp_path, content, match):
    path = tmp_path / "input"
    path.write_text(content)
    with pytest.raises(UsageError, match=match) as exc:
        load(path)
    assert "\n" not in str(exc.value)


def test_missing_file_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="cannot read"):
        load(tmp_path / "nope.json")
