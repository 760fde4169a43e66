"""The collector: this machine for real, and fake torch modules for the APIs this machine lacks."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

from convcheck.env import audit, collect


class _NoNVML:
    """An NVML whose library is missing, as on a machine without a driver."""

    class NVMLError(Exception):
        value = 12

    NVML_ERROR_LIBRARY_NOT_FOUND = 12

    def nvmlInit(self):
        raise self.NVMLError()


class _RaisingTF32:
    """Mixing the old and new TF32 APIs can make the old getter raise (FACTS: read defensively)."""

    @property
    def allow_tf32(self):
        raise RuntimeError("you have used the old and new fp32 precision APIs together")

    fp32_precision = "tf32"
    allow_fp16_reduced_precision_reduction = True
    allow_bf16_reduced_precision_reduction = True


def fake_cuda_torch(cudnn_runtime=(9, 1, 0), cudnn_compiled=(9, 1, 0), matmul=None):
    """A CUDA build of torch on an A100, as far as the collector looks at it."""

    def cudnn_version():
        if cudnn_runtime[0] != cudnn_compiled[0]:
            raise RuntimeError("cuDNN version incompatibility")
        return cudnn_runtime[0] * 10000 + cudnn_runtime[1] * 100 + cudnn_runtime[2]

    return SimpleNamespace(
        __version__="2.5.1+cu124",
        version=SimpleNamespace(cuda="12.4", hip=None, debug=False),
        cuda=SimpleNamespace(
            is_available=lambda: True, device_count=lambda: 1,
            get_arch_list=lambda: ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"],
            get_device_name=lambda i: "NVIDIA A100-SXM4-40GB", get_device_capability=lambda i: (8, 0),
        ),
        backends=SimpleNamespace(
            cuda=SimpleNamespace(matmul=matmul or SimpleNamespace(
                allow_tf32=False, fp32_precision="ieee", allow_fp16_reduced_precision_reduction=True,
                allow_bf16_reduced_precision_reduction=True)),
            cudnn=SimpleNamespace(version=cudnn_version, allow_tf32=True, enabled=True, benchmark=True,
                                  deterministic=False, conv=SimpleNamespace(fp32_precision="tf32")),
            cpu=SimpleNamespace(get_cpu_capability=lambda: "AVX2"),
        ),
        _C=SimpleNamespace(_cudnn=SimpleNamespace(getCompileVersion=lambda: cudnn_compiled,
                                                 getRuntimeVersion=lambda: cudnn_runtime)),
        get_float32_matmul_precision=lambda: "highest",
        are_deterministic_algorithms_enabled=lambda: False,
        is_deterministic_algorithms_warn_only_enabled=lambda: False,
    )


def test_this_machine_is_cpu_only_and_quick():
    start = time.perf_counter()
    fp = collect()
    assert time.perf_counter() - start < 10
    assert fp.torch.version and fp.torch.cpu_only  # the CPU build this suite runs on
    assert fp.gpus == () and fp.driver.version is None and fp.driver.nvml_error
    assert fp.host.python and fp.math.recorded and fp.math.float32_matmul_precision == "highest"
    assert not [f for f in audit(fp) if f.severity != "info"]


def test_gpu_found_through_torch_when_nvml_is_missing():
    fp = collect(nvml=_NoNVML(), torch_module=fake_cuda_torch(), environ={})
    (g,) = fp.gpus
    assert g.name == "NVIDIA A100-SXM4-40GB" and g.capability == (8, 0) and g.capability_source == "torch"
    assert fp.torch.cuda == "12.4" and fp.torch.cudnn_version == 90100 and fp.torch.cpu_capability == "AVX2"
    assert fp.math.cudnn_benchmark is True
    assert {"DET001", "MATH001"} <= {f.id for f in audit(fp)}


def test_cudnn_mismatch_is_read_even_though_torch_raises():
    fp = collect(nvml=_NoNVML(), torch_module=fake_cuda_torch(cudnn_runtime=(8, 9, 2)), environ={})
    assert fp.torch.cudnn_version == 8902 and fp.torch.cudnn_compile_version == 90100
    assert "DNN001" in {f.id for f in audit(fp)}


def test_new_tf32_api_read_when_the_old_getter_raises():
    fp = collect(nvml=_NoNVML(), torch_module=fake_cuda_torch(matmul=_RaisingTF32()), environ={})
    assert fp.math.matmul_allow_tf32 is None and fp.math.matmul_fp32_precision == "tf32"
    tf32 = [f for f in audit(fp) if f.id == "MATH001"]
    assert tf32 and tf32[0].severity == "warn" and "matmul" in tf32[0].message


def test_environment_variables_are_read_from_the_given_environ():
    fp = collect(nvml=_NoNVML(), torch_module=fake_cuda_torch(),
                 environ={"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVIDIA_TF32_OVERRIDE": "0"})
    assert fp.math.cublas_workspace_config == ":4096:8" and fp.math.nvidia_tf32_override == "0"
    assert "MATH001" not in {f.id for f in audit(fp)}


def test_a_torch_that_raises_everywhere_still_gives_a_fingerprint():
    class Exploding:
        def __getattr__(self, name):
            raise RuntimeError(f"broken torch: {name}")

    fp = collect(nvml=_NoNVML(), torch_module=Exploding(), environ={})
    assert fp.torch.version is None and fp.math.matmul_allow_tf32 is None
    audit(fp)  # and the rules cope with all-None


def test_importing_convcheck_loads_neither_pynvml_nor_torch_for_env():
    code = ("import sys, convcheck, convcheck.env; "
            "print('pynvml' in sys.modules, 'convcheck.env.collector' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
