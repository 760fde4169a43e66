"""The human report for ``convcheck env``: findings first, then the stack.

``render_env`` returns plain text (what tests and pipes see); ``print_env``
writes it, through ``rich`` with coloured severities when stdout is a terminal
and ``NO_COLOR`` is unset. Missing values read "not available".
"""

from __future__ import annotations

import sys
import textwrap
from collections import Counter

from convcheck.env.diff import Difference
from convcheck.env.fingerprint import GPU, Fingerprint, redact_uuids
from convcheck.env.rules import Finding, tf32_state
from convcheck.env.tables import cudnn_version_tuple, format_version
from convcheck.report.console import use_color

WIDTH = 100
NA = "not available"
_LABEL = {"critical": "CRITICAL", "warn": "WARN", "info": "INFO"}
# NVML clock event reason bits (nvml.h nvmlClocksEventReason*)
_CLOCK_REASONS = {0x1: "idle", 0x2: "application clocks setting", 0x4: "SW power cap", 0x8: "HW slowdown",
                  0x10: "sync boost", 0x20: "SW thermal slowdown", 0x40: "HW thermal slowdown",
                  0x80: "HW power brake", 0x100: "display clocks setting"}


def render_env(
    fp: Fingerprint,
    findings: list[Finding],
    *,
    other: Fingerprint | None = None,
    other_findings: list[Finding] | None = None,
    differences: list[Difference] | None = None,
) -> str:
    lines: list[str] = []
    lines += _section(fp, findings)
    if other is not None:
        lines.append("")
        lines += _differences(fp, other, differences or [])
        lines.append("")
        lines += _section(other, other_findings or [])
    # UUIDs are hashed when collected; this also catches any that arrive in free text
    return redact_uuids("\n".join(lines).rstrip() + "\n")


def print_env(text: str, file=None) -> None:
    file = file or sys.stdout
    if use_color(file):
        from rich.console import Console
        from rich.text import Text

        rich_text = Text(text)
        for word, style in (("CRITICAL", "bold red"), ("WARN", "bold yellow"), ("INFO", "cyan")):
            rich_text.highlight_regex(rf"(?m)^\s+{word}\b", style)
        Console(file=file, highlight=False, soft_wrap=True).print(rich_text, end="")
    else:
        file.write(text)


# --- one fingerprint ----------------------------------------------------------------


def _section(fp: Fingerprint, findings: list[Finding]) -> list[str]:
    when = f" (collected {fp.collected_at})" if fp.collected_at else ""
    lines = [f"convcheck env: {fp.source}{when}", ""]
    lines += [f"  {line}" for line in _headline(fp)]
    lines.append("")
    lines += _findings(findings)
    lines.append("")
    lines += _stack(fp)
    return lines


def _headline(fp: Fingerprint) -> list[str]:
    out = []
    if fp.gpus:
        counts = Counter(g.name or "unknown" for g in fp.gpus)
        names = ", ".join(name if n == 1 else f"{n} x {name}" for name, n in counts.items())
        out.append(f"{len(fp.gpus)} NVIDIA GPU{'s' if len(fp.gpus) > 1 else ''}: {names}.")
    else:
        why = f" ({fp.driver.nvml_error})" if fp.driver.nvml_error else ""
        out.append(f"No NVIDIA GPU found{why}.")
    if fp.torch.version is None:
        out.append("torch: not available.")
    elif fp.torch.cpu_only:
        out.append(f"torch {fp.torch.version} is a CPU-only build (no CUDA).")
    else:
        backend = f"CUDA {fp.torch.cuda}" if fp.torch.cuda else f"ROCm {fp.torch.hip}"
        out.append(f"torch {fp.torch.version} is built with {backend}.")
    if not fp.gpus and (fp.torch.cpu_only or fp.torch.version is None):
        from convcheck.targets.runners import specs_on  # the registry: every kind of target convcheck has

        out.append(f"Only CPU targets can run here ({', '.join(specs_on('cpu'))}, and data-parallel ddp:cpu:N "
                   "on N CPU processes, e.g. ddp:cpu:2 or ddp:cpu:2:bf16).")
    return out


def _findings(findings: list[Finding]) -> list[str]:
    if not findings:
        return ["Findings: none."]
    counts = [f"{sum(f.severity == s for f in findings)} {s}" for s in ("critical", "warn", "info")
              if any(f.severity == s for f in findings)]
    lines = [f"Findings: {', '.join(counts)}"]
    for f in findings:
        head = f"  {_LABEL[f.severity]:<8} {f.id:<8} "
        pad = " " * len(head)
        lines += textwrap.wrap(f.message, WIDTH, initial_indent=head, subsequent_indent=pad)
        lines += textwrap.wrap(f.remedy, WIDTH, initial_indent=pad + "fix:    ", subsequent_indent=pad + "        ")
        lines += textwrap.wrap(f.source, WIDTH, initial_indent=pad + "source: ", subsequent_indent=pad + "        ")
    return lines


