"""collect_env text as people paste and save it, and the GPUs of real (old) bug reports."""

from __future__ import annotations

import codecs
from pathlib import Path

import pytest

from convcheck.env import audit, load
from convcheck.env.collect_env import split_reports
from convcheck.env.loading import MAX_BYTES, decode_text, loads
from convcheck.env.tables import capability_from_name, parse_version
from convcheck.errors import UsageError
from tests.reliability.conftest import DATA, run_cli

H200 = Path(__file__).parents[2].parent / "shared" / "gpu-runs" / "h200-2026-11-30" / "collect_env.txt"

REPORT = """Collecting environment information...
PyTorch version: 2.4.0+cu121
Is debug build: False
CUDA used to build PyTorch: 12.1
ROCM used to build PyTorch: N/A

OS: Ubuntu 22.04.4 LTS (x86_64)
Python version: 3.10.12 (main) [GCC 11.4.0] (64-bit runtime)
Is CUDA available: True
CUDA runtime version: 12.1.105
GPU models and configuration:
GPU 0: NVIDIA A100-SXM4-80GB
GPU 1: NVIDIA A100-SXM4-80GB

Nvidia driver version: 535.104.05
cuDNN version: Could not collect

Versions of relevant libraries:
[pip3] nvidia-cudnn-cu12==8.9.2.26
[pip3] torch==2.4.0
"""


def _facts(fp):
    return (fp.torch.version, fp.torch.cuda, fp.driver.version, [(g.index, g.name, g.capability) for g in fp.gpus],
            fp.torch.cudnn_version)


EXPECTED = ("2.4.0+cu121", "12.1", "535.104.05",
            [(0, "NVIDIA A100-SXM4-80GB", (8, 0)), (1, "NVIDIA A100-SXM4-80GB", (8, 0))], 8902)


@pytest.mark.parametrize("variant, data", [
    ("utf-8", REPORT.encode()),
    ("crlf", REPORT.replace("\n", "\r\n").encode()),
    ("cr", REPORT.replace("\n", "\r").encode()),
    ("utf-8-bom", codecs.BOM_UTF8 + REPORT.encode()),
    ("utf-16-le-bom (PowerShell >)", codecs.BOM_UTF16_LE + REPORT.replace("\n", "\r\n").encode("utf-16-le")),
    ("utf-16-be-bom", codecs.BOM_UTF16_BE + REPORT.encode("utf-16-be")),
    ("utf-16-le without bom", REPORT.encode("utf-16-le")),
    ("utf-32", REPORT.encode("utf-32")),
    ("full-width colons", REPORT.replace(":", "\uff1a").encode()),
    ("full-width colons, no space", REPORT.replace(": ", "\uff1a").encode()),
    ("non-breaking spaces", REPORT.replace(" ", "\u00a0").encode()),
    ("quoted in an e-mail", "".join("> " + line for line in REPORT.splitlines(True)).encode()),
    ("in a markdown fence", ("```\n" + REPORT + "```\n").encode()),
    ("key case and spacing", REPORT.replace("Nvidia driver version:", "NVIDIA driver version :").encode()),
])
def test_pasted_text_reads_the_same(variant, data):
    fp = loads(data, name="report.txt")
    assert _facts(fp) == EXPECTED, variant
    assert not [n for n in fp.notes if "reports one after" in n]


def test_full_width_colons_no_phantom_gpu():
    fp = loads("PyTorch version\uff1a2.4.0\nIs CUDA available\uff1aTrue\nGPU models and configuration\uff1a"
               "GPU 0\uff1aNVIDIA GeForce RTX 3090\nNvidia driver version\uff1a550.54.14\n")
    assert [(g.index, g.name) for g in fp.gpus] == [(0, "NVIDIA GeForce RTX 3090")]
    assert fp.driver.version == "550.54.14"


def test_two_reports_pasted_together_take_the_first_and_say_so():
    other = REPORT.replace("A100-SXM4-80GB", "GeForce RTX 4090").replace("535.104.05", "550.54.14")
    fp = loads((REPORT + "\n" + other).encode())
    assert _facts(fp) == EXPECTED  # no duplicate GPUs, not the second machine's driver
    assert any("2 collect_env reports" in n and "first" in n for n in fp.notes)
    assert len(split_reports(REPORT + other + other)) == 3
    # without the 'Collecting environment information' header line as well
    bare = REPORT.replace("Collecting environment information...\n", "")
    assert len(split_reports(bare + bare)) == 2


def test_missing_sections_are_not_available():
    fp = loads(b"PyTorch version: 1.13.1\nIs CUDA available: False\n")
    assert fp.torch.version == "1.13.1" and fp.gpus == () and fp.driver.version is None
    assert fp.torch.cuda is None and fp.torch.cudnn_version is None
    audit(fp)


