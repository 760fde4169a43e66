"""The kernel dispatch of this machine, for the fingerprint's ``dispatch`` section (issue 36).

The math-mode flags say what a matmul may round to; they do not say which attention kernel runs, which
compiler made a compiled model's kernels, or which variables steer NCCL's and cuBLAS's algorithms. Here:

- the SDPA backends enabled (``torch.backends.cuda.*_sdp_enabled``) and the backend one representative call
  dispatches to on this machine (batch 2, 4 heads, 128 tokens, head size 64: float16 on a CUDA GPU, float32
  on the CPU), read from the aten op it reaches (``_scaled_dot_product_flash_attention`` ...) under a
  ``TorchDispatchMode`` - torch 2.5.0 put cuDNN's first on H100-class GPUs, whose backward gave NaN
  gradients (pytorch#139298);
- Triton's version from the installed distribution's metadata (never imported: importing it can take
  seconds or fail on a machine without a GPU); whether inductor compiled the model is a watched run's
  ``compiled`` record (``watch/compiled.py``; ``compare`` never compiles);
- the environment variables that change numerics or algorithm choice: every ``NCCL_*``, ``TORCH_*``,
  ``TORCHINDUCTOR_*``, ``PYTORCH_*``, ``CUDA_*``, ``CUBLAS*``, ``CUDNN_*`` and ``NVIDIA_TF32_OVERRIDE``
  variable, as ``NAME=value`` (values cut at 200 characters, at most 100 variables).

Every probe returns None where it cannot tell; none raises.
"""

from __future__ import annotations

from convcheck.env.fingerprint import Dispatch

ENV_PREFIXES = ("NCCL_", "TORCH_", "TORCHINDUCTOR_", "PYTORCH_", "CUDA_", "CUBLAS", "CUDNN_", "NVIDIA_TF32_OVERRIDE")
MAX_VARS = 100
MAX_VALUE = 200
SDPA_BACKENDS = (("flash", "flash"), ("efficient", "mem_efficient"), ("cudnn", "cudnn"))
TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton", "pytorch-triton-rocm", "triton-xpu")


# Every variable of ENV_PREFIXES is recorded; these alone are compared (``env --against``, ``diff``): each one
# documented to change what a kernel computes or which kernel runs. The rest (which GPU, error handling, logging,
# caches, versions a container exports) changes no number, and a difference in them is no finding.
NUMERIC_VARS = (
    "NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_NVLS_ENABLE", "NCCL_COLLNET_ENABLE",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "TORCH_BLAS_PREFER_CUBLASLT", "TORCH_BLAS_PREFER_HIPBLASLT",
    "TORCH_CUDNN_V8_API_DISABLED", "TORCH_CUDNN_V8_API_LRU_CACHE_LIMIT", "TORCH_CUDNN_SDPA_ENABLED",
    "TORCHINDUCTOR_FALLBACK_RANDOM", "TORCHINDUCTOR_MAX_AUTOTUNE", "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM",
    "TORCHINDUCTOR_EMULATE_PRECISION_CASTS", "CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE",
    "NVIDIA_TF32_OVERRIDE")


def steers_numerics(name: str) -> bool:
    """Whether a recorded variable can change results (``env --against`` and ``diff`` compare only these)."""
    return name in NUMERIC_VARS


def numerics_env(environ) -> tuple[str, ...]:
    """``NAME=value`` of the variables that steer numerics or algorithm choice, sorted by name."""
    names = sorted(k for k in environ if isinstance(k, str) and k.startswith(ENV_PREFIXES))[:MAX_VARS]
    return tuple(f"{k}={str(environ[k])[:MAX_VALUE]}" for k in names)


def triton_version() -> str | None:
    from importlib import metadata

    for name in TRITON_DISTRIBUTIONS:
        try:
            return f"{metadata.version(name)} ({name})"
        except Exception:  # noqa: BLE001 - not installed, or broken metadata: the next name
            continue
    return None


def _enabled(torch, name: str) -> bool | None:
    try:  # a broken torch (or a fake) may raise at any attribute
        fn = getattr(getattr(getattr(torch, "backends", None), "cuda", None), f"{name}_sdp_enabled", None)
        v = fn() if callable(fn) else None
    except Exception:  # noqa: BLE001
        return None
    return v if isinstance(v, bool) else None


def sdpa_dispatch(torch, device: str | None = None) -> tuple[str | None, str | None]:
    """``(the call probed, the backend it reached)`` on ``device`` (a watched model's: its own GPU, so no other
    GPU gets a CUDA context), by default this machine's current CUDA GPU, else the CPU."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode

        class _Ops(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.names: list[str] = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.names.append(str(func))
                return func(*args, **(kwargs or {}))

        if device is None:
            device = "cuda" if bool(torch.cuda.is_available()) else "cpu"
        cuda = str(device).startswith("cuda")
        dtype = torch.float16 if cuda else torch.float32
        q = torch.full((2, 4, 128, 64), 0.5, device=device, dtype=dtype)  # no random draw: the caller's state kept
        with torch.no_grad(), _Ops() as ops:
            torch.nn.functional.scaled_dot_product_attention(q, q, q)
    except Exception:  # noqa: BLE001 - an old torch, a broken device: not known
        return None, None
    probe = f"{str(device).split(':')[0]} {str(dtype).replace('torch.', '')} (2, 4, 128, 64)"
    sdpa = [n for n in ops.names if "scaled_dot_product" in n]
    for key, label in SDPA_BACKENDS:
        if any(key in n for n in sdpa):
            return probe, label + ("" if cuda else " (CPU)")
    return probe, "math" if ops.names else None


def probe_dispatch(torch, environ, device: str | None = None) -> Dispatch:
    env = numerics_env(dict(environ))
    if torch is None:
        return Dispatch(recorded=True, triton=triton_version(), env=env)
    probe, dispatched = sdpa_dispatch(torch, device)
    return Dispatch(recorded=True, sdpa_flash=_enabled(torch, "flash"),
                    sdpa_mem_efficient=_enabled(torch, "mem_efficient"), sdpa_math=_enabled(torch, "math"),
                    sdpa_cudnn=_enabled(torch, "cudnn"), sdpa_probe=probe, sdpa_dispatched=dispatched,
                    triton=triton_version(), env=env)