def _stack(fp: Fingerprint) -> list[str]:
    h, tb, m = fp.host, fp.torch, fp.math
    rows = [
        ("OS", _join(h.os, h.machine)),
        ("Python", h.python),
        ("CPU", _join(h.cpu, f"torch CPU kernels {tb.cpu_capability}" if tb.cpu_capability else None)),
        ("torch", _torch_line(fp)),
        ("cuDNN", _cudnn_line(fp)),
        ("arch list", _arch_line(fp)),
        ("driver", _driver_line(fp)),
    ]
    if not fp.gpus:
        rows.append(("GPUs", "none"))
    lines = ["Stack"] + [_row(k, v) for k, v in rows]
    for g in fp.gpus:
        lines += _gpu_rows(g)
    if fp.gpus and all(len(_gpu_rows(g)) == 1 for g in fp.gpus):
        lines.append(_row("GPU health", f"{NA} (no NVML data in this source)"))
    lines += [_row("math mode", _math_line(fp)),
              _row("env", f"CUBLAS_WORKSPACE_CONFIG={m.cublas_workspace_config or 'unset'}, "
                          f"NVIDIA_TF32_OVERRIDE={m.nvidia_tf32_override or 'unset'}"
                   if m.recorded else NA)]
    lines += _dispatch_rows(fp)
    for note in fp.notes:
        lines.append(_row("note", note))
    return lines


def _dispatch_rows(fp: Fingerprint) -> list[str]:
    """SDPA's backends (enabled, and the one a representative call reached), Triton, the numerics variables."""
    d = fp.dispatch
    if not d.recorded:
        return [_row("dispatch", NA)]
    flags = {"flash": d.sdpa_flash, "mem_efficient": d.sdpa_mem_efficient, "math": d.sdpa_math, "cudnn": d.sdpa_cudnn}
    enabled = ", ".join(k for k, v in flags.items() if v) or "none"
    sdpa = f"enabled {enabled}" + (f"; a {d.sdpa_probe} call ran {d.sdpa_dispatched}" if d.sdpa_dispatched else "")
    return [_row("SDPA", sdpa), _row("Triton", d.triton or "absent"),
            _row("variables", ", ".join(d.env) if d.env else "no NCCL_/TORCH_/CUDA_/CUBLAS/CUDNN_ variable set")]


def _row(key: str, value) -> str:
    head = f"  {key:<11}"
    text = NA if value in (None, "") else str(value)
    return "\n".join(textwrap.wrap(text, WIDTH, initial_indent=head, subsequent_indent=" " * len(head),
                                   break_on_hyphens=False))


def _join(*parts) -> str | None:
    kept = [p for p in parts if p]
    return ", ".join(kept) if kept else None


def _torch_line(fp: Fingerprint) -> str | None:
    tb = fp.torch
    if tb.version is None:
        return None
    build = f"CUDA {tb.cuda}" if tb.cuda else (f"ROCm {tb.hip}" if tb.hip else "CPU-only build")
    avail = "" if tb.cuda_available is None else f", torch.cuda.is_available() {tb.cuda_available}"
    return f"{tb.version} ({build}{avail})"


def _cudnn_line(fp: Fingerprint) -> str:
    tb = fp.torch
    if tb.cudnn_version is None:
        return "none" if tb.cpu_only else NA
    text = format_version(cudnn_version_tuple(tb.cudnn_version))
    if tb.cudnn_compile_version:
        text += f" (compiled against {format_version(cudnn_version_tuple(tb.cudnn_compile_version))})"
    if tb.cudnn_source:
        text += f", from {tb.cudnn_source}"
    if tb.cudnn_library:
        text += f": {tb.cudnn_library}"
    return text


def _arch_line(fp: Fingerprint) -> str:
    tb = fp.torch
    if tb.cpu_only:
        return "none (CPU-only build)"
    if not tb.arch_list:
        return NA
    return " ".join(tb.arch_list) + (f" [{tb.arch_list_source}]" if tb.arch_list_source else "")


def _driver_line(fp: Fingerprint) -> str:
    d = fp.driver
    if d.version is None:
        return f"{NA} ({d.nvml_error})" if d.nvml_error else NA
    return d.version + (f", supports CUDA up to {d.cuda_version}" if d.cuda_version else "")


