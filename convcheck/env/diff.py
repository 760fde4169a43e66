"""Differences between two fingerprints that matter for numerics (``--against``).

Typical use: the CPU box where training converges against the GPU server
where it does not. Only fields that can change results are compared; a
difference says why it matters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from convcheck.env.fingerprint import Fingerprint
from convcheck.env.rules import tf32_state
from convcheck.env.tables import cudnn_version_tuple, format_version


@dataclass(frozen=True)
class Difference:
    field: str
    left: str
    right: str
    why: str

    def to_dict(self) -> dict:
        return asdict(self)


def _gpus(fp: Fingerprint) -> str:
    if not fp.gpus:
        return "none"
    return ", ".join(
        f"{g.name or '?'}" + (f" (cc {g.capability[0]}.{g.capability[1]})" if g.capability else "")
        for g in fp.gpus
    )


def _cudnn(fp: Fingerprint) -> str:
    v = cudnn_version_tuple(fp.torch.cudnn_version)
    return format_version(v) if v else "none"


def _tf32(fp: Fingerprint) -> str:
    if not any(g.capability and g.capability >= (8, 0) for g in fp.gpus):
        return "n/a (no GPU with compute capability >= 8.0)"
    matmul, conv, _ = tf32_state(fp)
    on = [w for w, flag in (("matmul", matmul), ("conv", conv)) if flag]
    return ("on for " + " and ".join(on)) if on else "off"


def _flag(v) -> str:
    return "unknown" if v is None else ("on" if v else "off")


# (label, getter, why it matters)
_FIELDS = [
    ("torch", lambda fp: fp.torch.version or "unknown",
     "different torch versions can pick different kernels and defaults"),
    ("torch CUDA build", lambda fp: fp.torch.cuda or "CPU-only",
     "CUDA version decides cuBLAS/cuDNN and which GPUs have kernels"),
    ("cuDNN", _cudnn, "convolution algorithms and their accuracy change between cuDNN versions"),
    ("driver", lambda fp: fp.driver.version or "none", "the driver JIT-compiles PTX and bounds the usable CUDA"),
    ("GPUs", _gpus, "compute capability decides TF32, bfloat16 support and which kernels run"),
    ("TF32 in effect", _tf32, "TF32 rounds float32 matmul/conv inputs to a 10-bit mantissa"),
    ("float32 matmul precision", lambda fp: fp.math.float32_matmul_precision or "unknown",
     "'high'/'medium' let float32 matmuls use TF32/bfloat16"),
    ("cudnn.benchmark", lambda fp: _flag(fp.math.cudnn_benchmark),
     "benchmarking picks convolution algorithms per run"),
    ("deterministic algorithms", lambda fp: _flag(fp.math.deterministic_algorithms),
     "nondeterministic kernels make a target differ from itself"),
    ("fp16 reduced-precision reduction", lambda fp: _flag(fp.math.fp16_reduced_precision_reduction),
     "changes fp16 GEMM accumulation"),
    ("bf16 reduced-precision reduction", lambda fp: _flag(fp.math.bf16_reduced_precision_reduction),
     "changes bf16 GEMM accumulation"),
    ("CUBLAS_WORKSPACE_CONFIG", lambda fp: fp.math.cublas_workspace_config or "unset",
     "needed for deterministic cuBLAS on older torch"),
    ("NVIDIA_TF32_OVERRIDE", lambda fp: fp.math.nvidia_tf32_override or "unset",
     "0 disables TF32 process-wide"),
    ("CPU", lambda fp: fp.host.cpu or "unknown", "CPU kernels (and their summation order) depend on the CPU"),
    ("torch CPU capability", lambda fp: fp.torch.cpu_capability or "unknown",
     "AVX2 vs AVX512 kernels reduce in a different order"),
    ("Python", lambda fp: fp.host.python or "unknown", "rarely matters; listed for completeness"),
]


def diff(left: Fingerprint, right: Fingerprint) -> list[Difference]:
    """Fields whose values differ; 'unknown' on either side is not a difference."""
    out = []
    for label, get, why in _FIELDS:
        a, b = get(left), get(right)
        if a != b and "unknown" not in (a, b):
            out.append(Difference(label, a, b, why))
    return out
