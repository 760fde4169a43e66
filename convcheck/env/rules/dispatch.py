"""Dispatch rules (issue 36): the attention backend, the Triton that compiles, and the environment variables
that steer numerics (SDP, TRI, VAR). Each stays quiet when the fingerprint did not record its value."""

from __future__ import annotations

from convcheck.env import tables as t
from convcheck.env.fingerprint import Fingerprint
from convcheck.env.rules.base import make_finding, rule


def _env(fp: Fingerprint) -> dict[str, str]:
    return dict(v.split("=", 1) for v in fp.dispatch.env if "=" in v)


@rule
def sdpa_cudnn_first(fp: Fingerprint):
    """SDP001 (warn): torch 2.5.0 put the cuDNN attention backend first on H100-class GPUs (compute
    capability 9.0), and its backward gave NaN gradients; 2.5.1 moved it last."""
    v = t.parse_version(fp.torch.version or "")
    d = fp.dispatch
    if not d.recorded or v is None or v[:3] != (2, 5, 0) or d.sdpa_cudnn is False:
        return
    if not any(g.capability and g.capability >= (9, 0) for g in fp.gpus):
        return
    ran = f"; a {d.sdpa_probe} call ran {d.sdpa_dispatched} here" if d.sdpa_dispatched else ""
    yield make_finding(
        "SDP001", "warn",
        f"torch {fp.torch.version} tries the cuDNN attention backend first on this GPU{ran}: its backward gave "
        "NaN gradients in scaled_dot_product_attention",
        "Upgrade to torch 2.5.1 or later, or turn the backend off: torch.backends.cuda.enable_cudnn_sdp(False).",
        "pytorch/pytorch#139298; huggingface/diffusers#9768",
    )


@rule
def triton_of_torch_27(fp: Fingerprint):
    """TRI001 (info): the Triton bundled with torch 2.7 changed compiled numerics: a torch.compile'd model can
    part from eager beyond rounding."""
    v = t.parse_version(fp.torch.version or "")
    if not fp.dispatch.recorded or fp.dispatch.triton is None or v is None or v[:2] != (2, 7):
        return
    yield make_finding(
        "TRI001", "info",
        f"torch {fp.torch.version} with Triton {fp.dispatch.triton}: the Triton bundled with torch 2.7 changed "
        "the numerics of compiled kernels",
        "Watch the compiled model and the eager one (convcheck.watch) and diff them; if they part beyond "
        "rounding, upgrade torch or compile with another backend.",
        "pytorch/pytorch#150516",
    )


@rule
def tf32_forced_by_env(fp: Fingerprint):
    """VAR001 (warn): TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 makes cuBLAS use TF32 for float32 matmuls whatever
    torch.backends.cuda.matmul.allow_tf32 says."""
    value = _env(fp).get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE")
    if value is None or value.strip().lower() not in ("1", "true", "on", "yes", "y"):
        return
    yield make_finding(
        "VAR001", "warn",
        f"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE={value} is set: float32 matmuls on the GPU round their inputs to TF32 "
        "(10-bit mantissa) even with torch.backends.cuda.matmul.allow_tf32 = False",
        "Unset TORCH_ALLOW_TF32_CUBLAS_OVERRIDE to let the TF32 switches decide.",
        "aten/src/ATen/Context.cpp (Context::allowTF32CuBLAS reads TORCH_ALLOW_TF32_CUBLAS_OVERRIDE)",
    )


@rule
def nccl_algorithm_chosen(fp: Fingerprint):
    """VAR002 (info): NCCL_ALGO / NCCL_PROTO choose the all-reduce's algorithm, and with it the order in which
    the ranks' gradients are summed."""
    chosen = {k: v for k, v in _env(fp).items() if k in ("NCCL_ALGO", "NCCL_PROTO")}
    if not chosen:
        return
    yield make_finding(
        "VAR002", "info",
        f"{', '.join(f'{k}={v}' for k, v in chosen.items())}: NCCL's all-reduce algorithm is chosen by hand; "
        "another algorithm sums the ranks' gradients in another order (results differ in the last bits)",
        "Set the same NCCL variables on both machines before comparing data-parallel runs.",
        "NCCL documentation, Environment Variables (NCCL_ALGO, NCCL_PROTO)",
    )
