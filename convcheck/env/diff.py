"""Differences between two fingerprints that matter for numerics (``--against``).

Typical use: the CPU box where training converges against the GPU server
where it does not. Only fields that can change results are compared; a
difference says why it matters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from convcheck.env.dispatch import steers_numerics
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
    ("SDPA backends enabled", lambda fp: _sdpa_enabled(fp),
     "scaled_dot_product_attention picks among the enabled backends; each rounds differently"),
    ("SDPA backend dispatched", lambda fp: _dispatch(fp, fp.dispatch.sdpa_dispatched, "none"),
     "the attention kernel a representative call ran here (flash, mem_efficient, cudnn, math)"),
    ("Triton", lambda fp: _dispatch(fp, fp.dispatch.triton, "absent"),
     "torch.compile's GPU kernels are Triton's: another Triton compiles other kernels"),
    ("CPU", lambda fp: fp.host.cpu or "unknown", "CPU kernels (and their summation order) depend on the CPU"),
    ("torch CPU capability", lambda fp: fp.torch.cpu_capability or "unknown",
     "AVX2 vs AVX512 kernels reduce in a different order"),
    ("Python", lambda fp: fp.host.python or "unknown", "rarely matters; listed for completeness"),
]


def _dispatch(fp: Fingerprint, value, missing: str) -> str:
    return "unknown" if not fp.dispatch.recorded else (value or missing)


def _sdpa_enabled(fp: Fingerprint) -> str:
    d = fp.dispatch
    flags = {"flash": d.sdpa_flash, "mem_efficient": d.sdpa_mem_efficient, "math": d.sdpa_math, "cudnn": d.sdpa_cudnn}
    if not d.recorded or all(v is None for v in flags.values()):
        return "unknown"
    return ", ".join(k for k, v in flags.items() if v) or "none"


def _env_vars(fp: Fingerprint) -> dict[str, str]:
    return dict(v.split("=", 1) for v in fp.dispatch.env if "=" in v)


def diff(left: Fingerprint, right: Fingerprint) -> list[Difference]:
    """Fields whose values differ; 'unknown' on either side is not a difference. The numerics environment
    variables (``dispatch.env``) one by one, when both sides recorded them."""
    out = []
    for label, get, why in _FIELDS:
        a, b = get(left), get(right)
        if a != b and "unknown" not in (a, b):
            out.append(Difference(label, a, b, why))
    if left.dispatch.recorded and right.dispatch.recorded:
        ea, eb = _env_vars(left), _env_vars(right)
        for name in sorted(set(ea) | set(eb)):
            if ea.get(name) != eb.get(name) and steers_numerics(name):
                out.append(Difference(name, ea.get(name, "unset"), eb.get(name, "unset"),
                                      "an environment variable that steers numerics or algorithm choice"))
    return out
