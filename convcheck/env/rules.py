"""Audit rules: each a small function from a Fingerprint to zero or more Findings.

A rule stays quiet when the value it needs is unknown (``None``): the audit
reports what the evidence shows, never what it guesses. Every finding carries
a stable id, a severity, a kind (what verdict it can support), a message with
the numbers, a remedy and the source the rule rests on.

Kinds: ``version`` (DRV, ARCH, CUDA, DNN, BLAS), ``hardware`` (ECC, MEM, THR,
PCI), ``numerics`` (MATH), ``determinism`` (DET), ``info`` (PROBE).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Iterable

from convcheck.env import tables as t
from convcheck.env.fingerprint import GPU, Fingerprint

SEVERITIES = ("critical", "warn", "info")
_KIND_BY_PREFIX = {
    "DRV": "version", "ARCH": "version", "CUDA": "version", "DNN": "version", "BLAS": "version",
    "ECC": "hardware", "MEM": "hardware", "THR": "hardware", "PCI": "hardware",
    "MATH": "numerics", "DET": "determinism", "PROBE": "info",
}


@dataclass(frozen=True)
class Finding:
    id: str
    severity: str  # "critical", "warn" or "info"
    kind: str  # "version", "hardware", "numerics", "determinism" or "info"
    message: str
    remedy: str
    source: str
    gpu: int | None = None  # the GPU index it concerns, if one

    def to_dict(self) -> dict:
        return asdict(self)


Rule = Callable[[Fingerprint], Iterable[Finding]]
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def audit(fp: Fingerprint) -> list[Finding]:
    """Every rule's findings, critical first, then warn, then info (stable within)."""
    findings = [f for r in RULES for f in r(fp)]
    return sorted(findings, key=lambda f: SEVERITIES.index(f.severity))


def _finding(rule_id: str, severity: str, message: str, remedy: str, source: str, gpu=None) -> Finding:
    kind = _KIND_BY_PREFIX[rule_id.rstrip("0123456789")]
    return Finding(rule_id, severity, kind, message, remedy, source, gpu)


def _gpu_label(g: GPU) -> str:
    cc = f", compute capability {g.capability[0]}.{g.capability[1]}" if g.capability else ""
    return f"GPU {g.index} ({g.name or 'unknown'}{cc})"


def _fmt(v) -> str:
    return t.format_version(v)


def _wheels_covering(cc: tuple[int, int]) -> list[str]:
    tags = []
    for cuda, (arches, _) in sorted(t.WHEEL_ARCHES.items()):
        parsed = [t.parse_arch(a) for a in arches]
        if any(p and p[0] == "sm" and t.cubin_runs_on(p[1], cc) for p in parsed):
            tags.append(f"cu{cuda[0]}{cuda[1]}")
    return tags


# --- driver vs CUDA -------------------------------------------------------------------


