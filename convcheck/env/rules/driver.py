"""Version rules: the driver against torch's CUDA (DRV), the GPU architecture against the
build's arch list (ARCH), the torch build against the machine (CUDA).
"""

from __future__ import annotations

from convcheck.env import tables as t
from convcheck.env.fingerprint import Fingerprint
from convcheck.env.rules.base import fmt_version, gpu_label, make_finding, rule


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
    cuda_txt = fmt_version(cuda[:2])
    newest = t.newest_cuda_for_driver(driver, windows) if driver else None
    fix_other = f", or install a torch wheel built for CUDA {newest[0]}.{newest[1]} or older" if newest else ""
    if driver and floor:
        if driver < t.parse_version(floor):
            yield make_finding(
                "DRV001", "critical",
                f"NVIDIA driver {fp.driver.version} is older than {floor}, the minimum for CUDA "
                f"{cuda[0]}.x; torch {fp.torch.version} was built with CUDA {cuda_txt} and cannot use the GPU"
                + (f" (this driver supports CUDA up to {newest[0]}.{newest[1]})" if newest else ""),
                f"Upgrade the driver to {need or floor} or newer"
                + (f" (CUDA {cuda_txt}'s own minimum; {floor} would run it in minor-version compatibility mode)"
                   if need and need != floor else "") + f"{fix_other}.",
                t.DRIVER_SOURCE,
            )
        elif need and driver < t.parse_version(need):
            yield make_finding(
                "DRV002", "warn",
                f"NVIDIA driver {fp.driver.version} is below {need}, the minimum for CUDA {cuda_txt}, but at or "
                f"above the CUDA {cuda[0]}.x floor {floor}: CUDA runs in minor-version compatibility mode "
                "(some features unavailable, PTX JIT compilation fails)",
                f"Upgrade the driver to {need} or newer{fix_other}.",
                t.DRIVER_SOURCE,
            )
        return
    supported = t.parse_version(fp.driver.cuda_version)  # no usable table entry: ask NVML's answer
    if supported:
        yield from _driver_vs_cuda_by_nvml(fp, cuda, supported)


def _driver_vs_cuda_by_nvml(fp: Fingerprint, cuda, supported):
    """``driver_vs_cuda`` without a driver version in NVIDIA's table: judge by the newest
    CUDA that NVML says the driver supports."""
    cuda_txt = fmt_version(cuda[:2])
    if supported[0] < cuda[0] or (cuda[0] < 11 and supported[:2] < cuda[:2]):
        yield make_finding(
            "DRV001", "critical",
            f"the driver supports CUDA {fmt_version(supported[:2])}, older than the CUDA {cuda_txt} torch "
            f"{fp.torch.version} was built with: CUDA cannot start",
            f"Upgrade the driver to one for CUDA {cuda_txt} or newer, or install a torch wheel built for "
            f"CUDA {fmt_version(supported[:2])} or older.",
            t.DRIVER_SOURCE,
        )
    elif supported[:2] < cuda[:2] and not fp.driver.torch_warning:  # torch said it cannot start: DRV004
        yield make_finding(
            "DRV002", "warn",
            f"the driver supports CUDA {fmt_version(supported[:2])} and torch was built with CUDA {cuda_txt}: "
            "minor-version compatibility mode (some features unavailable, PTX JIT compilation fails)",
            f"Upgrade the driver to one for CUDA {cuda_txt} or newer.",
            t.DRIVER_SOURCE,
        )


@rule
def driver_too_old_by_torch(fp: Fingerprint):
    """DRV004 (critical): the pasted report quotes torch's own warning that the NVIDIA driver is too old
    (torch could not start CUDA), and DRV001 does not already say so from the versions (a report cut
    short has no driver line, or no CUDA line)."""
    warning = fp.driver.torch_warning
    if not warning or any(f.id == "DRV001" for f in driver_vs_cuda(fp)):
        return
    supported = t.parse_version(fp.driver.cuda_version)
    cuda = fp.cuda_build
    built = f", and torch {fp.torch.version} was built with CUDA {fmt_version(cuda[:2])}" if cuda else ""
    upto = f" (this driver supports CUDA up to {fmt_version(supported[:2])}{built})" if supported else ""
    other = (f", or install a torch wheel built for CUDA {fmt_version(supported[:2])} or older"
             if supported else "")
    yield make_finding(
        "DRV004", "critical",
        f"the report quotes torch's own warning '{warning}': CUDA cannot start{upto}",
        f"Upgrade the NVIDIA driver{f' to one for CUDA {fmt_version(cuda[:2])} or newer' if cuda else ''}{other}.",
        "torch/cuda/__init__.py: the warning torch prints when cudaGetDeviceCount returns "
        "cudaErrorInsufficientDriver; " + t.DRIVER_SOURCE,
    )


@rule
def driver_library_mismatch(fp: Fingerprint):
    """DRV003 (critical): NVML error 18, the loaded kernel driver and the user-space
    library differ: the driver was upgraded and the machine not rebooted."""
    if fp.driver.rm_mismatch:
        yield make_finding(
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
            yield make_finding(
                "ARCH002", "warn",
                f"{gpu_label(g)} has no native kernels in torch {fp.torch.version} ({' '.join(arch)}){inferred}; "
                f"it runs PTX compute_{ptx[-1][0]}{ptx[-1][1]} JIT-compiled by the driver (slow first use; "
                "fails under minor-version compatibility)",
                f"Install a torch build whose arch list includes {sm_name}{hint}.",
                t.ARCH_RULE_SOURCE, g.index,
            )
        else:
            yield make_finding(
                "ARCH001", "critical",
                f"{gpu_label(g)} is not covered by torch {fp.torch.version}, built for {' '.join(arch)}{inferred}: "
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
            last = max((m for m, least in t.MIN_CC_FOR_CUDA_MAJOR.items() if m < cuda[0] and g.capability >= least),
                       default=None)
            remedy = (f"Install a torch wheel built with CUDA {last}.x, the last major to support this GPU."
                      if last is not None else
                      f"No CUDA a torch wheel was built with (7.x and later) supports compute capability "
                      f"{g.capability[0]}.{g.capability[1]}: train on a newer GPU, or on the CPU.")
            yield make_finding(
                "ARCH003", "critical",
                f"{gpu_label(g)} is older than CUDA {cuda[0]}.x supports (lowest: {lowest[0]}.{lowest[1]}); "
                f"torch {fp.torch.version} is built with CUDA {fmt_version(cuda[:2])}",
                remedy, t.MIN_CC_SOURCE, g.index,
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
    yield make_finding(
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
        yield make_finding(
            "CUDA002", "warn",
            f"torch {fp.torch.version} is built with CUDA {fp.torch.cuda} and a GPU is present, "
            "but torch.cuda.is_available() is False",
            "Check the driver findings; run python -c \"import torch; torch.zeros(1).cuda()\" to see CUDA's own "
            "error (driver too old or not loaded, CUDA_VISIBLE_DEVICES empty, container started without GPUs).",
            "PyTorch docs: torch.cuda.is_available",
        )
