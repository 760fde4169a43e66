"""GPU marketing name -> CUDA compute capability, back to the first CUDA GPUs (Tesla architecture, 1.0).

Bug reports come from old cards too (a GeForce 210 is 1.2, a GTX 1070 6.1), and
a pasted ``collect_env`` text names the GPU but not its capability; the
ARCH rules need the capability to say that a wheel has no kernels for it.

Sources: NVIDIA, "CUDA GPUs - Compute Capability" (developer.nvidia.com/cuda-gpus)
and its "Legacy CUDA GPUs" page (developer.nvidia.com/cuda-legacy-gpus: Tesla,
Fermi, Kepler, Maxwell generations); the CUDA C++ Programming Guide's list of
compute capabilities per architecture; Jetson modules from the same pages.
A few names were sold with chips of two generations (GT 630, GT 640, GT 730,
GTX 860M); they take the variant noted beside them.

Patterns are matched, first match wins, against the lower-cased name with
'nvidia', 'geforce' and 'tesla' removed and '-'/'_' read as spaces.
"""

from __future__ import annotations

import re

CAPABILITY_SOURCE = ("NVIDIA developer.nvidia.com/cuda-gpus and developer.nvidia.com/cuda-legacy-gpus "
                     "(compute capability by GPU name)")

_PATTERNS: list[tuple[str, tuple[int, int]]] = [
    # Blackwell, Hopper, Ada, Ampere (data centre and workstation first: their names are short)
    (r"\brtx pro \d+ blackwell\b|\brtx 50[5-9]0\b", (12, 0)),
    (r"\bgb10\b", (12, 1)),
    (r"\bthor\b", (11, 0)),
    (r"\bg?b300\b", (10, 3)),
    (r"\bg?b[12]00\b", (10, 0)),
    (r"\bgh200\b|\bh[12]00\b|\bh800\b|\bh20\b", (9, 0)),
    (r"\bjetson agx orin\b|\borin\b", (8, 7)),
    (r"\brtx \d{4}( sff)? ada\b|\bl40s?\b|\bl4\b|\bl20\b|\brtx 40[5-9]0\b", (8, 9)),
    (r"\ba100\b|\ba800\b|\ba30\b", (8, 0)),
    (r"\brtx 2050\b|\bmx570\b", (8, 6)),  # Ampere GA107 despite the '20' name
    (r"\ba10g?\b|\ba40\b|\ba16\b|\ba2\b|\brtx a\d{3,4}\b|\brtx 30[5-9]0\b", (8, 6)),
    # Turing, Volta, Pascal
    (r"\btitan rtx\b|\bt4\b|\brtx 20[6-8]0\b|\bgtx 16[5-6]0\b|\bquadro rtx\b|\bquadro t\d{3,4}\b"
     r"|\bt(400|600|1000|1200|2000)\b|\bmx[45]50\b", (7, 5)),
    (r"\bxavier\b", (7, 2)),
    (r"\bv100\b|\btitan v\b|\bgv100\b", (7, 0)),
    (r"\btegra x2\b|\btx2\b", (6, 2)),
    (r"\bp100\b|\bgp100\b", (6, 0)),
    (r"\btitan xp\b|\btitan x \(pascal\)|\bgtx 10[5-8]0\b|\bgt 10[13]0\b|\bp4\b|\bp40\b|\bp6\b"
     r"|\bquadro p\d+|\bmx[123][35]0\b", (6, 1)),
    # Maxwell
    (r"\btegra x1\b|\btx1\b|\bjetson nano\b", (5, 3)),
    (r"\bgtx (950|960)m\b|\bgtx 860m\b", (5, 0)),  # GTX 860M: the GM107 variant (the GK104 one is 3.0)
    (r"\bgtx titan x\b|\btitan x\b|\bgtx 9[5-8]0( ti)?\b|\bgtx 9(65|70|80)m\b|\bm40\b|\bm60\b|\bm[46]\b"
     r"|\bquadro m[2-6]000\b", (5, 2)),
    (r"\bgtx 750( ti)?\b|\bgtx 850m\b|\b(830|840|930|940|945)m\b|\b9[234]0mx\b|\bmx1[13]0\b"
     r"|\bquadro k(620|1200|2200)\b|\bm10\b", (5, 0)),
    # Kepler
    (r"\bk80\b", (3, 7)),
    (r"\bk20(x|c|m|xm)?\b|\bk40[cm]?\b|\bgtx 780( ti)?\b|\bgtx titan( black| z)?\b|\bgt 7[123]0\b|\bquadro k6000\b", (3, 5)),
    (r"\bgtx 6[5-9]0( ti)?( boost)?\b|\bgtx 7[67]0\b|\bgt 640\b|\bgt 740\b|\bk10\b|\bgrid k[12]\b|\bgrid k5[02]0\b"
     r"|\bgtx 6[6-8]0m\b|\bgtx 7[6-8]0m\b|\bgtx 8[78]0m\b|\bquadro k(420|600|2000|4000|5000)\b", (3, 0)),
    # Fermi
    (r"\bgtx 560 ti 448\b|\bgtx 4(65|70|80)\b|\bgtx 5(70|80|90)\b|\bgtx 480m\b|\bc20(50|70|75)\b"
     r"|\bm20(50|70|75|90)\b|\bs2050\b|\bquadro [456]000\b", (2, 0)),
    (r"\bgt 4[234]0\b|\bgts 450\b|\bgtx 460( se)?\b|\bgt 5[234]0\b|\bgt 545\b|\bgtx 550 ti\b|\bgtx 560( ti| se)?\b"
     r"|\bgt 6[123]0\b|\bgt [45]\d\dm\b|\bgtx 4[67]0m\b|\bgtx 5[6-8]0m\b|\bquadro (600|2000)\b", (2, 1)),
    # Tesla architecture (the first CUDA GPUs)
    (r"\bgtx 2[6-8]0m\b|\bgtx 285m\b", (1, 1)),  # mobile G92
    (r"\bgtx 2[6-9]\d\b|\bc1060\b|\bs1070\b|\bm1060\b|\bquadro fx [45]800\b|\bquadro cx\b", (1, 3)),
    (r"^g? ?(205|210|310|315)m?$|\bgt 2[2-4]0m?\b|\bgt 3[2-4]0\b|\bgt 3[2-3]5m\b|\bgts 2[56]0m\b|\bgts 3[56]0m\b"
     r"|\bg 210m\b|\bquadro fx 380\b", (1, 2)),
    (r"\b8800 (gtx|ultra)\b|\b8800 gts( (320|640))?$|\b[cds]870\b|\bquadro fx [45]600\b", (1, 0)),
    (r"\b8[3-8]00( ?m)? ?(gs|gt|gts|gtx)?\b|\b9[1-8]00( ?m)?\b|\bgts 250\b|\bgts 150m\b|\bgt 1[23]0\b|\bg100\b",
     (1, 1)),
]
_COMPILED = [(re.compile(p), cc) for p, cc in _PATTERNS]


def capability_from_name(name: str | None) -> tuple[int, int] | None:
    """The compute capability NVIDIA lists for a GPU marketing name; None for a name not in the table."""
    if not name or not isinstance(name, str):
        return None
    text = re.sub(r"\b(nvidia|geforce|tesla)\b", " ", name[:200].lower())
    text = re.sub(r"[-_]", " ", text)
    text = re.sub(r"\s+", " ", text).strip()
    for pattern, cc in _COMPILED:
        if pattern.search(text):
            return cc
    return None