@rule
def driver_vs_cuda(fp: Fingerprint):
    """DRV001 (critical): the driver is below the floor for torch's CUDA major, so
    CUDA cannot start. DRV002 (warn): the driver is at or above the major's floor
    but below this CUDA minor's own minimum: minor-version compatibility mode,
    limited features and no PTX JIT. Uses the driver version string with
    NVIDIA's table; without one, the CUDA version NVML says the driver supports."""
    cuda = fp.cuda_build
    if not cuda or len(cuda) < 2:
        return
    windows = fp.on_windows_driver
    driver = t.parse_version(fp.driver.version)
    need = t.min_driver(cuda, windows)
    floor = (t.major_floor(cuda[0], windows) if cuda[0] >= 11 else need) or need
    if floor and need and t.parse_version(need) < t.parse_version(floor):
        floor = need  # CUDA 11.0's own minimum sits below the later 11.x compatibility floor
    cuda_txt = _fmt(cuda[:2])
    newest = t.newest_cuda_for_driver(driver, windows) if driver else None
    fix_other = f", or install a torch wheel built for CUDA {newest[0]}.{newest[1]} or older" if newest else ""
    if driver and floor:
        if driver < t.parse_version(floor):
            yield _finding(
                "DRV001", "critical",
                f"NVIDIA driver {fp.driver.version} is older than {floor}, the minimum for CUDA "
                f"{cuda[0]}.x; torch {fp.torch.version} was built with CUDA {cuda_txt} and cannot use the GPU"
                + (f" (this driver supports CUDA up to {newest[0]}.{newest[1]})" if newest else ""),
                f"Upgrade the driver to {need or floor} or newer{fix_other}.",
                t.DRIVER_SOURCE,
            )
        elif need and driver < t.parse_version(need):
            yield _finding(
                "DRV002", "warn",
                f"NVIDIA driver {fp.driver.version} is below {need}, the minimum for CUDA {cuda_txt}, but at or "
                f"above the CUDA {cuda[0]}.x floor {floor}: CUDA runs in minor-version compatibility mode "
                "(some features unavailable, PTX JIT compilation fails)",
                f"Upgrade the driver to {need} or newer{fix_other}.",
                t.DRIVER_SOURCE,
            )
        return
    supported = t.parse_version(fp.driver.cuda_version)  # no usable table entry: ask NVML's answer
    if not supported:
        return
    if supported[0] < cuda[0] or (cuda[0] < 11 and supported[:2] < cuda[:2]):
        yield _finding(
            "DRV001", "critical",
            f"the driver supports CUDA {_fmt(supported[:2])}, older than the CUDA {cuda_txt} torch "
            f"{fp.torch.version} was built with: CUDA cannot start",
            f"Upgrade the driver to one for CUDA {cuda_txt} or newer, or install a torch wheel built for "
            f"CUDA {_fmt(supported[:2])} or older.",
            t.DRIVER_SOURCE,
        )
    elif supported[:2] < cuda[:2]:
        yield _finding(
            "DRV002", "warn",
            f"the driver supports CUDA {_fmt(supported[:2])} and torch was built with CUDA {cuda_txt}: "
            "minor-version compatibility mode (some features unavailable, PTX JIT compilation fails)",
            f"Upgrade the driver to one for CUDA {cuda_txt} or newer.",
            t.DRIVER_SOURCE,
        )


@rule
def driver_library_mismatch(fp: Fingerprint):
    """DRV003 (critical): NVML error 18, the loaded kernel driver and the user-space
    library differ: the driver was upgraded and the machine not rebooted."""
    if fp.driver.rm_mismatch:
        yield _finding(
            "DRV003", "critical",
            "NVML reports a driver/library version mismatch (error 18): the kernel module and the user-space "
            "driver differ, so CUDA cannot start",
            "Reboot (or unload and reload the nvidia kernel modules) after a driver upgrade.",
            "NVML API reference, nvmlReturn_t NVML_ERROR_LIB_RM_VERSION_MISMATCH",
        )


# --- GPU architecture vs the torch build ---------------------------------------------


@rule
def arch_coverage(fp: Fingerprint):
    """ARCH001 (critical): no kernel in torch's arch list runs on a GPU (PyTorch's own
    rule: sm_X.Y runs on X.Z, Z >= Y). ARCH002 (warn): only PTX covers it, so every
    kernel is JIT-compiled by the driver on first use."""
    arch = fp.torch.arch_list
    if not arch or fp.torch.cuda is None:
        return
    parsed = [p for p in (t.parse_arch(a) for a in arch) if p]
    inferred = ""
    if (fp.torch.arch_list_source or "").startswith("inferred"):
        inferred = " (arch list inferred from the official wheel)"
    for g in fp.gpus:
        if g.capability is None:
            continue
        cc = g.capability
        sm_name = f"sm_{cc[0]}{cc[1]}"
        if any(kind == "sm" and t.cubin_runs_on(code, cc) for kind, code in parsed):
            continue
        wheels = _wheels_covering(cc)
        hint = f" (official wheels with {sm_name}: {', '.join(wheels)})" if wheels else ""
        ptx = [code for kind, code in parsed if kind == "compute" and t.ptx_runs_on(code, cc)]
        if ptx:
            yield _finding(
                "ARCH002", "warn",
                f"{_gpu_label(g)} has no native kernels in torch {fp.torch.version} ({' '.join(arch)}){inferred}; "
                f"it runs PTX compute_{ptx[-1][0]}{ptx[-1][1]} JIT-compiled by the driver (slow first use; "
                "fails under minor-version compatibility)",
                f"Install a torch build whose arch list includes {sm_name}{hint}.",
                t.ARCH_RULE_SOURCE, g.index,
            )
        else:
            yield _finding(
                "ARCH001", "critical",
                f"{_gpu_label(g)} is not covered by torch {fp.torch.version}, built for {' '.join(arch)}{inferred}: "
                "no kernel can run on it ('no kernel image is available for execution on the device')",
                f"Install a torch build whose arch list includes {sm_name}{hint}.",
                t.ARCH_RULE_SOURCE, g.index,
            )


