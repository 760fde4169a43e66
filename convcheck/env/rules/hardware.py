"""Hardware-health rules from NVML counters: ECC, memory retirement (MEM), throttling (THR),
the PCIe link (PCI) and the counters that could not be read (PROBE).
"""

from __future__ import annotations

from convcheck.env.fingerprint import Fingerprint
from convcheck.env.rules.base import gpu_label, make_finding, rule


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
            yield make_finding(
                "ECC001", "warn",
                f"ECC is disabled on {gpu_label(g)}{pending}: memory bit flips are neither corrected nor reported",
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
        yield make_finding(
            "ECC002", severity,
            f"{gpu_label(g)} reports ECC errors: {listed}",
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
            yield make_finding(
                "MEM001", "critical",
                f"row remapping failed on {gpu_label(g)} "
                f"({g.remapped_rows_uncorrectable or 0} rows remapped for uncorrectable errors): "
                "bad memory is still in use",
                "Take the GPU out of service and have it replaced.",
                NVML_DOC + ": nvmlDeviceGetRemappedRows", g.index,
            )
        elif g.remap_pending or g.retired_pages_pending:
            what = "row remapping" if g.remap_pending else "page retirement"
            yield make_finding(
                "MEM001", "warn",
                f"{what} is pending on {gpu_label(g)}: faulty memory stays in use until the GPU is reset",
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
        yield make_finding(
            "THR001", "warn",
            f"{gpu_label(g)} is throttling: {'; '.join(parts)}",
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
            yield make_finding(
                "PCI001", "warn",
                f"{gpu_label(g)} PCIe link is x{g.pcie_width} of x{g.pcie_width_max}{gen}: a degraded link "
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
        yield make_finding(
            "PROBE001", "info",
            "some GPU counters could not be read, so the hardware rules could not judge them: " + " | ".join(problems),
            "Run convcheck env with permission to query NVML (e.g. as root), or read nvidia-smi -q.",
            NVML_DOC,
        )
