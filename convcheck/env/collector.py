"""The collector: fills a ``Fingerprint`` from this machine.

Each probe is a small function that returns ``None`` instead of raising, and
takes its source as an argument (the torch module, the NVML module, the
environment) so tests can feed recorded or fake ones.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import sys
from pathlib import Path

from convcheck.env import nvml as _nvml
from convcheck.env.dispatch import probe_dispatch
from convcheck.env.fingerprint import GPU, Fingerprint, Host, MathFlags, TorchBuild
from convcheck.env.tables import capability_from_name


def collect(nvml=None, torch_module=None, environ=None, device: str | None = None) -> Fingerprint:
    """Fingerprint this machine. ``nvml``/``torch_module``/``environ`` replace
    ``pynvml``/``torch``/``os.environ`` (tests pass fakes); ``device``: where the SDPA probe runs (a watched
    model's device; default the current CUDA GPU, else the CPU)."""
    environ = os.environ if environ is None else environ
    torch = torch_module if torch_module is not None else _import_torch()
    driver, gpus = _nvml.probe(nvml)
    build = probe_torch(torch)
    gpus = _fill_capabilities(gpus, torch, build)
    return Fingerprint(
        source="this machine",
        collected_at=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        host=probe_host(),
        torch=build,
        driver=driver,
        gpus=gpus,
        math=probe_math(torch, environ),
        dispatch=probe_dispatch(torch, environ, device),
    )


def _import_torch():
    try:
        import torch
    except Exception:  # noqa: BLE001 - a machine without torch still gets a fingerprint
        return None
    return torch


def _safe(fn, *args):
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - probes never raise
        return None


def _attr(obj, dotted: str):
    """``_attr(torch, 'backends.cuda.matmul.allow_tf32')`` or None if any step fails."""
    for part in dotted.split("."):
        if obj is None:
            return None
        try:
            obj = getattr(obj, part)
        except Exception:  # noqa: BLE001 - mixing old/new TF32 APIs can make getters raise
            return None
    return obj


# --- host ------------------------------------------------------------------------


def probe_host() -> Host:
    return Host(
        os=_safe(_os_name),
        platform=_safe(platform.platform),
        machine=_safe(platform.machine) or None,
        python=_safe(platform.python_version),
        cpu=_safe(_cpu_name),
    )


def _os_name() -> str:
    release = Path("/etc/os-release")
    if release.is_file():
        for line in release.read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
    return f"{platform.system()} {platform.release()}".strip()


def _cpu_name() -> str | None:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.lower().startswith(("model name", "hardware")):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None


# --- torch build ------------------------------------------------------------------


def probe_torch(torch) -> TorchBuild:
    if torch is None:
        return TorchBuild()
    cuda = _str_or_none(_safe(lambda: torch.version.cuda))
    hip = _str_or_none(_safe(lambda: getattr(torch.version, "hip", None)))
    available = _safe(lambda: bool(torch.cuda.is_available())) if cuda or hip else False
    arch = _safe(lambda: list(torch.cuda.get_arch_list())) if cuda else None
    runtime, compiled = _cudnn_versions(torch) if cuda else (None, None)
    count = _safe(lambda: int(torch.cuda.device_count())) if available else None
    return TorchBuild(
        version=_safe(lambda: str(torch.__version__)),
        cuda=cuda,
        hip=hip,
        debug=_safe(lambda: bool(torch.version.debug)),
        cuda_available=available,
        device_count=count,
        arch_list=tuple(arch) if arch else None,
        arch_list_source="torch.cuda.get_arch_list()" if arch else None,
        cudnn_version=runtime,
        cudnn_compile_version=compiled,
        cudnn_source="torch.backends.cudnn.version() (the library torch loaded)" if runtime else None,
        cudnn_library=_loaded_library("libcudnn") if runtime else None,
        cublas_version=_library_version(_loaded_library("libcublas.")) if cuda else None,
        cpu_capability=_str_or_none(_safe(lambda: torch.backends.cpu.get_cpu_capability())),
    )


def _cudnn_versions(torch) -> tuple[int | None, int | None]:
    """(runtime, compile-time) cuDNN as integers. ``torch.backends.cudnn.version()``
    raises when they are incompatible, so read both from ``torch._C._cudnn`` too."""
    runtime = _safe(lambda: torch.backends.cudnn.version())
    raw = _attr(torch, "_C._cudnn")
    compiled = _safe(lambda: _version_int(raw.getCompileVersion())) if raw is not None else None
    if runtime is None and raw is not None:
        runtime = _safe(lambda: _version_int(raw.getRuntimeVersion()))
    return runtime, compiled


def _version_int(triple) -> int:
    major, minor, patch = (int(x) for x in triple)
    return major * 10000 + minor * 100 + patch if major >= 9 else major * 1000 + minor * 100 + patch


def _loaded_library(stem: str) -> str | None:
    """Path of the first mapped shared library whose file name starts with ``stem`` (Linux)."""
    maps = Path(f"/proc/{os.getpid()}/maps")
    try:
        for line in maps.read_text().splitlines():
            path = line.split()[-1] if line.split() else ""
            if "/" in path and Path(path).name.startswith(stem):
                return path
    except OSError:
        return None
    return None


def _library_version(path: str | None) -> str | None:
    if not path:
        return None
    name = Path(path).name  # libcublas.so.12.1.3.1
    parts = name.split(".so.", 1)
    return parts[1] if len(parts) == 2 and parts[1] else None


def _fill_capabilities(gpus: tuple[GPU, ...], torch, build: TorchBuild) -> tuple[GPU, ...]:
    """NVML first; torch when NVML saw nothing; the name table for what is still missing."""
    import dataclasses

    if not gpus and build.cuda_available and torch is not None:
        gpus = tuple(
            GPU(index=i, name=_safe(lambda i=i: str(torch.cuda.get_device_name(i))),
                capability=_safe(lambda i=i: tuple(int(x) for x in torch.cuda.get_device_capability(i))),
                capability_source="torch")
            for i in range(build.device_count or 0)
        )
    out = []
    for g in gpus:
        if g.capability is None and capability_from_name(g.name) is not None:
            g = dataclasses.replace(g, capability=capability_from_name(g.name), capability_source="name table")
        out.append(g)
    return tuple(out)


# --- math mode ----------------------------------------------------------------------


def probe_math(torch, environ) -> MathFlags:
    env = dict(environ)
    if torch is None:
        return MathFlags(cublas_workspace_config=env.get("CUBLAS_WORKSPACE_CONFIG"),
                         nvidia_tf32_override=env.get("NVIDIA_TF32_OVERRIDE"))
    return MathFlags(
        recorded=True,
        matmul_allow_tf32=_flag(torch, "backends.cuda.matmul.allow_tf32"),
        matmul_fp32_precision=_str(torch, "backends.cuda.matmul.fp32_precision"),
        cudnn_allow_tf32=_flag(torch, "backends.cudnn.allow_tf32"),
        conv_fp32_precision=_str(torch, "backends.cudnn.conv.fp32_precision"),
        float32_matmul_precision=_str_or_none(_safe(lambda: torch.get_float32_matmul_precision())),
        fp16_reduced_precision_reduction=_flag(torch, "backends.cuda.matmul.allow_fp16_reduced_precision_reduction"),
        bf16_reduced_precision_reduction=_flag(torch, "backends.cuda.matmul.allow_bf16_reduced_precision_reduction"),
        fp16_accumulation=_flag(torch, "backends.cuda.matmul.allow_fp16_accumulation"),
        cudnn_enabled=_flag(torch, "backends.cudnn.enabled"),
        cudnn_benchmark=_flag(torch, "backends.cudnn.benchmark"),
        cudnn_deterministic=_flag(torch, "backends.cudnn.deterministic"),
        deterministic_algorithms=_bool_or_none(_safe(lambda: torch.are_deterministic_algorithms_enabled())),
        deterministic_warn_only=_bool_or_none(
            _safe(lambda: torch.is_deterministic_algorithms_warn_only_enabled())),
        cublas_workspace_config=env.get("CUBLAS_WORKSPACE_CONFIG"),
        nvidia_tf32_override=env.get("NVIDIA_TF32_OVERRIDE"),
    )


def _str_or_none(v) -> str | None:
    return v if isinstance(v, str) else None


def _bool_or_none(v) -> bool | None:
    return v if isinstance(v, bool) else None


def _flag(torch, dotted: str) -> bool | None:
    v = _attr(torch, dotted)
    # bool(v) would accept a mock or a module; only a real bool-like value counts
    return bool(v) if isinstance(v, (bool, int)) else None


def _str(torch, dotted: str) -> str | None:
    v = _attr(torch, dotted)
    return v if isinstance(v, str) else None


if __name__ == "__main__":  # pragma: no cover - handy when debugging a machine
    import json

    json.dump(collect().to_dict(), sys.stdout, indent=2)