@rule
def arch_dropped(fp: Fingerprint):
    """ARCH003 (critical): the GPU generation is older than torch's CUDA major supports."""
    cuda = fp.cuda_build
    if not cuda or cuda[0] not in t.MIN_CC_FOR_CUDA_MAJOR:
        return
    lowest = t.MIN_CC_FOR_CUDA_MAJOR[cuda[0]]
    for g in fp.gpus:
        if g.capability is not None and g.capability < lowest:
            yield _finding(
                "ARCH003", "critical",
                f"{_gpu_label(g)} is older than CUDA {cuda[0]}.x supports (lowest: {lowest[0]}.{lowest[1]}); "
                f"torch {fp.torch.version} is built with CUDA {_fmt(cuda[:2])}",
                f"Install a torch wheel built with CUDA {cuda[0] - 1}.x, the last major to support this GPU.",
                t.MIN_CC_SOURCE, g.index,
            )


# --- torch build vs machine -----------------------------------------------------------


@rule
def cpu_only_build_with_gpu(fp: Fingerprint):
    """CUDA001 (critical): torch is a CPU-only build on a machine with an NVIDIA GPU."""
    if not fp.torch.cpu_only or not (fp.has_gpu or fp.driver.version):
        return
    names = ", ".join(sorted({g.name or "unknown" for g in fp.gpus})) or "an NVIDIA driver"
    driver = t.parse_version(fp.driver.version)
    newest = t.newest_cuda_for_driver(driver, fp.on_windows_driver) if driver else None
    tags = [f"cu{c[0]}{c[1]}" for c in sorted(t.WHEEL_ARCHES) if newest is None or c <= newest]
    tag = tags[-1] if tags else "cu126"
    yield _finding(
        "CUDA001", "critical",
        f"torch {fp.torch.version} is a CPU-only build, but this machine has {names}"
        + (f" (driver {fp.driver.version})" if fp.driver.version else "")
        + ": no 'cuda' target can run, training silently stays on the CPU",
        f"Install a CUDA build, e.g. pip install torch --index-url https://download.pytorch.org/whl/{tag}.",
        "PyTorch docs: torch.version.cuda is None for CPU-only builds; pytorch.org/get-started/locally",
    )


@rule
def cuda_unavailable(fp: Fingerprint):
    """CUDA002 (warn): torch has CUDA and a GPU is present, yet torch.cuda.is_available() is False."""
    if fp.torch.cuda and fp.has_gpu and fp.torch.cuda_available is False:
        yield _finding(
            "CUDA002", "warn",
            f"torch {fp.torch.version} is built with CUDA {fp.torch.cuda} and a GPU is present, "
            "but torch.cuda.is_available() is False",
            "Check the driver findings; run python -c \"import torch; torch.zeros(1).cuda()\" to see CUDA's own "
            "error (driver too old or not loaded, CUDA_VISIBLE_DEVICES empty, container started without GPUs).",
            "PyTorch docs: torch.cuda.is_available",
        )


# --- cuDNN / cuBLAS -------------------------------------------------------------------


