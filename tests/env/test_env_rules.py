"""Audit rules on recorded machines: every rule fires on one and stays quiet on another.

The fixtures in tests/data/env/ are fingerprints of realistic machines; the
variations below change one field each, so a case reads as "this machine,
but with X".
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from convcheck.env import RULE_IDS, Driver, Finding, Fingerprint, TorchBuild, audit, load

DATA = Path(__file__).parents[1] / "data" / "env"


def fx(name: str) -> Fingerprint:
    return load(DATA / name)


def gpu(fp: Fingerprint, **kw) -> Fingerprint:
    return replace(fp, gpus=(replace(fp.gpus[0], **kw),) + fp.gpus[1:])


def math(fp: Fingerprint, **kw) -> Fingerprint:
    return replace(fp, math=replace(fp.math, **kw))


def torch_(fp: Fingerprint, **kw) -> Fingerprint:
    return replace(fp, torch=replace(fp.torch, **kw))


def driver(fp: Fingerprint, **kw) -> Fingerprint:
    return replace(fp, driver=replace(fp.driver, **kw))


def dispatch(fp: Fingerprint, **kw) -> Fingerprint:
    return replace(fp, dispatch=replace(fp.dispatch, recorded=True, **kw))


H100 = "h100_healthy.json"
A100 = "a100_tf32.json"
CPU_ONLY_HERE = Fingerprint(torch=TorchBuild(version="2.13.0+cpu"), driver=Driver(nvml_error="NVML library not found"))

# (rule id, expected severity, the machine) -- the rule must fire with that severity
FIRES = [
    # issue 36: the dispatch the math-mode flags do not show
    ("SDP001", "warn", lambda: dispatch(torch_(fx(H100), version="2.5.0+cu124"), sdpa_cudnn=True,
                                        sdpa_dispatched="cudnn", sdpa_probe="cuda float16 (2, 4, 128, 64)")),
    ("TRI001", "info", lambda: dispatch(torch_(fx(H100), version="2.7.0+cu128"), triton="3.3.0 (triton)")),
    ("VAR001", "warn", lambda: dispatch(fx(H100), env=("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1",))),
    ("VAR002", "info", lambda: dispatch(fx(H100), env=("NCCL_ALGO=Tree", "NCCL_DEBUG=INFO"))),
    ("DRV001", "critical", lambda: fx("driver470_cu121.json")),
    ("DRV001", "critical", lambda: driver(fx(A100), version=None, cuda_version="11.8")),  # NVML's CUDA only
    ("DRV001", "critical", lambda: load(DATA / "collect_env_old_torch1.3.1_titanxp.txt")),
    # Windows driver numbering without a table entry for CUDA 13: NVML's CUDA version decides
    ("DRV001", "critical", lambda: driver(replace(torch_(fx(H100), cuda="13.0"),
                                                  host=replace(fx(H100).host, os="Microsoft Windows 11 Pro")),
                                          version="576.02", cuda_version="12.9")),
    ("DRV002", "warn", lambda: driver(fx(A100), version="525.85.12")),  # >= 12.x floor, < 12.1's 530.30.02
    ("DRV002", "warn", lambda: driver(fx(A100), version=None, cuda_version="12.0")),
    ("DRV003", "critical", lambda: replace(fx(H100), driver=Driver(nvml_error="mismatch", rm_mismatch=True))),
    # a pasted report cut short: torch's own warning is the only driver evidence
    ("DRV004", "critical", lambda: replace(torch_(fx(H100), cuda="11.7"), driver=Driver(torch_warning="The NVIDIA driver on your system is too old (found version 11040)", cuda_version="11.4"))),
    ("DRV004", "critical", lambda: replace(torch_(fx(H100), cuda=None), driver=Driver(torch_warning="The NVIDIA driver on your system is too old (found version 11040)"))),
    ("ARCH001", "critical", lambda: fx("rtx3090_cu102.json")),
    ("ARCH001", "critical", lambda: fx("rtx5090_cu124.json")),
    ("ARCH001", "critical", lambda: load(DATA / "collect_env_new_torch2.6.0_cu124_rtx5090.txt")),
    ("ARCH001", "critical", lambda: gpu(fx(A100), capability=(8, 7))),  # Jetson Orin: sm_80/sm_86 do not run
    ("ARCH002", "warn", lambda: torch_(fx("rtx5090_cu124.json"),
                                       arch_list=fx("rtx5090_cu124.json").torch.arch_list + ("compute_90",))),
    ("ARCH003", "critical", lambda: gpu(torch_(fx(H100), cuda="13.0"), name="GeForce GTX 1080 Ti",
                                        capability=(6, 1))),
    ("CUDA001", "critical", lambda: fx("cpu_build_with_gpu.json")),
    ("CUDA002", "warn", lambda: fx("driver470_cu121.json")),
    ("DNN001", "critical", lambda: torch_(fx(H100), cudnn_version=8902)),  # major differs
    ("DNN001", "critical", lambda: torch_(fx(H100), cudnn_version=90100)),  # older minor than compiled 9.7
    ("DNN002", "warn", lambda: torch_(fx(H100), cudnn_library="/usr/lib/x86_64-linux-gnu/libcudnn.so.9.7.1")),
    ("DNN003", "warn", lambda: torch_(fx(H100), cudnn_version=90800, cudnn_compile_version=90800)),
    ("DNN003", "critical", lambda: gpu(torch_(fx(H100), cudnn_version=91100, cudnn_compile_version=91100),
                                       name="Tesla V100-SXM2-16GB", capability=(7, 0))),
    ("BLAS001", "critical", lambda: load(DATA / "collect_env_torch1.7.1_cu110_titanxp.txt")),
    ("BLAS001", "warn", lambda: gpu(torch_(fx(H100), cuda="9.0"), name="GeForce GTX 1080", capability=(6, 1))),
    ("MATH001", "warn", lambda: fx(A100)),
    ("MATH001", "info", lambda: fx(H100)),  # conv TF32 is torch's default
    ("MATH001", "warn", lambda: math(fx(H100), matmul_allow_tf32=None, matmul_fp32_precision="tf32")),  # new API
    ("MATH001", "info", lambda: load(DATA / "collect_env_new_torch2.4.0_cu121_wsl.txt")),  # defaults assumed
    ("MATH002", "info", lambda: fx(H100)),
    ("MATH002", "warn", lambda: math(fx(H100), fp16_accumulation=True)),
    ("DET001", "warn", lambda: math(fx(H100), cudnn_benchmark=True)),
    ("DET002", "warn", lambda: math(fx(A100), deterministic_algorithms=True)),
    ("DET002", "warn", lambda: math(fx(A100), deterministic_algorithms=True, cublas_workspace_config=":8:4")),
    ("ECC001", "warn", lambda: gpu(fx(A100), ecc_enabled=False, ecc_pending=True)),
    ("ECC002", "critical", lambda: gpu(fx(H100), ecc_volatile_uncorrected=2, ecc_aggregate_uncorrected=2)),
    ("ECC002", "warn", lambda: gpu(fx(H100), ecc_aggregate_corrected=5)),
    ("MEM001", "critical", lambda: gpu(fx(H100), remap_failed=True, remapped_rows_uncorrectable=3)),
    ("MEM001", "warn", lambda: gpu(fx(H100), remap_pending=True)),
    ("MEM001", "warn", lambda: gpu(fx("driver470_cu121.json"), retired_pages_pending=True)),
    ("THR001", "warn", lambda: gpu(fx(H100), clock_event_reasons=0x40 | 0x20)),  # HW + SW thermal
    ("THR001", "warn", lambda: gpu(fx(H100), clock_event_reasons=0x80)),  # power brake
    ("THR001", "warn", lambda: gpu(fx(H100), temperature_c=91, temperature_slowdown_c=90)),
    ("PCI001", "warn", lambda: gpu(fx(H100), pcie_width=8)),
    ("PROBE001", "info", lambda: gpu(fx(H100), unreadable=("ECC mode: no permission",))),
]

# (rule id, the machine) -- the rule must stay quiet
QUIET = [
    ("SDP001", lambda: dispatch(torch_(fx(H100), version="2.5.1+cu124"), sdpa_cudnn=True)),  # moved last in 2.5.1
    ("SDP001", lambda: dispatch(torch_(fx(A100), version="2.5.0+cu124"), sdpa_cudnn=True)),  # not H100-class
    ("SDP001", lambda: dispatch(torch_(fx(H100), version="2.5.0+cu124"), sdpa_cudnn=False)),  # turned off
    ("TRI001", lambda: dispatch(torch_(fx(H100), version="2.8.0+cu128"), triton="3.4.0 (triton)")),
    ("TRI001", lambda: dispatch(torch_(fx(H100), version="2.7.0+cu128"), triton=None)),  # no Triton: no compile
    ("VAR001", lambda: dispatch(fx(H100), env=("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0",))),
    ("VAR002", lambda: dispatch(fx(H100), env=("NCCL_DEBUG=INFO",))),
    ("DRV001", lambda: fx(H100)),
    ("DRV001", lambda: load(DATA / "collect_env_torch1.7.1_cu110_titanxp.txt")),  # 450.51.05 is CUDA 11.0's min
    ("DRV001", lambda: load(DATA / "collect_env_new_torch2.4.0_cu121_wsl.txt")),  # Windows driver numbering
    ("DRV001", lambda: CPU_ONLY_HERE),
    ("DRV002", lambda: fx(A100)),
    ("DRV002", lambda: driver(fx(A100), version=None, cuda_version="12.2")),
    ("DRV003", lambda: fx(H100)),
    ("DRV004", lambda: fx(H100)),
    # DRV001 already says it from the driver's version: no second finding
    ("DRV004", lambda: driver(fx("driver470_cu121.json"), torch_warning="The NVIDIA driver on your system is too old (found version 11040)")),
    ("ARCH001", lambda: fx(H100)),
    ("ARCH001", lambda: gpu(fx(A100), name="NVIDIA L4", capability=(8, 9))),  # sm_86 code runs on 8.9
    ("ARCH001", lambda: load(DATA / "collect_env_new_torch2.4.0_cu121_wsl.txt")),
    ("ARCH001", lambda: CPU_ONLY_HERE),
    ("ARCH002", lambda: fx(H100)),
    ("ARCH002", lambda: fx("rtx5090_cu124.json")),  # no PTX at all: that is ARCH001
    ("ARCH003", lambda: fx(H100)),
    ("ARCH003", lambda: gpu(fx(A100), name="Tesla P100-PCIE-16GB", capability=(6, 0))),  # CUDA 12 keeps Pascal
    ("CUDA001", lambda: CPU_ONLY_HERE),  # CPU-only torch and no GPU: nothing wrong
    ("CUDA001", lambda: fx(H100)),
    ("CUDA002", lambda: fx(H100)),
    ("CUDA002", lambda: fx("cpu_build_with_gpu.json")),
    ("DNN001", lambda: fx(H100)),
    ("DNN001", lambda: torch_(fx(H100), cudnn_version=90800)),  # newer minor at runtime is fine
    ("DNN002", lambda: fx(H100)),
    ("DNN002", lambda: fx("rtx3090_cu102.json")),  # torch/lib inside a conda env
    ("DNN003", lambda: fx(H100)),  # 9.7.1
    ("DNN003", lambda: load(DATA / "collect_env_new_torch2.6.0_cu124_rtx5090.txt")),  # pip 9.1.0 beats system 9.8
    ("BLAS001", lambda: fx(H100)),
    ("BLAS001", lambda: load(DATA / "collect_env_old_torch1.3.1_titanxp.txt")),  # CUDA 10.1 on Pascal is fine
    ("MATH001", lambda: math(fx(H100), cudnn_allow_tf32=False)),
    ("MATH001", lambda: math(fx(A100), nvidia_tf32_override="0")),
    ("MATH001", lambda: fx("rtx3090_cu102.json")),  # allow_tf32 True, but CUDA 10.2 has no TF32
    ("MATH001", lambda: gpu(fx(A100), name="Tesla V100-SXM2-16GB", capability=(7, 0))),
    ("MATH001", lambda: math(fx(H100), cudnn_enabled=False)),  # conv TF32 needs cuDNN
    ("MATH002", lambda: math(fx(H100), fp16_reduced_precision_reduction=False,
                             bf16_reduced_precision_reduction=False)),
    ("MATH002", lambda: load(DATA / "collect_env_new_torch2.4.0_cu121_wsl.txt")),  # flags not recorded
    ("DET001", lambda: fx(H100)),
    ("DET002", lambda: fx(A100)),
    ("DET002", lambda: math(fx(A100), deterministic_algorithms=True, cublas_workspace_config=":4096:8")),
    ("DET002", lambda: math(torch_(fx(A100), version="2.13.0+cu130", cuda="13.0"), deterministic_algorithms=True)),
    ("ECC001", lambda: fx(A100)),
    ("ECC001", lambda: fx("rtx3090_cu102.json")),  # consumer card: ECC not supported (None)
    ("ECC002", lambda: fx(H100)),
    ("MEM001", lambda: fx(H100)),
    ("THR001", lambda: fx(H100)),
    ("THR001", lambda: gpu(fx(H100), clock_event_reasons=0x4 | 0x1)),  # SW power cap, idle: normal
    ("PCI001", lambda: fx(H100)),
    ("PCI001", lambda: fx("rtx3090_cu102.json")),  # gen 1 of 4 at x16: idle downclock, not a fault
    ("PROBE001", lambda: fx(H100)),
]


def _by_id(fp: Fingerprint, rule_id: str) -> list[Finding]:
    return [f for f in audit(fp) if f.id == rule_id]


@pytest.mark.parametrize("rule_id,severity,machine", FIRES, ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(FIRES)])
def test_rule_fires(rule_id, severity, machine):
    hits = _by_id(machine(), rule_id)
    assert hits, f"{rule_id} did not fire; got {[f.id for f in audit(machine())]}"
    assert hits[0].severity == severity
    assert hits[0].kind == RULE_IDS[rule_id]
    assert hits[0].message and hits[0].remedy and hits[0].source


@pytest.mark.parametrize("rule_id,machine", QUIET, ids=[f"{r}-{i}" for i, (r, _) in enumerate(QUIET)])
def test_rule_stays_quiet(rule_id, machine):
    assert not _by_id(machine(), rule_id)


def test_every_rule_has_a_firing_and_a_quiet_case():
    assert {r for r, _, _ in FIRES} == set(RULE_IDS)
    assert {r for r, _ in QUIET} == set(RULE_IDS)


def test_kinds_follow_the_verdict_they_can_support():
    assert RULE_IDS["DRV001"] == RULE_IDS["ARCH001"] == RULE_IDS["DNN003"] == RULE_IDS["BLAS001"] == "version"
    assert RULE_IDS["ECC002"] == RULE_IDS["MEM001"] == RULE_IDS["THR001"] == RULE_IDS["PCI001"] == "hardware"
    assert RULE_IDS["MATH001"] == "numerics" and RULE_IDS["DET001"] == "determinism"


def test_findings_are_sorted_critical_warn_info():
    fp = math(gpu(fx("driver470_cu121.json"), pcie_width=4), cudnn_benchmark=True)
    severities = [f.severity for f in audit(fp)]
    assert severities == sorted(severities, key=["critical", "warn", "info"].index)
    assert severities[0] == "critical" and "info" in severities


def test_messages_carry_the_numbers():
    drv = _by_id(fx("driver470_cu121.json"), "DRV001")[0]
    assert "470.223.02" in drv.message and "525.60.13" in drv.message and "12.1" in drv.message
    assert "530.30.02" in drv.remedy and "11.4" in drv.remedy  # what to install instead
    arch = _by_id(fx("rtx5090_cu124.json"), "ARCH001")[0]
    assert "12.0" in arch.message and "sm_90" in arch.message and "cu128" in arch.remedy
    tf32 = _by_id(fx(A100), "MATH001")[0]
    assert "0.0022" in tf32.message and "2^-11" in tf32.message


def test_healthy_h100_has_nothing_worse_than_info():
    assert all(f.severity == "info" for f in audit(fx(H100)))


def test_finding_is_frozen_and_serialisable():
    f = audit(fx("rtx5090_cu124.json"))[0]
    d = f.to_dict()
    assert set(d) == {"id", "severity", "kind", "message", "remedy", "source", "gpu"}
    with pytest.raises(Exception):
        f.severity = "info"  # type: ignore[misc]