def test_the_real_h200_report():
    if not H200.exists():
        pytest.skip("the shared H200 run folder is not present")
    fp = load(H200)
    assert [(g.index, g.name, g.capability) for g in fp.gpus] == [(0, "NVIDIA H200", (9, 0))]
    assert fp.driver.version == "580.159.04" and fp.torch.version == "2.11.0+cu130"
    assert fp.torch.cudnn_version == 91900 and fp.torch.cublas_version == "13.1.0.3"
    notes = [n for n in fp.notes if n.startswith("cuDNN:")]
    assert len(notes) == 1
    assert "system cuDNN 9.14.0" in notes[0] and "cuDNN 9.19.0" in notes[0] and "nvidia-cudnn-cu13" in notes[0]


def test_the_cudnn_note_is_shown(capsys):
    if not H200.exists():
        pytest.skip("the shared H200 run folder is not present")
    code, out, err = run_cli(capsys, ["env", "--from", str(H200)])
    assert code == 0 and err == ""
    text = " ".join(out.split())
    assert "note cuDNN: collect_env lists system cuDNN 9.14.0 files, but torch loads cuDNN 9.19.0" in text


def test_no_cudnn_note_when_they_agree_or_one_is_missing():
    same = REPORT.replace("cuDNN version: Could not collect", "cuDNN version: /usr/lib/libcudnn.so.8.9.2")
    assert not [n for n in loads(same).notes if n.startswith("cuDNN:")]
    assert not [n for n in loads(REPORT).notes if n.startswith("cuDNN:")]


def test_the_old_conda_report_gets_the_note():
    fp = load(DATA / "collect_env_torch1.7.1_cu110_titanxp.txt")
    note = next(n for n in fp.notes if n.startswith("cuDNN:"))
    assert "system cuDNN 7 files" in note and "cuDNN 8.0.5 from the conda pytorch build" in note


LEGACY = [
    ("GeForce 210", (1, 2)), ("GeForce GT 220", (1, 2)), ("GeForce 8800 GTX", (1, 0)), ("GeForce 9800 GT", (1, 1)),
    ("GeForce GTX 285", (1, 3)), ("Tesla C1060", (1, 3)), ("GeForce GTX 480", (2, 0)), ("Tesla C2050", (2, 0)),
    ("GeForce GTX 460", (2, 1)), ("GeForce GTX 560 Ti", (2, 1)), ("GeForce GTX 680", (3, 0)),
    ("Quadro K2000", (3, 0)), ("Tesla K20Xm", (3, 5)), ("GeForce GT 730", (3, 5)), ("Tesla K80", (3, 7)),
    ("GeForce GTX 750 Ti", (5, 0)), ("GeForce GTX 960M", (5, 0)), ("GeForce GTX 970M", (5, 2)),
    ("GeForce GTX TITAN X", (5, 2)), ("GeForce GTX 1070", (6, 1)), ("NVIDIA GeForce GTX 1070 with Max-Q Design",
                                                                    (6, 1)),
    ("NVIDIA TITAN X (Pascal)", (6, 1)), ("Tesla P100-PCIE-16GB", (6, 0)), ("NVIDIA GeForce RTX 2050", (8, 6)),
    ("NVIDIA GeForce RTX 2080 Ti", (7, 5)), ("NVIDIA RTX 4000 SFF Ada Generation", (8, 9)),
    ("NVIDIA H200", (9, 0)), ("NVIDIA GeForce RTX 5090", (12, 0)), ("Orin", (8, 7)),
]


@pytest.mark.parametrize("name, cc", LEGACY, ids=[n for n, _ in LEGACY])
def test_gpu_names_back_to_the_tesla_architecture(name, cc):
    assert capability_from_name(name) == cc


def test_a_geforce_210_report_gets_the_arch_finding():
    text = REPORT.replace("2.4.0+cu121", "1.7.1").replace("CUDA used to build PyTorch: 12.1",
                                                          "CUDA used to build PyTorch: 10.2")
    text = text.replace("GPU 0: NVIDIA A100-SXM4-80GB\nGPU 1: NVIDIA A100-SXM4-80GB", "GPU 0: GeForce 210")
    fp = loads(text)
    assert fp.gpus[0].capability == (1, 2)
    ids = {f.id for f in audit(fp) if f.severity == "critical"}
    assert "ARCH001" in ids


def test_decode_text_guesses_utf16_without_a_bom():
    assert decode_text("PyTorch version: 2.4".encode("utf-16-be")) == "PyTorch version: 2.4"
    assert decode_text(b"\xff\xfe") == ""
    assert "\ufffd" in decode_text(b"caf\xe9")  # Latin-1 bytes: replaced, not an error


def test_size_limit_is_checked_before_parsing():
    with pytest.raises(UsageError, match="larger than"):
        loads(b"x" * (MAX_BYTES + 1))


def test_versions_beyond_reason_are_no_versions():
    assert parse_version("5" * 5000) is None and parse_version("580.159.04") == (580, 159, 4)
    fp = loads(REPORT.replace("535.104.05", "9" * 5000))
    audit(fp)  # a 5000-digit driver in a pasted text is kept as text, and no rule breaks on it