@rule
def cudnn_mismatch(fp: Fingerprint):
    """DNN001 (critical): the loaded cuDNN is incompatible with the one torch was
    compiled against (different major; or, from cuDNN 7, an older minor)."""
    run = t.cudnn_version_tuple(fp.torch.cudnn_version)
    comp = t.cudnn_version_tuple(fp.torch.cudnn_compile_version)
    if not run or not comp or not (fp.torch.cudnn_source or "").startswith("torch"):
        return
    if run[0] != comp[0]:
        bad = True
    elif run[0] < 7:
        bad = run[1] != comp[1]
    else:
        bad = run[1] < comp[1]
    if bad:
        yield _finding(
            "DNN001", "critical",
            f"torch was compiled against cuDNN {_fmt(comp)} but loaded cuDNN {_fmt(run)}"
            + (f" from {fp.torch.cudnn_library}" if fp.torch.cudnn_library else ""),
            "Let torch load the cuDNN it bundles: remove other cuDNN directories from LD_LIBRARY_PATH, "
            f"or install cuDNN {comp[0]}.{comp[1]}.",
            "torch/backends/cudnn/__init__.py (_init: 'cuDNN version incompatibility')",
        )


@rule
def cudnn_outside_torch(fp: Fingerprint):
    """DNN002 (warn): the cuDNN torch loaded lives outside the torch/pip/conda install."""
    path = fp.torch.cudnn_library
    if not path:
        return
    inside = any(s in path for s in ("site-packages", "dist-packages", "/envs/", "conda", "/torch/lib/"))
    if not inside:
        yield _finding(
            "DNN002", "warn",
            f"torch loaded cuDNN from {path}, outside its own install: a system cuDNN is not the version "
            "this torch build was tested with",
            "Remove that directory from LD_LIBRARY_PATH (or the ldconfig cache) so torch loads the cuDNN "
            "its wheel bundles.",
            "pytorch/pytorch#78489; torch/backends/cudnn/__init__.py (LD_LIBRARY_PATH hint)",
        )


@rule
def cudnn_known_bad(fp: Fingerprint):
    """DNN003: a cuDNN version with a documented numerics or support problem."""
    v = t.cudnn_version_tuple(fp.torch.cudnn_version)
    if not v or fp.torch.cuda is None:
        return
    caveat = ""
    if "system" in (fp.torch.cudnn_source or ""):
        caveat = " (as listed by collect_env: a system file, possibly not the one torch loads)"
    ccs = [g.capability for g in fp.gpus if g.capability]
    for bad in t.KNOWN_BAD_CUDNN:
        if not (bad["lo"] <= v < bad["hi"]):
            continue
        if bad["cc"] is not None and not any(bad["cc"](cc) for cc in ccs):
            continue
        yield _finding(
            "DNN003", bad["severity"],
            f"cuDNN {_fmt(v)}{caveat}: {bad['what']}",
            "Use a torch build bundling a cuDNN outside the affected range, or disable cuDNN for the affected "
            "layers (torch.backends.cudnn.flags(enabled=False)).",
            bad["source"],
        )


@rule
def cublas_known_bad(fp: Fingerprint):
    """BLAS001: the cuBLAS of torch's CUDA version has a known wrong-result bug on these GPUs."""
    cuda = fp.cuda_build
    if not cuda or len(cuda) < 2:
        return
    for bad in t.KNOWN_BAD_CUBLAS:
        hit = [g for g in fp.gpus if g.capability and bad["cc"](g.capability)]
        if bad["cuda"](cuda) and hit:
            yield _finding(
                "BLAS001", bad["severity"],
                f"{bad['what']}: torch {fp.torch.version} uses CUDA {_fmt(cuda[:2])} on {_gpu_label(hit[0])}",
                "Install a torch wheel built with a different CUDA version (e.g. CUDA 10.2 or 11.3+) and "
                "re-check matmul results against the CPU.",
                bad["source"], hit[0].index,
            )


# --- math mode --------------------------------------------------------------------------


