"""Version tables the audit rules read, each with the source it was taken from.

Only data and the small lookups that read it live here; the rules that judge a
fingerprint are in the ``rules`` package. When a table changes, change its source line
with it.
"""

from __future__ import annotations

import re

Version = tuple[int, ...]


def parse_version(text: str | None) -> Version | None:
    """'470.82.01' -> (470, 82, 1); '12.1' -> (12, 1); anything else -> None."""
    if not text:
        return None
    # At most 9 digits a part and 8 parts: a 5000-digit "version" is no version (and int() would refuse it).
    m = re.match(r"\s*(\d{1,9}(?:\.\d{1,9}){0,7})(?![\d])", str(text)[:200])
    if not m:
        return None
    return tuple(int(p) for p in m.group(1).split("."))


def format_version(v: Version | None) -> str:
    return "?" if v is None else ".".join(str(p) for p in v)


# --- CUDA toolkit -> minimum NVIDIA driver -----------------------------------

DRIVER_SOURCE = (
    "NVIDIA CUDA Toolkit release notes, 'CUDA Toolkit and Corresponding Driver "
    "Versions' (table 3) and 'CUDA minor version compatibility' (table 2)"
)

# (major, minor) -> minimum driver, Linux x86_64, for that toolkit's full feature set.
LINUX_MIN_DRIVER: dict[tuple[int, int], str] = {
    (9, 0): "384.81", (9, 1): "390.46", (9, 2): "396.26",
    (10, 0): "410.48", (10, 1): "418.39", (10, 2): "440.33",
    (11, 0): "450.51.05", (11, 1): "455.23", (11, 2): "460.27.03",
    (11, 3): "465.19.01", (11, 4): "470.42.01", (11, 5): "495.29.05",
    (11, 6): "510.39.01", (11, 7): "515.43.04", (11, 8): "520.61.05",
    (12, 0): "525.60.13", (12, 1): "530.30.02", (12, 2): "535.54.03",
    (12, 3): "545.23.06", (12, 4): "550.54.14", (12, 5): "555.42.02",
    (12, 6): "560.28.03", (12, 8): "570.26", (12, 9): "575.51.03",
    (13, 0): "580.65.06", (13, 1): "590.44.01",
}

# Windows x86_64 (also what WSL reports: the Windows host driver).
WINDOWS_MIN_DRIVER: dict[tuple[int, int], str] = {
    (9, 0): "385.54", (9, 1): "391.29", (9, 2): "397.44",
    (10, 0): "411.31", (10, 1): "418.96", (10, 2): "441.22",
    (11, 0): "451.48", (11, 1): "456.38", (11, 2): "460.82",
    (11, 3): "465.89", (11, 4): "471.11", (11, 5): "496.04", (11, 6): "511.23",
}

# Minor-version compatibility (CUDA 11 and later): any driver at or above the
# major's floor runs every minor of that major, with limited features and no
# PTX JIT. CUDA 10.x and older had no such mode.
LINUX_MAJOR_FLOOR: dict[int, str] = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
WINDOWS_MAJOR_FLOOR: dict[int, str] = {11: "452.39", 12: "528.33"}


def min_driver(cuda: Version, windows: bool = False) -> str | None:
    """Minimum driver for CUDA ``major.minor``; an unlisted minor takes the
    nearest listed minor below it of the same major."""
    table = WINDOWS_MIN_DRIVER if windows else LINUX_MIN_DRIVER
    major, minor = cuda[0], (cuda[1] if len(cuda) > 1 else 0)
    candidates = [k for k in table if k[0] == major and k[1] <= minor]
    return table[max(candidates)] if candidates else None


def major_floor(major: int, windows: bool = False) -> str | None:
    return (WINDOWS_MAJOR_FLOOR if windows else LINUX_MAJOR_FLOOR).get(major)


