"""Library rules: the cuDNN torch loaded (DNN) and known-bad cuBLAS versions (BLAS).
"""

from __future__ import annotations

from convcheck.env import tables as t
from convcheck.env.fingerprint import Fingerprint
from convcheck.env.rules.base import fmt_version, gpu_label, make_finding, rule


# --- cuDNN / cuBLAS -------------------------------------------------------------------


@rule
def cudnn_mismatch(fp: Fingerprint):
    """DNN001 (critical): the loaded cuDNN is incompatible with the one torch was
    compiled against (different major; or, from cuDNN 7, an older minor)."""
    run = t.cudnn_version_tuple(fp.torch.cudnn_version)
    comp = t.cudnn_version_tuple(fp.torch.cudnn_compile_version)
    if not run or not comp or not (fp.torch.cudnn_source or "").startswith("torch"):
        return
    if run[0] != comp[0]:
        bad = True
    elif run[0] < 7:
        bad = run[1] != comp[1]
    else:
        bad = run[1] < comp[1]
    if bad:
        yield make_finding(
            "DNN001", "critical",
            f"torch was compiled against cuDNN {fmt_version(comp)} but loaded cuDNN {fmt_version(run)}"
            + (f" from {fp.torch.cudnn_library}" if fp.torch.cudnn_library else ""),
            "Let torch load the cuDNN it bundles: remove other cuDNN directories from LD_LIBRARY_PATH, "
            f"or install cuDNN {comp[0]}.{comp[1]}.",
            "torch/backends/cudnn/__init__.py (_init: 'cuDNN version incompatibility')",
        )


@rule
def cudnn_outside_torch(fp: Fingerprint):
    """DNN002 (warn): the cuDNN torch loaded lives outside the torch/pip/conda install."""
    path = fp.torch.cudnn_library
    if not path:
        return
    inside = any(s in path for s in ("site-packages", "dist-packages", "/envs/", "conda", "/torch/lib/"))
    if not inside:
        yield make_finding(
            "DNN002", "warn",
            f"torch loaded cuDNN from {path}, outside its own install: a system cuDNN is not the version "
            "this torch build was tested with",
            "Remove that directory from LD_LIBRARY_PATH (or the ldconfig cache) so torch loads the cuDNN "
            "its wheel bundles.",
            "pytorch/pytorch#78489; torch/backends/cudnn/__init__.py (LD_LIBRARY_PATH hint)",
        )


@rule
def cudnn_known_bad(fp: Fingerprint):
    """DNN003: a cuDNN version with a documented numerics or support problem."""
    v = t.cudnn_version_tuple(fp.torch.cudnn_version)
    if not v or fp.torch.cuda is None:
        return
    caveat = ""
    if "system" in (fp.torch.cudnn_source or ""):
        caveat = " (as listed by collect_env: a system file, possibly not the one torch loads)"
    ccs = [g.capability for g in fp.gpus if g.capability]
    for bad in t.KNOWN_BAD_CUDNN:
        if not (bad["lo"] <= v < bad["hi"]):
            continue
        if bad["cc"] is not None and not any(bad["cc"](cc) for cc in ccs):
            continue
        yield make_finding(
            "DNN003", bad["severity"],
            f"cuDNN {fmt_version(v)}{caveat}: {bad['what']}",
            "Use a torch build bundling a cuDNN outside the affected range, or disable cuDNN for the affected "
            "layers (torch.backends.cudnn.flags(enabled=False)).",
            bad["source"],
        )


@rule
def cublas_known_bad(fp: Fingerprint):
    """BLAS001: the cuBLAS of torch's CUDA version has a known wrong-result bug on these GPUs."""
    cuda = fp.cuda_build
    if not cuda or len(cuda) < 2:
        return
    for bad in t.KNOWN_BAD_CUBLAS:
        hit = [g for g in fp.gpus if g.capability and bad["cc"](g.capability)]
        if bad["cuda"](cuda) and hit:
            yield make_finding(
                "BLAS001", bad["severity"],
                f"{bad['what']}: torch {fp.torch.version} uses CUDA {fmt_version(cuda[:2])} on {gpu_label(hit[0])}",
                "Install a torch wheel built with a different CUDA version (e.g. CUDA 10.2 or 11.3+) and "
                "re-check matmul results against the CPU.",
                bad["source"], hit[0].index,
            )