def tf32_state(fp: Fingerprint) -> tuple[bool, bool, bool]:
    """(matmul TF32, conv TF32, matmul may use bfloat16) in effect, or defaults when unrecorded."""
    m = fp.math
    if m.nvidia_tf32_override == "0":
        return False, False, False
    if m.recorded:
        precision = (m.float32_matmul_precision or "").lower()
        if m.matmul_allow_tf32 is not None:
            matmul = m.matmul_allow_tf32
        else:
            matmul = (m.matmul_fp32_precision or "").lower() == "tf32"
        matmul = bool(matmul) or precision in ("high", "medium")
        if m.cudnn_allow_tf32 is not None:
            conv = m.cudnn_allow_tf32
        else:
            conv = (m.conv_fp32_precision or "").lower() == "tf32"
        conv = bool(conv) and m.cudnn_enabled is not False
        return matmul, conv, precision == "medium"
    return bool(t.default_matmul_tf32(fp.torch_version)), bool(t.default_conv_tf32(fp.torch_version)), False


@rule
def tf32_active(fp: Fingerprint):
    """MATH001: TF32 in effect on a GPU of compute capability >= 8.0 (CUDA >= 11).
    warn when matmuls use it (not the default since torch 1.12), info when only
    convolutions do (torch's default)."""
    cuda = fp.cuda_build
    ampere = [g for g in fp.gpus if g.capability and g.capability >= (8, 0)]
    if not cuda or cuda[:2] < (11, 0) or not ampere:
        return
    matmul, conv, bf16 = tf32_state(fp)
    if not (matmul or conv):
        return
    what = " and ".join(w for w, on in (("matmul", matmul), ("convolution", conv)) if on)
    assumed = "" if fp.math.recorded else " (math flags not recorded: torch defaults assumed)"
    size = (
        f"float32 inputs are rounded to a 10-bit mantissa (unit roundoff 2^-11 = 4.9e-4 vs 6e-8); "
        f"PyTorch measured max error / mean |result| of {t.TF32_REL_ERROR:.4f} with TF32 vs "
        f"{t.FP32_REL_ERROR:.6f} without on a 10240x10240 matmul"
    )
    if bf16:
        size += "; float32_matmul_precision('medium') also allows bfloat16 (unit roundoff 2^-8 = 3.9e-3)"
    yield _finding(
        "MATH001", "warn" if matmul else "info",
        f"TF32 is active for {what} on {_gpu_label(ampere[0])}: {size}{assumed}",
        "To match the CPU: torch.backends.cuda.matmul.allow_tf32 = False and torch.backends.cudnn.allow_tf32 = "
        "False (or NVIDIA_TF32_OVERRIDE=0); compare with the cuda:no-tf32 target, or predict on a CPU with "
        "cpu:emulate-tf32.",
        t.TF32_SOURCE, ampere[0].index,
    )


@rule
def reduced_precision_reduction(fp: Fingerprint):
    """MATH002: fp16/bf16 GEMMs may reduce in reduced precision (info, torch's default),
    or fp16 GEMMs accumulate in fp16 (warn)."""
    m = fp.math
    if not m.recorded or not fp.torch.cuda or not fp.has_gpu:
        return
    source = "PyTorch docs notes/numerical_accuracy.rst 'Reduced Precision Reduction for FP16 and BF16 GEMMs'"
    if m.fp16_accumulation:
        yield _finding(
            "MATH002", "warn",
            "torch.backends.cuda.matmul.allow_fp16_accumulation is on: fp16 matmuls accumulate in fp16 "
            "(unit roundoff 2^-11 per addition; long dot products lose most digits)",
            "Set torch.backends.cuda.matmul.allow_fp16_accumulation = False.",
            source,
        )
    elif m.fp16_reduced_precision_reduction or m.bf16_reduced_precision_reduction:
        kinds = "/".join(k for k, on in (("fp16", m.fp16_reduced_precision_reduction),
                                         ("bf16", m.bf16_reduced_precision_reduction)) if on)
        yield _finding(
            "MATH002", "info",
            f"{kinds} matmuls may use reduced-precision reductions (torch default); this matters only for "
            "float16/bfloat16 and autocast targets",
            "For a strict comparison set torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction "
            "and allow_bf16_reduced_precision_reduction to False.",
            source,
        )


# --- determinism -------------------------------------------------------------------------


