"""Property tests (hypothesis): whatever text or JSON the env readers get, they return a fingerprint
or raise a ConvcheckError, and the audit and the report of what they return never raise."""

from __future__ import annotations

import codecs
import json

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from convcheck.env import SCHEMA, audit  # noqa: E402
from convcheck.env.collect_env import _KEYS  # noqa: E402
from convcheck.env.fingerprint import GPU, Driver, Host, MathFlags, TorchBuild  # noqa: E402
from convcheck.env.loading import loads  # noqa: E402
from convcheck.errors import ConvcheckError  # noqa: E402
from convcheck.report.env_text import render_env  # noqa: E402

# database=None: no .hypothesis folder is left in the repository
SETTINGS = settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def _survives(data) -> None:
    """The property: a fingerprint (audited and rendered without error) or a ConvcheckError."""
    try:
        fp = loads(data, name="input")
    except ConvcheckError as exc:
        assert "\n" not in str(exc)
        return
    findings = audit(fp)
    render_env(fp, findings)
    json.dumps(fp.to_dict())


# --- collect_env text -------------------------------------------------------------------------

_VALUES = st.one_of(
    st.sampled_from(["", "N/A", "Could not collect", "True", "False", "No", "2.4.0+cu121", "1.7.1", "12.1",
                     "10.2.89", "535.104.05", "9" * 60, "GPU 0: NVIDIA A100-SXM4-80GB", "GPU 0: GeForce 210",
                     "GPU 12: Tesla K80", "/usr/lib/libcudnn.so.8.9.2", "libcudnn.so.9999999999.1",
                     "cudnn64_8.dll", "[pip3] nvidia-cudnn-cu12==9.1.0.70", "[conda] pytorch 1.7.1 "
                     "py3.8_cuda11.0.221_cudnn8.0.5_0 pytorch", "Model name: Xeon", "Microsoft Windows 11"]),
    st.text(max_size=40),
)
_COLONS = st.sampled_from([":", ": ", "\uff1a", " : ", "\ufe55 ", ""])
_ENDINGS = st.sampled_from(["\n", "\r\n", "\r", "\n\n"])


@st.composite
def collect_env_texts(draw):
    lines = []
    for _ in range(draw(st.integers(0, 25))):
        key = draw(st.sampled_from(_KEYS + ("GPU 0", "GPU 1", "[pip3] torch", "Collecting environment information")))
        prefix = draw(st.sampled_from(["", "> ", "  ", "```"]))
        lines.append(f"{prefix}{key}{draw(_COLONS)}{draw(_VALUES)}")
    ending = draw(_ENDINGS)
    return ending.join(lines)


@st.composite
def encoded(draw, texts):
    text = draw(texts)
    encoding = draw(st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "latin-1"]))
    try:
        data = text.encode(encoding)
    except UnicodeEncodeError:
        data = text.encode("utf-8")
    if draw(st.booleans()):  # cut anywhere: a truncated paste or download
        data = data[: draw(st.integers(0, len(data)))]
    return data


@SETTINGS
@given(st.text(max_size=400))
def test_any_text(text):
    _survives(text)


@SETTINGS
@given(st.binary(max_size=400))
def test_any_bytes(data):
    _survives(data)


@SETTINGS
@given(encoded(collect_env_texts()))
def test_collect_env_like_text(data):
    _survives(data)


@SETTINGS
@given(collect_env_texts(), collect_env_texts())
def test_concatenated_reports(first, second):
    _survives("PyTorch version: 2.4.0\nIs CUDA available: True\n" + first + "\nPyTorch version: 1.0\n" + second)


def test_a_utf16_report_with_bom_is_read():
    text = "PyTorch version: 2.4.0\r\nIs CUDA available: True\r\nGPU models and configuration: GPU 0: GeForce 210\r\n"
    fp = loads(codecs.BOM_UTF16_LE + text.encode("utf-16-le"))
    assert fp.gpus[0].capability == (1, 2)


# --- fingerprint JSON ------------------------------------------------------------------------------

_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
              st.text(max_size=20)),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**66, 2**66), st.floats(), st.text(max_size=12),
                     st.sampled_from(["12.4", "550.54.14", "8.0", "sm_90", "9" * 120, "2.4.0+cu121", "x.y"]),
                     st.lists(st.one_of(st.integers(-5, 120), st.text(max_size=6)), max_size=3))


def _section(cls):
    names = [f.name for f in cls.__dataclass_fields__.values()]
    return st.dictionaries(st.sampled_from(names), _SCALARS, max_size=6)


@st.composite
def fingerprint_json(draw):
    d = {"schema": SCHEMA}
    for key, cls in (("host", Host), ("torch", TorchBuild), ("driver", Driver), ("math", MathFlags)):
        if draw(st.booleans()):
            d[key] = draw(st.one_of(_section(cls), _JSON))
    if draw(st.booleans()):
        d["gpus"] = draw(st.one_of(st.lists(_section(GPU), max_size=3), _JSON))
    for key in ("source", "collected_at", "notes"):
        if draw(st.booleans()):
            d[key] = draw(_SCALARS)
    return d


@SETTINGS
@given(_JSON)
def test_any_json(value):
    _survives(json.dumps(value))
    if isinstance(value, dict):
        _survives(json.dumps({**value, "schema": SCHEMA}))


@SETTINGS
@given(fingerprint_json())
def test_fingerprint_json_with_any_field_values(d):
    _survives(json.dumps(d))


@SETTINGS
@given(st.lists(_section(GPU).map(lambda g: {k: v for k, v in g.items()
                                             if not isinstance(v, (list, str)) or k in ("name", "capability")}),
                max_size=3),
       _section(TorchBuild), _section(Driver))
def test_well_typed_values_are_audited(gpus, torch, driver):
    _survives(json.dumps({"schema": SCHEMA, "gpus": gpus, "torch": torch, "driver": driver}))
