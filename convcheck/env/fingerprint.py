"""The fingerprint record: what a machine's numeric stack is, as plain frozen data.

Every field may be ``None`` ("not available"); renderers say so, rules stay
quiet. ``to_dict``/``from_dict`` give a JSON-safe form with a schema key.
Reading and writing files (``load``/``save``) lives in ``convcheck.env.loading``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass, field, fields
from typing import Any

from convcheck.env.fields import check_list, check_section
from convcheck.env.tables import parse_version
from convcheck.errors import UsageError

SCHEMA = "convcheck.fingerprint/1"


@dataclass(frozen=True)
class Host:
    os: str | None = None
    platform: str | None = None
    machine: str | None = None
    python: str | None = None
    cpu: str | None = None


@dataclass(frozen=True)
class TorchBuild:
    version: str | None = None
    cuda: str | None = None  # torch.version.cuda: CUDA torch was built with; None = CPU-only build
    hip: str | None = None
    debug: bool | None = None
    cuda_available: bool | None = None
    device_count: int | None = None
    arch_list: tuple[str, ...] | None = None
    arch_list_source: str | None = None  # "torch.cuda.get_arch_list()" or the wheel table entry
    cudnn_version: int | None = None  # the cuDNN torch loaded (or the best evidence, see cudnn_source)
    cudnn_compile_version: int | None = None
    cudnn_source: str | None = None
    cudnn_library: str | None = None  # path of the libcudnn the process mapped
    cublas_version: str | None = None
    cpu_capability: str | None = None  # torch.backends.cpu.get_cpu_capability(): AVX2, AVX512, ...

    @property
    def cpu_only(self) -> bool:
        return self.version is not None and self.cuda is None and self.hip is None


@dataclass(frozen=True)
class Driver:
    version: str | None = None
    cuda_version: str | None = None  # newest CUDA the driver supports, from NVML ("12.4")
    nvml_error: str | None = None  # why NVML could not start (library missing, version mismatch)
    rm_mismatch: bool = False  # NVML error 18: driver upgraded, machine not rebooted
    torch_warning: str | None = None  # torch's own "NVIDIA driver ... is too old" warning, quoted from pasted text


@dataclass(frozen=True)
class GPU:
    index: int
    name: str | None = None
    uuid_hash: str | None = None  # short hash of the UUID, never the UUID itself
    pci_bus_id: str | None = None
    capability: tuple[int, int] | None = None
    capability_source: str | None = None  # "nvml", "torch" or "name table"
    memory_total_mib: int | None = None
    ecc_enabled: bool | None = None
    ecc_pending: bool | None = None
    ecc_volatile_corrected: int | None = None
    ecc_volatile_uncorrected: int | None = None
    ecc_aggregate_corrected: int | None = None
    ecc_aggregate_uncorrected: int | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    clock_event_reasons: int | None = None  # NVML bit mask
    temperature_c: int | None = None
    temperature_slowdown_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    mig_enabled: bool | None = None
    persistence_enabled: bool | None = None
    unreadable: tuple[str, ...] = ()  # probes refused (NoPermission, FunctionNotFound, ...)


@dataclass(frozen=True)
class MathFlags:
    """Math-mode switches; ``recorded`` is False when the source had none (collect_env)."""

    recorded: bool = True
    matmul_allow_tf32: bool | None = None
    matmul_fp32_precision: str | None = None
    cudnn_allow_tf32: bool | None = None
    conv_fp32_precision: str | None = None
    float32_matmul_precision: str | None = None
    fp16_reduced_precision_reduction: bool | None = None
    bf16_reduced_precision_reduction: bool | None = None
    fp16_accumulation: bool | None = None
    cudnn_enabled: bool | None = None
    cudnn_benchmark: bool | None = None
    cudnn_deterministic: bool | None = None
    deterministic_algorithms: bool | None = None
    deterministic_warn_only: bool | None = None
    cublas_workspace_config: str | None = None
    nvidia_tf32_override: str | None = None


@dataclass(frozen=True)
class Dispatch:
    """What picks kernels beyond the math-mode flags (issue 36): the scaled-dot-product-attention backends
    enabled and the one a representative call (``sdpa_probe``) dispatched to here, the Triton installed (the
    compiler inductor's GPU kernels come from), and the environment variables
    that change numerics or algorithm choice (``NCCL_*``, ``TORCH_*``, ``CUDA_*``... as ``NAME=value``).
    ``recorded`` is False for a source without them (older fingerprints, collect_env)."""

    recorded: bool = False
    sdpa_flash: bool | None = None
    sdpa_mem_efficient: bool | None = None
    sdpa_math: bool | None = None
    sdpa_cudnn: bool | None = None
    sdpa_probe: str | None = None
    sdpa_dispatched: str | None = None
    triton: str | None = None
    env: tuple[str, ...] = ()


@dataclass(frozen=True)
class Fingerprint:
    source: str = "this machine"
    collected_at: str | None = None
    host: Host = field(default_factory=Host)
    torch: TorchBuild = field(default_factory=TorchBuild)
    driver: Driver = field(default_factory=Driver)
    gpus: tuple[GPU, ...] = ()
    math: MathFlags = field(default_factory=MathFlags)
    notes: tuple[str, ...] = ()
    dispatch: Dispatch = field(default_factory=Dispatch)

    # -- derived views --------------------------------------------------------

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)

    @property
    def torch_version(self):
        return parse_version(self.torch.version)

    @property
    def cuda_build(self):
        return parse_version(self.torch.cuda)

    @property
    def on_windows_driver(self) -> bool:
        """Windows and WSL report the Windows driver, which has its own numbering."""
        text = f"{self.host.os or ''} {self.host.platform or ''}".lower()
        return "windows" in text or "microsoft" in text or "wsl" in text

    # -- JSON -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d = _plain(dataclasses.asdict(self))
        return {"schema": SCHEMA, **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Fingerprint":
        """The record from its JSON form, checked field by field (``convcheck.env.fields``): a wrong
        type or an absurd value is a one-line ``UsageError`` naming the field."""
        if not isinstance(d, dict):
            raise UsageError("fingerprint JSON must be an object")
        schema = d.get("schema")
        if schema != SCHEMA:
            shown = schema if isinstance(schema, str) and len(schema) < 80 else type(schema).__name__
            raise UsageError(f"not a convcheck fingerprint (schema {shown!r}, expected {SCHEMA!r})")
        top = check_section(cls, d, "")
        return cls(
            source=top.get("source") or "fingerprint JSON",
            collected_at=top.get("collected_at"),
            host=_build(Host, d.get("host"), "host"),
            torch=_build(TorchBuild, d.get("torch"), "torch"),
            driver=_build(Driver, d.get("driver"), "driver"),
            gpus=tuple(_build_gpu(i, g) for i, g in enumerate(check_list(d.get("gpus"), "gpus"))),
            math=_build(MathFlags, d.get("math"), "math"),
            notes=top.get("notes") or (),
            dispatch=_build(Dispatch, d.get("dispatch"), "dispatch"),
        )


def anonymise_uuid(uuid: str | None) -> str | None:
    """'GPU-8f0e...' -> 'uuid:3f9a1c2e' (first 8 hex digits of its SHA-256)."""
    if not uuid:
        return None
    if uuid.startswith("uuid:"):
        return uuid
    return "uuid:" + hashlib.sha256(uuid.encode()).hexdigest()[:8]


def _plain(obj):
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def _build(cls, data, where: str):
    if data is None:
        return cls()
    return cls(**check_section(cls, data, where))


def _build_gpu(i: int, data) -> GPU:
    where = f"gpus[{i}]"
    if not isinstance(data, dict):
        raise UsageError(f"malformed fingerprint JSON: field {where} must be an object, got {type(data).__name__}")
    data = dict(data)
    if data.get("index") is None:
        data["index"] = i
    if "uuid" in data:  # a raw UUID from elsewhere never reaches the record
        uuid = data.pop("uuid")
        if uuid is not None and not isinstance(uuid, str):
            raise UsageError(f"malformed fingerprint JSON: field {where}.uuid must be text")
        data["uuid_hash"] = anonymise_uuid(uuid[:200] if uuid else None)
    return _build(GPU, data, where)


def redact_uuids(text: str) -> str:
    """Replace every 'GPU-xxxxxxxx-...' UUID in free text by its short hash."""
    return re.sub(
        r"\b(?:GPU|MIG)-[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}\b",
        lambda m: anonymise_uuid(m.group(0)) or "",
        text,
    )