def newest_cuda_for_driver(driver: Version, windows: bool = False) -> tuple[int, int] | None:
    """The newest CUDA toolkit whose full feature set this driver supports."""
    table = WINDOWS_MIN_DRIVER if windows else LINUX_MIN_DRIVER
    ok = [k for k, v in table.items() if parse_version(v) <= driver]
    return max(ok) if ok else None


# --- GPU name -> compute capability ------------------------------------------
# The table (back to the Tesla architecture, with its source) lives in gpu_names.py.
from convcheck.env.gpu_names import CAPABILITY_SOURCE, capability_from_name  # noqa: E402,F401


# --- GPUs with fast float64 (a float64 judge on the GPU) ----------------------

FAST_FLOAT64_SOURCE = (
    "CUDA C++ Programming Guide, 'Arithmetic Instructions' throughput table: 64-bit floating-point "
    "add/multiply/fma results per clock per SM are half the 32-bit rate on compute capability 6.0, 7.0, "
    "8.0, 9.0 and 10.0 (P100, V100, A100, H100/H200, B200) and 1/32 to 1/64 of it on the others"
)
FAST_FLOAT64_CAPABILITIES = frozenset({(6, 0), (7, 0), (8, 0), (9, 0), (10, 0)})


def has_fast_float64(capability: tuple[int, int] | None) -> bool:
    """True for the data-centre GPUs whose float64 runs at half the float32 rate."""
    return capability is not None and tuple(capability) in FAST_FLOAT64_CAPABILITIES


# --- torch build -> compiled GPU architectures -------------------------------

ARCH_RULE_SOURCE = (
    "PyTorch torch/cuda/__init__.py: _check_capability / DEVICE_REQUIREMENT "
    "(code for X.Y runs on X.Z with Z >= Y, same major; Jetson-only 5.3/6.2/7.2/8.7 excluded)"
)

# Jetson (integrated) GPUs: code for them runs only on them, and dGPU code does not run on them.
JETSON_CC = {(5, 3), (6, 2), (7, 2), (8, 7)}

