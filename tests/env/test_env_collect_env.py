"""collect_env texts, old and new formats, audited as a maintainer would read them.

The fixtures follow real reports:
- collect_env_old_torch1.3.1_titanxp.txt: pytorch/pytorch#30071 (torch 1.3 cannot see 8 TITAN Xp on
  driver 410.48); the pip lines after the quoted excerpt were completed.
- collect_env_torch1.7.1_cu110_titanxp.txt: pytorch/pytorch#52515 (torch.bmm all zeros with the CUDA 11.0
  build on TITAN Xp); the conda lines after the quoted excerpt were completed.
- collect_env_new_torch2.4.0_cu121_wsl.txt: the sample output in vllm-project/vllm#9293 (RTX 4070 Laptop
  on WSL2); the CPU block and library lines were completed.
- collect_env_new_torch2.6.0_cu124_rtx5090.txt: the torch 2.6 format, for the setup of
  pytorch/pytorch#150733 (RTX 5090 D with a cu124 wheel).
"""

from __future__ import annotations

from pathlib import Path

from convcheck.env import audit, load
from convcheck.env.collect_env import looks_like_collect_env, parse_collect_env, parse_sections

DATA = Path(__file__).parents[1] / "data" / "env"


def ids(fp):
    return {f.id: f.severity for f in audit(fp)}


def test_old_format_parses():
    fp = load(DATA / "collect_env_old_torch1.3.1_titanxp.txt")
    assert fp.source.startswith("collect_env text")
    assert fp.torch.version == "1.3.1" and fp.torch.cuda == "10.1" and fp.torch.cuda_available is False
    assert fp.torch.debug is False and fp.host.os == "Ubuntu 16.04.4 LTS" and fp.host.python == "3.6"
    assert fp.driver.version == "410.48" and fp.torch.cudnn_version is None
    assert len(fp.gpus) == 8 and {g.name for g in fp.gpus} == {"TITAN Xp"}
    assert fp.gpus[7].index == 7 and fp.gpus[0].capability == (6, 1)
    assert fp.gpus[0].capability_source == "name table"
    assert fp.math.recorded is False


def test_real_report_driver_too_old_is_found():
    """#30071: 'torch.cuda.is_available() false' -- driver 410.48 is below CUDA 10.1's 418.39."""
    found = ids(load(DATA / "collect_env_old_torch1.3.1_titanxp.txt"))
    assert found == {"DRV001": "critical", "CUDA002": "warn"}


def test_real_report_cublas_zeros_on_pascal_is_found():
    """#52515: CUDA 11.0 build on TITAN Xp returns zeros -- the cuBLAS rule names it, nothing else is critical."""
    fp = load(DATA / "collect_env_torch1.7.1_cu110_titanxp.txt")
    assert fp.torch.cuda == "11.0" and fp.torch.cudnn_version == 8005  # from the conda build string
    assert fp.torch.arch_list and fp.torch.arch_list_source.startswith("inferred")
    found = ids(fp)
    assert found.get("BLAS001") == "critical"
    assert [k for k, v in found.items() if v == "critical"] == ["BLAS001"]


def test_new_format_parses():
    fp = load(DATA / "collect_env_new_torch2.4.0_cu121_wsl.txt")
    assert fp.torch.version == "2.4.0+cu121" and fp.torch.cuda == "12.1" and fp.torch.cuda_available is True
    assert fp.host.python == "3.12.3" and "WSL2" in fp.host.platform
    assert fp.host.cpu == "13th Gen Intel(R) Core(TM) i9-13950HX"
    assert fp.torch.cudnn_version == 90100 and "pip" in fp.torch.cudnn_source
    assert fp.torch.cublas_version == "12.1.3.1"
    (g,) = fp.gpus
    assert g.name == "NVIDIA GeForce RTX 4070 Laptop GPU" and g.capability == (8, 9)
    assert fp.driver.version == "551.88" and fp.on_windows_driver


def test_new_format_healthy_laptop_has_no_critical_or_warn():
    assert set(ids(load(DATA / "collect_env_new_torch2.4.0_cu121_wsl.txt")).values()) <= {"info"}


def test_new_format_rtx5090_without_sm120_is_critical():
    fp = load(DATA / "collect_env_new_torch2.6.0_cu124_rtx5090.txt")
    assert fp.gpus[0].capability == (12, 0) and "sm_120" not in fp.torch.arch_list
    assert ids(fp)["ARCH001"] == "critical"


