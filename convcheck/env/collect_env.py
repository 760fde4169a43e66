"""Parse the text ``python -m torch.utils.collect_env`` prints into a Fingerprint.

That text is what people paste into bug reports. Its format has grown over
the years (torch 1.0 "Is debug build: No" ... torch 2.x "CUDA_MODULE_LOADING",
a CPU block, "Is XPU available"), so the parser reads ``Key: value`` lines it
knows and ignores the rest. What the text cannot say (compute capability, the
arch list, math flags) is filled from the tables and marked as inferred.

Caveat carried into the record: collect_env's "cuDNN version" lists the
cuDNN files installed on the system, not the one torch loaded
(pytorch/pytorch#78489); a pip ``nvidia-cudnn-cu*`` pin, when listed, is the
better evidence for wheels that bundle cuDNN.
"""

from __future__ import annotations

import re

from convcheck.env.fingerprint import GPU, Driver, Fingerprint, Host, MathFlags, TorchBuild, anonymise_uuid
from convcheck.env.tables import (
    capability_from_name,
    cudnn_version_int,
    parse_version,
    wheel_arches,
)

_KEYS = (
    "PyTorch version", "Is debug build", "CUDA used to build PyTorch", "ROCM used to build PyTorch",
    "OS", "GCC version", "Clang version", "CMake version", "Libc version",
    "Python version", "Python platform", "Is CUDA available", "CUDA runtime version",
    "CUDA_MODULE_LOADING set to", "GPU models and configuration", "Nvidia driver version",
    "cuDNN version", "HIP runtime version", "MIOpen runtime version", "Is XNNPACK available",
    "Is XPU available", "XPU used to build PyTorch", "Caching allocator config", "CPU",
    "Versions of relevant libraries",
)
_KEY_RE = re.compile(r"^(" + "|".join(re.escape(k) for k in _KEYS) + r"):\s*(.*)$")
_MISSING = {"", "could not collect", "n/a", "none", "no cuda", "not available"}


def looks_like_collect_env(text: str) -> bool:
    return "PyTorch version:" in text and (
        "CUDA used to build PyTorch:" in text or "Is CUDA available:" in text
    )


def parse_sections(text: str) -> dict[str, list[str]]:
    """Known key -> [first-line value, continuation lines...]."""
    out: dict[str, list[str]] = {}
    current: str | None = None
    for raw in text.splitlines():
        line = raw.rstrip()
        m = _KEY_RE.match(line.strip())
        if m:
            current = m.group(1)
            out.setdefault(current, []).append(m.group(2).strip())
            continue
        if current is None:
            continue
        if not line.strip():
            # a blank line ends every block but the library list and the CPU block
            if current not in ("Versions of relevant libraries",):
                current = None
            continue
        out[current].append(line.strip())
    return out


def parse_collect_env(text: str, source: str = "collect_env text") -> Fingerprint:
    s = parse_sections(text)
    first = {k: _value(v[0]) if v else None for k, v in s.items()}
    libs = _libraries(s.get("Versions of relevant libraries", []))

    torch_version = first.get("PyTorch version")
    cuda = _cuda_major_minor(first.get("CUDA used to build PyTorch"))
    hip = first.get("ROCM used to build PyTorch")
    cudnn, cudnn_source = _cudnn(s.get("cuDNN version", []), libs)

    arch, arch_source = None, None
    if cuda and _official_build(torch_version):
        found = wheel_arches(parse_version(cuda))
        if found:
            arch, why = found
            arch_source = f"inferred: official cu{cuda.replace('.', '')} wheel ({why})"

    notes = []
    if cudnn_source and "system" in cudnn_source:
        notes.append("collect_env lists the system's cuDNN files, not the one torch loads (pytorch/pytorch#78489)")

    return Fingerprint(
        source=source,
        host=Host(
            os=first.get("OS"),
            platform=first.get("Python platform"),
            python=(first.get("Python version") or "").split(" ")[0] or None,
            cpu=_cpu(s.get("CPU", [])),
        ),
        torch=TorchBuild(
            version=torch_version,
            cuda=cuda,
            hip=hip,
            debug=_yes_no(first.get("Is debug build")),
            cuda_available=_yes_no(first.get("Is CUDA available")),
            arch_list=arch,
            arch_list_source=arch_source,
            cudnn_version=cudnn,
            cudnn_source=cudnn_source,
            cublas_version=libs.get("cublas"),
        ),
        driver=Driver(version=first.get("Nvidia driver version")),
        gpus=_gpus(s.get("GPU models and configuration", [])),
        math=MathFlags(recorded=False),
        notes=tuple(notes),
    )


