"""The runner registry: one registered class per kind of target.

A runner class claims a set of ``modes`` on a set of ``devices``;
``runner_class(device, mode)`` finds it. Spec grammar (``device[:index][:mode]``)
lives in ``convcheck.targets.spec``; which modes exist, their aliases and where
they may run is what the registered classes say.
"""

from __future__ import annotations

from convcheck.discovery import import_modules


from convcheck.errors import UsageError

_REGISTRY: list[type] = []

ALIASES = {
    "fp32": "float32", "float": "float32", "f32": "float32",
    "fp64": "float64", "double": "float64", "f64": "float64",
    "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
    "amp": "amp-fp16",
}


def register(cls: type) -> type:
    """Class decorator: make a runner kind known to target parsing."""
    _REGISTRY.append(cls)
    return cls


def import_kinds(package: str, path) -> list[str]:
    """Import every module of ``package`` (found on ``path``), by name: a module that defines a
    ``@register``-ed class makes its kind known, with no list of modules to edit."""
    return import_modules(package, path)


def runner_classes() -> list[type]:
    return list(_REGISTRY)


def known_modes() -> list[str]:
    seen: list[str] = []
    for cls in _REGISTRY:
        seen += [m for m in cls.modes if m not in seen]
    return seen


def runner_class(device: str, mode: str, spec: str) -> type:
    """The class that runs ``mode`` on ``device``; a ``UsageError`` naming the problem otherwise."""
    claimants = [cls for cls in _REGISTRY if mode in cls.modes]
    if not claimants:
        raise UsageError(f"target {spec!r}: unknown mode {mode!r} (expected one of {', '.join(known_modes())})")
    for cls in claimants:
        if device in cls.devices:
            return cls
    raise UsageError(f"target {spec!r}: {claimants[0].wrong_device_message(mode, device)}")


def specs_on(device: str) -> list[str]:
    """Every spec of a registered kind on ``device``, whether or not this machine has it (``cpu``, ``cpu:bf16``...)."""
    return [device if mode == "float32" else f"{device}:{mode}"
            for cls in _REGISTRY for mode in cls.modes if device in cls.devices]


def runnable_specs() -> list[str]:
    """Every target spec this machine can run, kind by kind."""
    out: list[str] = []
    for cls in _REGISTRY:
        out += [s for s in cls.runnable_here() if s not in out]
    return out
