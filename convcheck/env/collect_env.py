"""Parse the text ``python -m torch.utils.collect_env`` prints into a Fingerprint.

That text is what people paste into bug reports. Its format has grown over
the years (torch 1.0 "Is debug build: No" ... torch 2.x "CUDA_MODULE_LOADING",
a CPU block, "Is XPU available"), so the parser reads ``Key: value`` lines it
knows and ignores the rest. What the text cannot say (compute capability, the
arch list, math flags) is filled from the tables and marked as inferred.

Caveat carried into the record: collect_env's "cuDNN version" lists the
cuDNN files installed on the system, not the one torch loaded
(pytorch/pytorch#78489); a pip ``nvidia-cudnn-cu*`` pin, when listed, is the
better evidence for wheels that bundle cuDNN. When both are listed and differ,
the record says so in a note.

Pasted text is read tolerantly: CRLF or CR line ends, full-width colons
(``GPU 0：``), non-breaking spaces, e-mail/Markdown quote markers and code
fences, keys missing or out of order, in another case (``Os:``) or retyped
without their colon before a version or a yes/no (``PyTorch version 1.5.0``).
A text is collect_env output by its fields (``fields_read``: the torch version
or its CUDA, and one more), not by its first lines; the record's notes name the
fields read. Two reports pasted one after the other are not merged: the first
is read and a note says so. torch's own warning printed into the text ("The
NVIDIA driver on your system is too old (found version 11040)") is kept as
driver evidence: ``Driver.torch_warning`` and the CUDA it names (11.4).
"""

from __future__ import annotations

import re

from convcheck.env.fingerprint import GPU, Driver, Fingerprint, Host, MathFlags, TorchBuild, anonymise_uuid
from convcheck.env.tables import (
    capability_from_name,
    cudnn_version_int,
    format_version,
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
_KEY_RE = re.compile(r"^(" + "|".join(re.escape(k) for k in _KEYS) + r")\s*:\s*(.*)$", re.IGNORECASE)
# A key retyped without its colon ('PyTorch version 1.5.0'): read when a version or a yes/no follows; never
# 'CPU' (its block holds 'CPU family', 'CPU(s)' lines) nor a key whose value is free text.
_BARE_KEYS = tuple(k for k in _KEYS if k not in ("CPU", "OS", "GPU models and configuration", "Caching allocator config",
                                                 "Versions of relevant libraries"))
_BARE_KEY_RE = re.compile(r"^(" + "|".join(re.escape(k) for k in _BARE_KEYS) + r")\s+"
                          r"(\d[\w.+-]*(?:\s.*)?|(?:yes|no|true|false)\b.*)$", re.IGNORECASE)
# torch's own warnings, printed into the text when collect_env calls torch.cuda.is_available():
# the driver's CUDA version as cudaDriverGetVersion gives it (11040 = CUDA 11.4)
_DRIVER_TOO_OLD_RE = re.compile(r"The NVIDIA driver on your system is too old \(found version (\d{4,6})\)",
                                re.IGNORECASE)
_CANONICAL = {k.lower(): k for k in _KEYS}
# Characters pasted reports carry instead of ':' and ' ' (CJK input methods, word processors, HTML).
_LOOKALIKES = str.maketrans({"\uff1a": ":", "\ufe55": ":", "\ufe13": ":", "\u3000": " ", "\u00a0": " ",
                             "\u2007": " ", "\u202f": " ", "\ufeff": None, "\u200b": None, "\x00": None})
_QUOTE_RE = re.compile(r"^[ \t]*(?:>[ \t]?)+")
_VERSION_RE = re.compile(r"^PyTorch version(?:\s*:|\s+\d)", re.IGNORECASE)
_HEADER_RE = re.compile(r"^Collecting environment information", re.IGNORECASE)
_MISSING = {"", "could not collect", "n/a", "none", "no cuda", "not available"}


def normalise(text: str) -> str:
    """One '\\n' per line end, ASCII colons and spaces, no quote markers or code fences."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").translate(_LOOKALIKES)
    lines = (_QUOTE_RE.sub("", line) for line in text.split("\n"))
    return "\n".join(line for line in lines if not line.lstrip().startswith("```"))


def split_reports(text: str) -> list[str]:
    """The collect_env reports in ``text``, in order: each starts at its 'PyTorch version:' line, or at
    the 'Collecting environment information' line just above it."""
    lines = text.split("\n")
    versions = [i for i, line in enumerate(lines) if _VERSION_RE.match(line.strip())]
    if len(versions) <= 1:
        return [text]
    bounds = [0]
    for previous, i in zip(versions, versions[1:]):
        header = next((j for j in range(i - 1, max(previous, i - 4), -1)
                       if _HEADER_RE.match(lines[j].strip())), None)
        bounds.append(header if header is not None else i)
    bounds.append(len(lines))
    return ["\n".join(lines[a:b]) for a, b in zip(bounds, bounds[1:])]


# The fields that make a text collect_env output: the torch version (or the CUDA it was built with) and
# one more field a reader uses. Recognised by its fields, not its first lines: pasted reports lose the
# 'Collecting environment information...' line, get retyped, cut short.
_NAMING_FIELDS = ("PyTorch version", "CUDA used to build PyTorch")


def fields_read(text: str) -> list[str]:
    """The collect_env fields with a value in ``text`` (its first report), in the order collect_env prints
    them; torch's own driver warning counts as one ("torch's driver warning")."""
    report = split_reports(normalise(text))[0]
    sections = parse_sections(report)
    found = [k for k in _KEYS if any(_value(v) for v in sections.get(k, []))]
    if _DRIVER_TOO_OLD_RE.search(report):
        found.append("torch's driver warning")
    return found


def looks_like_collect_env(text: str) -> bool:
    found = fields_read(text)
    return any(k in found for k in _NAMING_FIELDS) and len(found) >= 2


def parse_sections(text: str) -> dict[str, list[str]]:
    """Known key -> [first-line value, continuation lines...]."""
    out: dict[str, list[str]] = {}
    current: str | None = None
    for raw in text.splitlines():
        line = raw.rstrip()
        m = _KEY_RE.match(line.strip()) or _BARE_KEY_RE.match(line.strip())
        if m:
            current = _CANONICAL[m.group(1).lower()]
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
    reports = split_reports(normalise(text))
    s = parse_sections(reports[0])
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
    if len(reports) > 1:
        notes.append(f"the text holds {len(reports)} collect_env reports one after the other; "
                     "only the first was read")
    if cudnn_source and "system" in cudnn_source:
        notes.append("collect_env lists the system's cuDNN files, not the one torch loads (pytorch/pytorch#78489)")
    mismatch = _cudnn_mismatch(s.get("cuDNN version", []), libs)
    if mismatch:
        notes.append(mismatch)
    read = fields_read(reports[0])
    notes.append(f"fields read from the text ({len(read)}): {', '.join(read)}")
    warning, driver_cuda = _driver_warning(reports[0])

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
        driver=Driver(version=first.get("Nvidia driver version"), cuda_version=driver_cuda, torch_warning=warning),
        gpus=_gpus(s.get("GPU models and configuration", [])),
        math=MathFlags(recorded=False),
        notes=tuple(notes),
    )


