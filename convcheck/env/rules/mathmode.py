"""Math-mode rules: TF32 and reduced-precision reductions (MATH), and what makes runs
irreproducible (DET). ``tf32_state`` is the one reading of the TF32 flags.
"""

from __future__ import annotations

from convcheck.env import tables as t
from convcheck.env.fingerprint import Fingerprint
from convcheck.env.rules.base import gpu_label, make_finding, rule


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
    yield make_finding(
        "MATH001", "warn" if matmul else "info",
        f"TF32 is active for {what} on {gpu_label(ampere[0])}: {size}{assumed}",
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
        yield make_finding(
            "MATH002", "warn",
            "torch.backends.cuda.matmul.allow_fp16_accumulation is on: fp16 matmuls accumulate in fp16 "
            "(unit roundoff 2^-11 per addition; long dot products lose most digits)",
            "Set torch.backends.cuda.matmul.allow_fp16_accumulation = False.",
            source,
        )
    elif m.fp16_reduced_precision_reduction or m.bf16_reduced_precision_reduction:
        kinds = "/".join(k for k, on in (("fp16", m.fp16_reduced_precision_reduction),
                                         ("bf16", m.bf16_reduced_precision_reduction)) if on)
        yield make_finding(
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
        yield make_finding(
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
    yield make_finding(
        "DET002", "warn",
        f"torch.use_deterministic_algorithms(True) is on but CUBLAS_WORKSPACE_CONFIG is {value}: torch "
        f"{fp.torch.version} with CUDA {fp.torch.cuda} {effect} every cuBLAS call",
        "export CUBLAS_WORKSPACE_CONFIG=:4096:8 (or :16:8) before Python starts CUDA.",
        t.CUBLAS_CONFIG_SOURCE,
    )