@rule
def cudnn_benchmark(fp: Fingerprint):
    """DET001 (warn): cudnn.benchmark picks convolution algorithms by timing, per run."""
    if fp.math.cudnn_benchmark and fp.torch.cuda:
        yield _finding(
            "DET001", "warn",
            "torch.backends.cudnn.benchmark is on: cuDNN times several convolution algorithms and keeps the "
            "fastest, which can differ between runs and machines, so results are not reproducible",
            "Set torch.backends.cudnn.benchmark = False while comparing.",
            "PyTorch docs notes/randomness.rst 'CUDA convolution benchmarking'; pytorch/pytorch#6351",
        )


@rule
def cublas_workspace(fp: Fingerprint):
    """DET002 (warn): deterministic algorithms requested, CUDA >= 10.2, a torch that
    still checks CUBLAS_WORKSPACE_CONFIG, and it is not ':4096:8' or ':16:8'."""
    m = fp.math
    if not m.deterministic_algorithms or not t.torch_needs_cublas_config(fp.torch_version, fp.cuda_build):
        return
    if m.cublas_workspace_config in t.DETERMINISTIC_CUBLAS_CONFIGS:
        return
    value = "unset" if m.cublas_workspace_config is None else repr(m.cublas_workspace_config)
    effect = "warns on" if m.deterministic_warn_only else "raises a RuntimeError at"
    yield _finding(
        "DET002", "warn",
        f"torch.use_deterministic_algorithms(True) is on but CUBLAS_WORKSPACE_CONFIG is {value}: torch "
        f"{fp.torch.version} with CUDA {fp.torch.cuda} {effect} every cuBLAS call",
        "export CUBLAS_WORKSPACE_CONFIG=:4096:8 (or :16:8) before Python starts CUDA.",
        t.CUBLAS_CONFIG_SOURCE,
    )


# --- hardware health ----------------------------------------------------------------------

NVML_DOC = "NVML API reference (nvidia-ml-py); nvidia-smi -q"
THROTTLE_BITS = {0x8: "HW slowdown", 0x20: "SW thermal slowdown", 0x40: "HW thermal slowdown",
                 0x80: "HW power brake"}


@rule
def ecc_off(fp: Fingerprint):
    """ECC001 (warn): ECC is supported but disabled: memory bit flips go unnoticed."""
    for g in fp.gpus:
        if g.ecc_enabled is False:
            pending = " (enabled after the next reboot)" if g.ecc_pending else ""
            yield _finding(
                "ECC001", "warn",
                f"ECC is disabled on {_gpu_label(g)}{pending}: memory bit flips are neither corrected nor reported",
                f"nvidia-smi -i {g.index} -e 1, then reboot.",
                NVML_DOC + ": nvmlDeviceGetEccMode", g.index,
            )


@rule
def ecc_errors(fp: Fingerprint):
    """ECC002: uncorrected ECC errors since boot (critical), or any other ECC errors (warn)."""
    for g in fp.gpus:
        counts = {
            "volatile uncorrected": g.ecc_volatile_uncorrected,
            "aggregate uncorrected": g.ecc_aggregate_uncorrected,
            "volatile corrected": g.ecc_volatile_corrected,
            "aggregate corrected": g.ecc_aggregate_corrected,
        }
        nonzero = {k: v for k, v in counts.items() if v}
        if not nonzero:
            continue
        severity = "critical" if g.ecc_volatile_uncorrected else "warn"
        listed = ", ".join(f"{v} {k}" for k, v in nonzero.items())
        yield _finding(
            "ECC002", severity,
            f"{_gpu_label(g)} reports ECC errors: {listed}",
            "Run a memory diagnostic (dcgmi diag -r 3), read nvidia-smi -q -d ECC,PAGE_RETIREMENT,ROW_REMAPPER; "
            "repeat the comparison on another GPU; replace a GPU whose uncorrected count grows.",
            NVML_DOC + ": nvmlDeviceGetTotalEccErrors", g.index,
        )