def _gpu_rows(g: GPU) -> list[str]:
    cc = f"compute capability {g.capability[0]}.{g.capability[1]}" if g.capability else None
    if cc and g.capability_source and g.capability_source != "nvml":
        cc += f" (from {g.capability_source})"
    mem = f"{g.memory_total_mib / 1024:.0f} GiB" if g.memory_total_mib else None
    ident = f"id {g.uuid_hash}" if g.uuid_hash else None
    rows = [_row(f"GPU {g.index}", _join(g.name, cc, mem, ident))]
    health = []
    if g.ecc_enabled is not None:
        counts = ""
        if g.ecc_volatile_uncorrected is not None:
            counts = (f" (uncorrected {g.ecc_volatile_uncorrected} since boot / {g.ecc_aggregate_uncorrected} "
                      f"lifetime, corrected {g.ecc_volatile_corrected} / {g.ecc_aggregate_corrected})")
        health.append(f"ECC {'on' if g.ecc_enabled else 'off'}{counts}")
    if g.remapped_rows_correctable is not None:
        state = "failed" if g.remap_failed else "pending" if g.remap_pending else "none pending"
        health.append(f"remapped rows {g.remapped_rows_correctable}+{g.remapped_rows_uncorrectable} ({state})")
    if g.retired_pages_sbe is not None or g.retired_pages_dbe is not None:
        health.append(f"retired pages {g.retired_pages_sbe or 0} SBE / {g.retired_pages_dbe or 0} DBE"
                      + (", pending" if g.retired_pages_pending else ""))
    if g.clock_event_reasons is not None:
        names = [name for bit, name in _CLOCK_REASONS.items() if g.clock_event_reasons & bit]
        health.append(f"clocks: {', '.join(names) if names else 'not held down'}")
    if g.temperature_c is not None:
        health.append(f"{g.temperature_c} C" + (f" (slowdown {g.temperature_slowdown_c} C)"
                                                if g.temperature_slowdown_c else ""))
    if g.power_w is not None:
        health.append(f"{g.power_w:g} W" + (f" of {g.power_limit_w:g} W" if g.power_limit_w else ""))
    if g.pcie_width is not None:
        health.append(f"PCIe gen{g.pcie_gen or '?'} x{g.pcie_width} (max gen{g.pcie_gen_max or '?'} "
                      f"x{g.pcie_width_max or '?'})")
    if g.mig_enabled is not None:
        health.append(f"MIG {'on' if g.mig_enabled else 'off'}")
    if g.persistence_enabled is not None:
        health.append(f"persistence {'on' if g.persistence_enabled else 'off'}")
    if health:
        rows.append(_row("", "; ".join(health)))
    return rows


def _math_line(fp: Fingerprint) -> str:
    m = fp.math
    matmul, conv, _ = tf32_state(fp)
    if not m.recorded:
        return (f"not recorded; torch defaults assumed: TF32 matmul {'on' if matmul else 'off'}, "
                f"TF32 conv {'on' if conv else 'off'}")
    ampere = any(g.capability and g.capability >= (8, 0) for g in fp.gpus)
    effect = "" if ampere else " (no effect without a GPU of compute capability >= 8.0)"
    parts = [
        f"TF32 matmul {_onoff(matmul)}, TF32 conv {_onoff(conv)}{effect}",
        f"float32 matmul precision {m.float32_matmul_precision or NA}",
        f"fp16/bf16 reduced-precision reductions {_onoff(m.fp16_reduced_precision_reduction)}/"
        f"{_onoff(m.bf16_reduced_precision_reduction)}",
        f"cudnn.benchmark {_onoff(m.cudnn_benchmark)}",
        f"cudnn.deterministic {_onoff(m.cudnn_deterministic)}",
        f"deterministic algorithms {_onoff(m.deterministic_algorithms)}"
        + (" (warn only)" if m.deterministic_warn_only else ""),
    ]
    return "; ".join(parts)


def _onoff(v) -> str:
    return NA if v is None else ("on" if v else "off")


# --- two fingerprints ------------------------------------------------------------------


def _differences(left: Fingerprint, right: Fingerprint, diffs: list[Difference]) -> list[str]:
    title = f"Differences that matter for numerics: {left.source}  vs  {right.source}"
    if not diffs:
        return [title, "  none found."]
    width = max(len(d.field) for d in diffs)
    lines = [title]
    for d in diffs:
        head = f"  {d.field:<{width}}  "
        lines += textwrap.wrap(f"{d.left}  ->  {d.right}", WIDTH, initial_indent=head,
                               subsequent_indent=" " * len(head))
        lines += textwrap.wrap(f"({d.why})", WIDTH, initial_indent=" " * len(head),
                               subsequent_indent=" " * len(head))
    return lines