def test_system_cudnn_used_when_no_package_pins_it():
    text = (DATA / "collect_env_new_torch2.6.0_cu124_rtx5090.txt").read_text()
    text = text.replace("[pip3] nvidia-cudnn-cu12==9.1.0.70\n", "")
    fp = parse_collect_env(text)
    assert fp.torch.cudnn_version == 90800 and "system" in fp.torch.cudnn_source
    assert any("78489" in n for n in fp.notes)
    dnn = [f for f in audit(fp) if f.id == "DNN003"]
    assert dnn and "system file" in dnn[0].message


def test_single_line_gpu_and_uuid_are_handled():
    text = """PyTorch version: 2.2.1+cu121
Is debug build: False
CUDA used to build PyTorch: 12.1
Is CUDA available: True
GPU models and configuration: GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-7c1e3a5b-9d2f-4a6c-8b0e-2f4a6c8e0b2d)
Nvidia driver version: 535.129.03
cuDNN version: Could not collect
"""
    fp = parse_collect_env(text)
    (g,) = fp.gpus
    assert g.name == "NVIDIA H100 80GB HBM3" and g.capability == (9, 0)
    assert g.uuid_hash and g.uuid_hash.startswith("uuid:") and "7c1e3a5b" not in str(fp.to_dict())


def test_source_builds_get_no_inferred_arch_list():
    text = "PyTorch version: 1.8.0a0+1606899\nCUDA used to build PyTorch: 11.1\nIs CUDA available: True\n"
    assert parse_collect_env(text).torch.arch_list is None


def test_cpu_only_report():
    text = """Collecting environment information...
PyTorch version: 2.5.1+cpu
Is debug build: False
CUDA used to build PyTorch: None
ROCM used to build PyTorch: N/A

OS: Ubuntu 22.04.2 LTS (x86_64)
Is CUDA available: False
CUDA runtime version: No CUDA
CUDA_MODULE_LOADING set to: N/A
GPU models and configuration: No CUDA
Nvidia driver version: No CUDA
cuDNN version: No CUDA
"""
    fp = parse_collect_env(text)
    assert fp.torch.cpu_only and fp.gpus == () and fp.driver.version is None
    assert audit(fp) == []


def test_detection():
    assert looks_like_collect_env((DATA / "collect_env_old_torch1.3.1_titanxp.txt").read_text())
    assert not looks_like_collect_env("PyTorch version: 2.0 but nothing else")
    sections = parse_sections("cuDNN version: Probably one of the following:\n/a/libcudnn.so.8.9.2\n\nOS: x")
    assert sections["cuDNN version"] == ["Probably one of the following:", "/a/libcudnn.so.8.9.2"]
    assert sections["OS"] == ["x"]


def test_keys_retyped_without_their_colon_are_read_only_before_a_version_or_yes_no():
    from convcheck.env.collect_env import fields_read

    text = ("PyTorch version 1.5.0\nCUDA used to build PyTorch 10.2\nIs CUDA available Yes\n"
            "OS Ubuntu 18.04\nCPU:\nArchitecture: x86_64\nCPU family: 6\nCPU(s) 16\n")
    sections = parse_sections(text)
    assert sections["PyTorch version"] == ["1.5.0"] and sections["Is CUDA available"][0] == "Yes"
    assert "OS" not in sections  # free text after a bare key is not a value
    assert sections["CPU"] == ["", "Architecture: x86_64", "CPU family: 6", "CPU(s) 16"]  # the CPU block stays whole
    assert fields_read(text) == ["PyTorch version", "CUDA used to build PyTorch", "Is CUDA available", "CPU"]
    assert looks_like_collect_env(text)
    assert not looks_like_collect_env("Os: Ubuntu\nPython version: 3.7\n")  # no torch field: not collect_env


def test_every_report_says_which_fields_it_read():
    fp = load(DATA / "collect_env_old_torch1.3.1_titanxp.txt")
    (note,) = [n for n in fp.notes if n.startswith("fields read")]
    assert note == ("fields read from the text (11): PyTorch version, Is debug build, CUDA used to build PyTorch, "
                    "OS, GCC version, Python version, Is CUDA available, CUDA runtime version, GPU models and "
                    "configuration, Nvidia driver version, Versions of relevant libraries")  # 'Could not collect': not read