@rule
def memory_retirement(fp: Fingerprint):
    """MEM001: row remapping failed (critical), or page retirement / row remapping
    is pending until the GPU is reset (warn)."""
    for g in fp.gpus:
        if g.remap_failed:
            yield _finding(
                "MEM001", "critical",
                f"row remapping failed on {_gpu_label(g)} "
                f"({g.remapped_rows_uncorrectable or 0} rows remapped for uncorrectable errors): "
                "bad memory is still in use",
                "Take the GPU out of service and have it replaced.",
                NVML_DOC + ": nvmlDeviceGetRemappedRows", g.index,
            )
        elif g.remap_pending or g.retired_pages_pending:
            what = "row remapping" if g.remap_pending else "page retirement"
            yield _finding(
                "MEM001", "warn",
                f"{what} is pending on {_gpu_label(g)}: faulty memory stays in use until the GPU is reset",
                f"Reset the GPU (nvidia-smi -r -i {g.index}) or reboot.",
                NVML_DOC + ": nvmlDeviceGetRemappedRows / nvmlDeviceGetRetiredPagesPendingStatus", g.index,
            )


@rule
def throttling(fp: Fingerprint):
    """THR001 (warn): thermal or power-brake clock slowdown, or temperature at the
    slowdown threshold."""
    for g in fp.gpus:
        reasons = [name for bit, name in THROTTLE_BITS.items() if (g.clock_event_reasons or 0) & bit]
        hot = (g.temperature_c is not None and g.temperature_slowdown_c
               and g.temperature_c >= g.temperature_slowdown_c)
        if not reasons and not hot:
            continue
        parts = []
        if reasons:
            parts.append(f"clocks held down by {', '.join(reasons)} (reasons 0x{g.clock_event_reasons:x})")
        if g.temperature_c is not None:
            parts.append(f"{g.temperature_c} C (slowdown at {g.temperature_slowdown_c or '?'} C)")
        yield _finding(
            "THR001", "warn",
            f"{_gpu_label(g)} is throttling: {'; '.join(parts)}",
            "Check cooling and power delivery (nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER); "
            "a GPU that throttles under HW slowdown can also be unstable.",
            NVML_DOC + ": nvmlDeviceGetCurrentClocksEventReasons", g.index,
        )


@rule
def pcie_degraded(fp: Fingerprint):
    """PCI001 (warn): the PCIe link runs narrower than the card supports. (The link
    generation drops at idle to save power, so only the width is judged.)"""
    for g in fp.gpus:
        if g.pcie_width and g.pcie_width_max and g.pcie_width < g.pcie_width_max:
            gen = f", gen {g.pcie_gen} of {g.pcie_gen_max}" if g.pcie_gen and g.pcie_gen_max else ""
            yield _finding(
                "PCI001", "warn",
                f"{_gpu_label(g)} PCIe link is x{g.pcie_width} of x{g.pcie_width_max}{gen}: a degraded link "
                "(seating, riser or slot problem) slows transfers and can come with bus errors",
                "Reseat the card or move it to a full-width slot; check dmesg for AER/Xid messages.",
                NVML_DOC + ": nvmlDeviceGetCurrPcieLinkWidth / nvmlDeviceGetMaxPcieLinkWidth", g.index,
            )


@rule
def unreadable_probes(fp: Fingerprint):
    """PROBE001 (info): some GPU counters could not be read (no permission, driver
    older than the NVML binding, ...), so hardware rules could not judge them."""
    problems = [f"GPU {g.index}: {'; '.join(g.unreadable)}" for g in fp.gpus if g.unreadable]
    if problems:
        yield _finding(
            "PROBE001", "info",
            "some GPU counters could not be read, so the hardware rules could not judge them: " + " | ".join(problems),
            "Run convcheck env with permission to query NVML (e.g. as root), or read nvidia-smi -q.",
            NVML_DOC,
        )


RULE_IDS: dict[str, str] = {
    rid: _KIND_BY_PREFIX[rid.rstrip("0123456789")]
    for rid in ("DRV001", "DRV002", "DRV003", "ARCH001", "ARCH002", "ARCH003", "CUDA001", "CUDA002",
                "DNN001", "DNN002", "DNN003", "BLAS001", "MATH001", "MATH002", "DET001", "DET002",
                "ECC001", "ECC002", "MEM001", "THR001", "PCI001", "PROBE001")
}
