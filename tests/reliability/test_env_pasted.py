"""collect_env reports as they reach a bug tracker: retyped, edited, cut short (issue 27, item 5).

Each once read as "neither a convcheck fingerprint JSON nor collect_env output", or audited with no finding:
a report is recognised by its fields, not its first lines; GPUs older than the wheel table (compute
capability 1.x) are named; torch's own warning in the text is driver evidence."""

from __future__ import annotations

import json

import pytest

from convcheck.env import audit
from convcheck.env.loading import loads
from tests.reliability.conftest import TINY, bad, run_cli

# Retyped into an issue by hand: no 'Collecting environment information...' line, 'PyTorch version' without
# its colon, 'Os:' for 'OS:', full-width colons in the GPU lines (a CJK input method).
EDITED = """PyTorch version 1.5.0
Is debug build: No
CUDA used to build PyTorch: 10.2

Os: Ubuntu 18.04.4 LTS
Python version: 3.7
Is CUDA available: Yes
CUDA runtime version: 10.2.89
GPU models and configuration\uff1a
GPU 0\uff1aGeForce GTX 1080 Ti
GPU 1\uff1aGeForce GTX 1080 Ti
Nvidia driver version: 440.33.01
cuDNN version: 7.6.5
"""

# Cut short after the first lines; torch's warning, printed when collect_env asks torch.cuda.is_available(),
# is the only word about the driver.
TRUNCATED = """/home/me/.local/lib/python3.8/site-packages/torch/cuda/__init__.py:83: UserWarning: CUDA initialization: \
The NVIDIA driver on your system is too old (found version 11040). Please update your GPU driver by downloading \
and installing a new version from the URL: http://www.nvidia.com/Download/index.aspx Alternatively, go to: \
https://pytorch.org to install a PyTorch version that has been compiled with your version of the CUDA driver. \
(Triggered internally at  ../c10/cuda/CUDAFunctions.cpp:109.)
  return torch._C._cuda_getDeviceCount() > 0
PyTorch version: 2.0.1+cu117
Is debug build: False
CUDA used to build PyTorch: 11.7
"""


def test_a_hand_edited_report_is_read_and_says_which_fields(capsys, tmp_path):
    fp = loads(EDITED, name="issue.txt")
    assert fp.torch.version == "1.5.0" and fp.torch.cuda == "10.2" and fp.torch.cuda_available is True
    assert fp.host.os == "Ubuntu 18.04.4 LTS" and fp.driver.version == "440.33.01"
    assert [(g.index, g.name, g.capability) for g in fp.gpus] == [(0, "GeForce GTX 1080 Ti", (6, 1)),
                                                                  (1, "GeForce GTX 1080 Ti", (6, 1))]
    (tmp_path / "issue.txt").write_text(EDITED)
    code, out, err = run_cli(capsys, ["env", "--from", str(tmp_path / "issue.txt")])
    assert code == 0 and err == "", err
    text = " ".join(out.split())
    assert "fields read from the text (10): PyTorch version, Is debug build, CUDA used to build PyTorch, OS," in text


def test_text_with_too_few_fields_is_refused_saying_what_was_read(capsys, tmp_path):
    (tmp_path / "note.txt").write_text("We use PyTorch version 2.1 on our cluster.\nOs: Rocky 9\n")
    code, _, err = run_cli(capsys, ["env", "--from", str(tmp_path / "note.txt")])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "neither a convcheck fingerprint JSON nor" in lines[0] and "fields read: OS" in lines[0]


@pytest.mark.parametrize("name, cc", [("GeForce 210", (1, 2)), ("GeForce 8800 GTX", (1, 0)),
                                      ("GeForce 9800 GT", (1, 1)), ("GeForce GT 220", (1, 2))])
@pytest.mark.parametrize("cuda", ["9.2", "10.1"])
def test_gpus_older_than_the_wheel_table_get_an_architecture_finding(name, cc, cuda):
    """torch 1.5/1.4 wheels for CUDA 9.2 and 10.1 are not in the wheel table (no arch list inferred): the
    GPU's capability alone against what the CUDA major supports."""
    text = EDITED.replace("10.2", cuda).replace("10.2.89", cuda).replace(
        "GPU 0\uff1aGeForce GTX 1080 Ti\nGPU 1\uff1aGeForce GTX 1080 Ti", f"GPU 0\uff1a{name}")
    fp = loads(text)
    assert fp.torch.arch_list is None and fp.gpus[0].capability == cc
    arch = [f for f in audit(fp) if f.id.startswith("ARCH")]
    assert [(f.id, f.severity) for f in arch] == [("ARCH003", "critical")]
    assert name in arch[0].message and f"compute capability {cc[0]}.{cc[1]}" in arch[0].message
    assert "No CUDA a torch wheel was built with" in arch[0].remedy  # not 'a wheel built with CUDA 9.x'


def test_torch_s_driver_warning_in_a_truncated_report_is_a_driver_finding():
    fp = loads(TRUNCATED)
    assert fp.driver.version is None and fp.driver.cuda_version == "11.4"
    found = {f.id: f for f in audit(fp)}
    assert found["DRV004"].severity == "critical"
    assert "found version 11040" in found["DRV004"].message and "CUDA up to 11.4" in found["DRV004"].message
    assert "DRV002" not in found  # not 'minor-version compatibility': torch said CUDA cannot start
    # a CUDA 12 wheel on that driver: the versions say it already (DRV001), once
    ids = [f.id for f in audit(loads(TRUNCATED.replace("11.7", "12.1").replace("cu117", "cu121")))]
    assert "DRV001" in ids and "DRV004" not in ids


def test_torch_s_driver_warning_reaches_the_verdict(capsys, tmp_path):
    (tmp_path / "report.txt").write_text(TRUNCATED)
    code, out, _ = run_cli(capsys, ["compare", "--model", bad("good"), *TINY, "--no-save", "--json",
                                    "--env", str(tmp_path / "report.txt")])
    verdict = json.loads(out)["verdict"]
    assert code == 1 and verdict["sub_cause"] == "DRV004" and verdict["headline"].startswith("DRV004 (critical)")