def _value(v: str | None) -> str | None:
    if v is None or v.strip().lower() in _MISSING:
        return None
    return v.strip()


def _yes_no(v: str | None) -> bool | None:
    if v is None:
        return None
    return {"yes": True, "true": True, "no": False, "false": False}.get(v.lower())


def _cuda_major_minor(v: str | None) -> str | None:
    version = parse_version(v)
    if not version:
        return None
    return ".".join(str(p) for p in version[:2])


def _official_build(torch_version: str | None) -> bool:
    """Release wheels look like '2.4.0' or '2.4.0+cu121'; source builds like '1.8.0a0+1606899'."""
    return bool(torch_version) and re.fullmatch(r"\d+\.\d+(\.\d+)?(\+cu\d+)?", torch_version) is not None


def _gpus(lines: list[str]) -> tuple[GPU, ...]:
    gpus = []
    for line in lines:
        line = line.strip()
        if not _value(line):
            continue
        m = re.match(r"GPU (\d+):\s*(.*)$", line)
        index, name = (int(m.group(1)), m.group(2)) if m else (len(gpus), line)
        uuid = re.search(r"\(UUID:\s*([^)]+)\)", name)
        name = re.sub(r"\s*\(UUID:[^)]*\)", "", name).strip()
        cc = capability_from_name(name)
        gpus.append(GPU(
            index=index, name=name, uuid_hash=anonymise_uuid(uuid.group(1).strip()) if uuid else None,
            capability=cc, capability_source="name table" if cc else None,
        ))
    return tuple(gpus)


def _libraries(lines: list[str]) -> dict[str, str]:
    """cuDNN/cuBLAS/cudatoolkit versions from '[pip3] nvidia-cudnn-cu12==9.1.0.70' style lines."""
    out: dict[str, str] = {}
    for line in lines:
        m = re.match(r"\[(pip\d?|conda)\]\s+(\S+?)(?:==|\s+)(\S+)", line)
        if not m:
            continue
        name, version = m.group(2).lower(), m.group(3)
        if re.fullmatch(r"nvidia-cudnn-cu\d+", name):
            out["cudnn"] = version
        elif re.fullmatch(r"nvidia-cublas-cu\d+", name):
            out["cublas"] = version
        elif name in ("cudatoolkit", "cuda-toolkit"):
            out["cudatoolkit"] = version
        elif name == "cudnn" and m.group(1) == "conda":
            out.setdefault("cudnn", version)
        elif name == "pytorch" and m.group(1) == "conda":
            build = re.search(r"cuda(\d+\.\d+)[\d.]*_cudnn(\d+\.\d+\.\d+)", line)
            if build:  # conda build string: py3.8_cuda11.0.221_cudnn8.0.5_0
                out.setdefault("cudnn", build.group(2))
    return out


def _cudnn(lines: list[str], libs: dict[str, str]) -> tuple[int | None, str | None]:
    if "cudnn" in libs and parse_version(libs["cudnn"]):
        v = parse_version(libs["cudnn"])
        return cudnn_version_int(v[:3]), "pip/conda package (the cuDNN the wheel bundles)"
    versions = []
    for line in lines:
        for m in re.finditer(r"libcudnn\.so\.(\d+(?:\.\d+){0,2})|cudnn(?:64_|_[a-z_]+64_)(\d+)\.dll", line):
            v = parse_version(m.group(1) or m.group(2))
            if v:
                versions.append(v)
        if not versions:
            plain = re.fullmatch(r"(\d+\.\d+\.\d+)", line.strip())
            if plain:
                versions.append(parse_version(plain.group(1)))
    if not versions:
        return None, None
    best = max(versions)
    return cudnn_version_int(best[:3]), "system cuDNN files listed by collect_env"


def _cpu(lines: list[str]) -> str | None:
    for line in lines:
        m = re.match(r"(Model name|Name):\s*(.+)$", line)
        if m:
            return m.group(2).strip()
    return None
