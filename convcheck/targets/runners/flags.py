"""Every global math flag a runner or a run may touch: read, and restore on exit.

Old and new TF32 APIs both (``allow_tf32`` and, on torch >= 2.9,
``fp32_precision``), cudnn.benchmark / deterministic, the float32 matmul
precision, the default dtype, grad mode, deterministic algorithms, and the
CPU random state.
"""

from __future__ import annotations

import contextlib

import torch


def set_tf32(on: bool) -> None:
    # Old API only: mixing it with the new fp32_precision API can make the old
    # getters raise (FACTS.md, TF32 defaults); the snapshot below restores both.
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


_ACCESSORS: list | None = None


def _flag_accessors():
    """(name, getter, setter) for every global flag a target or a run may touch; listed once per
    process (which flags this torch has does not change; ``applied`` wraps every training step)."""
    global _ACCESSORS
    if _ACCESSORS is None:
        _ACCESSORS = _list_accessors()
    return _ACCESSORS


def _list_accessors():
    b = torch.backends

    def attr(obj, name):
        return (lambda: getattr(obj, name)), (lambda v: setattr(obj, name, v))

    items = [
        ("cuda.matmul.allow_tf32", *attr(b.cuda.matmul, "allow_tf32")),
        ("cudnn.allow_tf32", *attr(b.cudnn, "allow_tf32")),
        ("cudnn.benchmark", *attr(b.cudnn, "benchmark")),
        ("cudnn.deterministic", *attr(b.cudnn, "deterministic")),
        ("float32_matmul_precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
        ("default_dtype", torch.get_default_dtype, torch.set_default_dtype),
        ("grad_enabled", torch.is_grad_enabled, torch.set_grad_enabled),
        (
            "deterministic_algorithms",
            lambda: (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled()),
            lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
        ),
    ]
    for name in ("allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction"):
        if hasattr(b.cuda.matmul, name):
            items.append((f"cuda.matmul.{name}", *attr(b.cuda.matmul, name)))
    # The newer TF32 API (torch >= 2.9): setting allow_tf32 also moves these.
    for label, obj in (("cuda.matmul", b.cuda.matmul), ("cudnn.conv", getattr(b.cudnn, "conv", None)),
                       ("cudnn.rnn", getattr(b.cudnn, "rnn", None)), ("backends", b)):
        if obj is not None and hasattr(obj, "fp32_precision"):
            items.append((f"{label}.fp32_precision", *attr(obj, "fp32_precision")))
    return items


def snapshot_global_flags() -> dict[str, object]:
    """Every global flag convcheck may touch, read defensively (a getter that raises reads as None)."""
    out: dict[str, object] = {}
    for name, get, _ in _flag_accessors():
        try:
            out[name] = get()
        except Exception:  # noqa: BLE001 - mixed old/new TF32 APIs can make getters raise
            out[name] = None
    return out


def _restore(before: dict[str, object]) -> None:
    for name, get, set_ in _flag_accessors():  # old API first, the newer fp32_precision last
        value = before.get(name)
        if value is None:
            continue
        try:
            if get() == value:  # untouched: setters can be costly (use_deterministic_algorithms)
                continue
        except Exception:  # noqa: BLE001 - an unreadable flag is restored below
            pass
        try:
            set_(value)
        except Exception:  # noqa: BLE001 - best effort; never mask the real error
            pass


@contextlib.contextmanager
def preserved_global_flags():
    """Restore every global flag (and the CPU RNG state) on exit, whatever happened inside."""
    before = snapshot_global_flags()
    rng = torch.random.get_rng_state()
    try:
        yield
    finally:
        _restore(before)
        torch.random.set_rng_state(rng)