# CUDA version of an official x86_64 Linux wheel -> its TORCH_CUDA_ARCH_LIST.
# Used only when the arch list itself was not recorded (a collect_env text).
WHEEL_ARCHES: dict[tuple[int, int], tuple[tuple[str, ...], str]] = {
    (10, 2): (("sm_37", "sm_50", "sm_60", "sm_70", "sm_75"),
              "arch list printed by torch 1.7 cu102 wheels (pytorch/pytorch#45021)"),
    (11, 0): (("sm_37", "sm_50", "sm_60", "sm_70", "sm_75", "sm_80"),
              "CUDA 11.0 builds stop at sm_80 (it has no sm_86 target)"),
    (11, 1): (("sm_37", "sm_50", "sm_60", "sm_61", "sm_70", "sm_75", "sm_80", "sm_86", "compute_37"),
              "NVCC architecture flags of torch 1.8 cu111 (facebookresearch/detectron2#2980)"),
    (11, 3): (("sm_37", "sm_50", "sm_60", "sm_61", "sm_70", "sm_75", "sm_80", "sm_86", "compute_37"),
              "same list as cu111/cu117 wheels (MIC-DKFZ/nnDetection#220)"),
    (11, 6): (("sm_37", "sm_50", "sm_60", "sm_61", "sm_70", "sm_75", "sm_80", "sm_86", "compute_37"),
              "same list as cu111/cu117 wheels (MIC-DKFZ/nnDetection#220)"),
    (11, 7): (("sm_37", "sm_50", "sm_60", "sm_61", "sm_70", "sm_75", "sm_80", "sm_86", "compute_37"),
              "torch.cuda.get_arch_list() of torch 1.13 cu117 (MIC-DKFZ/nnDetection#220)"),
    (11, 8): (("sm_37", "sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"),
              "arch list printed by torch 2.0.1 cu118 wheels (pBFSLab/DeepPrep#233)"),
    (12, 1): (("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"),
              "arch list printed by torch 2.x cu121/cu124 wheels (lllyasviel/FramePack#550)"),
    (12, 4): (("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"),
              "arch list printed by torch 2.x cu121/cu124 wheels (lllyasviel/FramePack#550)"),
    (12, 6): (("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"),
              "PYTORCH_RELEASES_CODE_CC['12.6'] in torch/cuda/__init__.py"),
    (12, 8): (("sm_70", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"),
              "PYTORCH_RELEASES_CODE_CC['12.8'] in torch/cuda/__init__.py (torch 2.7-2.8)"),
    (12, 9): (("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"),
              "PYTORCH_RELEASES_CODE_CC['12.9'] in torch/cuda/__init__.py"),
    (13, 0): (("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"),
              "PYTORCH_RELEASES_CODE_CC['13.0'] in torch/cuda/__init__.py (x86_64)"),
}


def wheel_arches(cuda: Version | None) -> tuple[tuple[str, ...], str] | None:
    if not cuda or len(cuda) < 2:
        return None
    return WHEEL_ARCHES.get((cuda[0], cuda[1]))


def parse_arch(entry: str) -> tuple[str, tuple[int, int]] | None:
    """'sm_86' -> ('sm', (8, 6)); 'compute_120' -> ('compute', (12, 0))."""
    m = re.fullmatch(r"(sm|compute)_(\d+)(\d)[a-z]?", entry.strip())
    if not m:
        return None
    return m.group(1), (int(m.group(2)), int(m.group(3)))


def cubin_runs_on(code: tuple[int, int], device: tuple[int, int]) -> bool:
    """PyTorch's own rule: same major, device minor >= code minor, Jetson apart."""
    if code in JETSON_CC or device in JETSON_CC:
        return code == device
    return code[0] == device[0] and device[1] >= code[1]


def ptx_runs_on(code: tuple[int, int], device: tuple[int, int]) -> bool:
    """PTX for compute_XY is JIT-compiled by the driver for any device >= X.Y."""
    return device >= code


# CUDA major -> lowest compute capability its toolkit and libraries still support. Back to CUDA 7, the
# oldest CUDA a torch wheel was built with, so a GPU older than the wheel table (a GeForce 210, an 8800
# GTX: compute capability 1.x) is still named for a torch built with CUDA 8, 9.2 or 10.1.
MIN_CC_FOR_CUDA_MAJOR: dict[int, tuple[int, int]] = {7: (2, 0), 8: (2, 0), 9: (3, 0), 10: (3, 0),
                                                     11: (3, 5), 12: (5, 0), 13: (7, 5)}
MIN_CC_SOURCE = (
    "CUDA 7.0 release notes (compute capability 1.x dropped), CUDA 9.0 release notes (Fermi removed), "
    "CUDA 11.0 release notes (sm_30/sm_32 dropped), CUDA 12.0 release notes "
    "(Kepler removed), CUDA 13.0 release notes (Maxwell, Pascal, Volta removed)"
)

# --- cuDNN / cuBLAS known-bad versions ----------------------------------------


def cudnn_version_tuple(v: int | None) -> Version | None:
    """cuDNN's integer: major*1000+minor*100+patch up to 8.x, major*10000+... from 9.x."""
    if v is None:
        return None
    if v >= 10000:
        return (v // 10000, (v % 10000) // 100, v % 100)
    return (v // 1000, (v % 1000) // 100, v % 100)


def cudnn_version_int(v: Version) -> int:
    major, minor, patch = (tuple(v) + (0, 0, 0))[:3]
    return major * 10000 + minor * 100 + patch if major >= 9 else major * 1000 + minor * 100 + patch


# (first bad, first good, GPU capability predicate or None, severity, what, source)
KNOWN_BAD_CUDNN: list[dict] = [
    {
        "lo": (0, 0, 0), "hi": (5, 0, 0), "cc": lambda cc: cc[0] == 6,
        "severity": "critical",
        "what": "cuDNN before 5 does not support Pascal (compute capability 6.x)",
        "source": "cuDNN 5 release notes (first Pascal support)",
    },
    {
        "lo": (9, 8, 0), "hi": (9, 15, 0), "cc": None,  # 9.8-9.14, FACTS.md (from the issue)
        "severity": "warn",
        "what": "float16/bfloat16 Conv3d can return wrong results (cuDNN 9.8-9.14)",
        "source": "pytorch/pytorch#163539 (workaround in pytorch/pytorch#163581)",
    },
    {
        "lo": (9, 10, 2), "hi": (9, 16, 0), "cc": lambda cc: cc >= (8, 0),
        "severity": "warn",
        "what": "a broken TF32 kernel for 3D convolutions (affects 9.10.2-9.15)",
        "source": "pytorch/pytorch#167024",
    },
    {
        "lo": (9, 11, 0), "hi": (999, 0, 0), "cc": lambda cc: cc < (7, 5),
        "severity": "critical",
        "what": "cuDNN 9.11 and later do not support GPUs below compute capability 7.5; torch refuses to start cuDNN",
        "source": "torch/backends/cudnn/__init__.py (_init: 'not compatible with devices with SM < 7.5')",
    },
]

# (CUDA versions, GPU capability predicate, severity, what, source). cuBLAS ships
# with the CUDA toolkit, so torch's CUDA version stands in for its cuBLAS.
KNOWN_BAD_CUBLAS: list[dict] = [
    {
        "cuda": lambda v: v[:2] in ((11, 0), (11, 1)), "cc": lambda cc: cc[0] == 6,
        "severity": "critical",
        "what": "cuBLAS in CUDA 11.0/11.1 wheels returns zeros or NaN for matmul/bmm on Pascal GPUs",
        "source": "pytorch/pytorch#56747, pytorch/pytorch#52515",
    },
    {
        "cuda": lambda v: v[:2] < (9, 2), "cc": lambda cc: cc[0] in (5, 6),
        "severity": "warn",
        "what": "cuBLAS before 9.2 gives wrong torch.mm results on Maxwell/Pascal when a dimension exceeds 2^21",
        "source": "pytorch/pytorch#22078",
    },
]

# --- math-mode defaults and sizes ---------------------------------------------

TF32_SOURCE = (
    "PyTorch docs notes/cuda.rst 'TensorFloat-32 (TF32) on Ampere (and later) devices': "
    "10240x10240 matmul on GA100, max error / mean |result| 0.0022 with TF32 vs 0.000039 without"
)
TF32_REL_ERROR = 0.0022
FP32_REL_ERROR = 0.000039


def default_matmul_tf32(torch_version: Version | None) -> bool | None:
    """torch.backends.cuda.matmul.allow_tf32 defaulted to True in 1.7-1.11, False since 1.12."""
    if torch_version is None:
        return None
    return (1, 7) <= torch_version[:2] < (1, 12)


def default_conv_tf32(torch_version: Version | None) -> bool | None:
    """torch.backends.cudnn.allow_tf32 has defaulted to True since TF32 arrived (1.7)."""
    if torch_version is None:
        return None
    return torch_version[:2] >= (1, 7)


# CUBLAS_WORKSPACE_CONFIG values cuBLAS needs for reproducible results.
DETERMINISTIC_CUBLAS_CONFIGS = (":4096:8", ":16:8")
CUBLAS_CONFIG_SOURCE = (
    "PyTorch docs notes/randomness.rst and torch.use_deterministic_algorithms (CUDA >= 10.2); "
    "the check was dropped later (pytorch/pytorch#161749; torch 2.13 no longer has it)"
)


def torch_needs_cublas_config(torch_version: Version | None, cuda: Version | None) -> bool:
    if torch_version is None or cuda is None:
        return False
    return cuda[:2] >= (10, 2) and torch_version[:2] < (2, 10)