def _driver_warning(text: str) -> tuple[str | None, str | None]:
    """torch's "driver too old (found version 11040)" warning in the text: (the quote, the newest CUDA
    the driver supports, '11.4'); (None, None) without one."""
    m = _DRIVER_TOO_OLD_RE.search(text)
    if not m:
        return None, None
    found = int(m.group(1))
    return m.group(0), f"{found // 1000}.{found % 1000 // 10}"


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
        m = re.match(r"GPU (\d{1,4}):\s*(.*)$", line)
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
        if re.fullmatch(r"nvidia-cudnn(-cu\d+)?", name):
            out["cudnn"], out["cudnn_package"] = version, f"pip package {name}"
        elif re.fullmatch(r"nvidia-cublas(-cu\d+)?", name):
            out["cublas"] = version
        elif name in ("cudatoolkit", "cuda-toolkit"):
            out["cudatoolkit"] = version
        elif name == "cudnn" and m.group(1) == "conda" and "cudnn" not in out:
            out["cudnn"], out["cudnn_package"] = version, "conda package cudnn"
        elif name == "pytorch" and m.group(1) == "conda" and "cudnn" not in out:
            build = re.search(r"cuda(\d+\.\d+)[\d.]*_cudnn(\d+\.\d+\.\d+)", line)
            if build:  # conda build string: py3.8_cuda11.0.221_cudnn8.0.5_0
                out["cudnn"], out["cudnn_package"] = build.group(2), "the conda pytorch build"
    return out


def _cudnn(lines: list[str], libs: dict[str, str]) -> tuple[int | None, str | None]:
    pip = parse_version(libs.get("cudnn"))
    if pip:
        return cudnn_version_int(pip[:3]), "pip/conda package (the cuDNN the wheel bundles)"
    system = _system_cudnn(lines)
    if system is None:
        return None, None
    return cudnn_version_int(system[:3]), "system cuDNN files listed by collect_env"


def _system_cudnn(lines: list[str]):
    """The newest cuDNN version among the system files collect_env lists ('libcudnn.so.9.14.0', a DLL
    name, or a bare '8.9.2'); None when none is listed."""
    versions = []
    for line in lines:
        for m in re.finditer(r"libcudnn(?:_[a-z_]+)?\.so\.(\d{1,4}(?:\.\d{1,4}){0,2})(?!\d)"
                             r"|cudnn(?:64_|_[a-z_]+64_)(\d{1,4})\.dll", line):
            v = parse_version(m.group(1) or m.group(2))
            if v:
                versions.append(v)
        if not versions:
            plain = re.fullmatch(r"(\d{1,4}\.\d{1,4}\.\d{1,4})", line.strip())
            if plain:
                versions.append(parse_version(plain.group(1)))
    return max(versions) if versions else None


def _cudnn_mismatch(lines: list[str], libs: dict[str, str]) -> str | None:
    """The note when collect_env lists system cuDNN files of another version than the pip/conda cuDNN
    the wheel loads (pytorch/pytorch#78489)."""
    pip, system = parse_version(libs.get("cudnn")), _system_cudnn(lines)
    if not pip or not system or _pad3(pip) == _pad3(system):
        return None
    package = libs.get("cudnn_package", "the pip/conda cuDNN package")
    return (f"cuDNN: collect_env lists system cuDNN {format_version(system[:3])} files, but torch loads "
            f"cuDNN {format_version(_pad3(pip))} from {package}; the audit uses {format_version(_pad3(pip))} "
            "(collect_env reports system files, pytorch/pytorch#78489)")


def _pad3(v) -> tuple[int, int, int]:
    return (tuple(v) + (0, 0, 0))[:3]


def _cpu(lines: list[str]) -> str | None:
    for line in lines:
        m = re.match(r"(Model name|Name):\s*(.+)$", line)
        if m:
            return m.group(2).strip()
    return None
