"""Environment fingerprint and audit.

``collect()`` fingerprints this machine, ``load(path)`` reads a saved
fingerprint JSON or a ``python -m torch.utils.collect_env`` text, ``audit(fp)``
returns the findings (critical first), ``diff(a, b)`` the differences that
matter for numerics. ``pynvml`` and ``torch`` are imported only when
``collect()`` runs.
"""

from convcheck.env.diff import Difference, diff
from convcheck.env.fingerprint import (
    GPU,
    SCHEMA,
    Driver,
    Fingerprint,
    Host,
    MathFlags,
    TorchBuild,
)
from convcheck.env.loading import load, save
from convcheck.env.rules import RULE_IDS, Finding, audit


def collect(nvml=None, torch_module=None, environ=None) -> Fingerprint:
    """Fingerprint this machine (see ``convcheck.env.collector``); probes never raise."""
    from convcheck.env.collector import collect as _collect

    return _collect(nvml=nvml, torch_module=torch_module, environ=environ)


__all__ = [
    "GPU", "RULE_IDS", "SCHEMA", "Difference", "Driver", "Finding", "Fingerprint", "Host", "MathFlags",
    "TorchBuild", "audit", "collect", "diff", "load", "save",
]
