"""The user's source line of a NaN/Inf producer (issue 35), as the Ascend tools give it from a stack.

- ``caller_line()``: the innermost frame of the running stack that is the user's code (not torch's, not
  convcheck's, not the standard library's): inside a leaf's forward hook it is the parent's forward line that
  called the leaf; inside ``op_probe.live_op``'s re-run of a module's own code it is the line of the op itself.
- ``op_line(module, op)``: for an op found in a module's own code from the autograd graph (a backward
  producer: the graph keeps no stack), the one line of the module's ``forward`` that writes that op
  (``/`` for div, ``sqrt(`` ...), or the ``forward``'s own line when none or several do.

Each is ``{"file", "line", "code"}`` or None (``diagnose.watched_evidence.source_text`` writes it).
"""

from __future__ import annotations

import inspect
import linecache
import os
import re
import sys
import sysconfig

import torch

# torch's package and convcheck's: their frames are never the user's line
_NOT_USER = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep)
_STDLIB = sysconfig.get_paths().get("stdlib", "") + os.sep

# how each op that can overflow in a backward is written in Python
_SPELLINGS = {"div": r"(?<![/*])/(?![/=])|\bdiv\(|\btrue_divide\(", "reciprocal": r"\breciprocal\(|\b1\.?0?\s*/",
              "rsqrt": r"\brsqrt\(", "sqrt": r"\bsqrt\(", "log": r"\blog\(", "log2": r"\blog2\(",
              "log10": r"\blog10\(", "pow": r"\*\*|\bpow\(", "exp": r"\bexp\(", "norm": r"\bnorm\(",
              "matmul": r"@|\bmatmul\(|\bbmm\(|\beinsum\(", "softmax": r"\bsoftmax\("}


def _user(path: str) -> bool:
    return bool(path) and not path.startswith(_NOT_USER) and not (_STDLIB != os.sep and path.startswith(_STDLIB)) \
        and not path.startswith("<")


def caller_line(limit: int = 60) -> dict | None:
    """The innermost user frame of the running stack (at most ``limit`` frames out)."""
    frame = sys._getframe(1)
    for _ in range(limit):
        if frame is None:
            return None
        path = frame.f_code.co_filename
        if _user(path):
            return {"file": path, "line": frame.f_lineno,
                    "code": linecache.getline(path, frame.f_lineno).strip()[:160]}
        frame = frame.f_back
    return None


def op_line(module, op: str, first: bool = False) -> dict | None:
    """The line of ``module``'s own ``forward`` that writes ``op`` (its forward's line when not exactly one;
    ``first``: the first that does - a forward's first overflow is the one the later ops inherit)."""
    try:
        lines, start = inspect.getsourcelines(type(module).forward)
        path = inspect.getsourcefile(type(module).forward)
    except (OSError, TypeError):
        return None
    if not path or not _user(path):
        return None
    pattern = _SPELLINGS.get(op)
    body = [(start + i, text) for i, text in enumerate(lines)
            if i > 0 and not text.strip().startswith(("#", '"', "'"))]
    hits = [(n, t) for n, t in body if pattern and re.search(pattern, t.split("#")[0])]
    n, text = hits[0] if len(hits) == 1 or first and hits else (start, lines[0])
    return {"file": path, "line": n, "code": text.strip()[:160]}
