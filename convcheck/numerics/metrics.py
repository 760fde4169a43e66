"""Error measures and precision bounds; the tolerances that turn them into flags.

Every measure is computed in float64 on the reference's device (the judge's,
for a judge's tensor): a GPU judge keeps its comparisons on the GPU.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn as nn

from convcheck.numerics.thresholds import TINY_NORM as _TINY
from convcheck.numerics.tolerances import DEFAULT_TOLERANCES, Tolerances  # noqa: F401 - re-exported


def _pair(x: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both in float64 on the reference's device (a no-op for a judge's float64 tensor)."""
    e = ref.detach().to(dtype=torch.float64)
    return x.detach().to(device=e.device, dtype=torch.float64), e


def nonfinite_count(t: torch.Tensor) -> tuple[int, int]:
    """(NaN count, Inf count)."""
    t = t.detach()
    if not t.is_floating_point() or t.numel() == 0:
        return 0, 0
    # Fast path (one cheap pass): aminmax propagates NaN, and an Inf is the min or max.
    lo, hi = torch.aminmax(t)
    if math.isfinite(float(lo)) and math.isfinite(float(hi)):
        return 0, 0
    return int(torch.isnan(t).sum()), int(torch.isinf(t).sum())


def abs_max(t: torch.Tensor) -> float:
    """``max |t|`` (NaN when ``t`` holds a NaN or is empty) from one ``aminmax`` pass: no ``|t|`` is made."""
    t = t.detach()
    if not t.numel():
        return math.nan
    if t.is_complex() or t.dtype == torch.bool:  # no aminmax for them: the long way
        return float(t.abs().max()) if t.is_complex() else float(t.any())
    lo, hi = (float(v) for v in torch.aminmax(t))
    return math.nan if math.isnan(lo) or math.isnan(hi) else max(abs(lo), abs(hi))


def rel_l2(x: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """||x - ref|| / max(||ref||, floor) in float64; inf when x holds a non-finite value and ref does not.

    ``floor`` is the size below which ``ref`` counts as cancelled to zero (e.g. the
    norm of the terms a gradient sums), so rounding noise is not a relative error.
    """
    return rel_l2_finite(x, ref, floor)[0]


def rel_l2_finite(x: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> tuple[float, bool]:
    """``(rel_l2, whether every element of x and ref is finite)``: True is known for free when both
    norms are finite (the fast path), so a caller counting NaN/Inf in ``x`` can skip its pass;
    False means "not known", not "non-finite". A complex ``ref`` is compared in complex128 (its
    imaginary part is not dropped)."""
    e = ref.detach().to(dtype=torch.complex128 if ref.is_complex() else torch.float64)
    a = x.detach().to(device=e.device)
    if a.shape != e.shape:
        raise ValueError(f"shape mismatch {tuple(a.shape)} vs {tuple(e.shape)}")
    # Fast path: both norms finite means every element of both is finite (no
    # boolean indexing, which dominated parity's run time on ResNet-50).
    den = max(_norm(ref, e), floor)
    num = difference_norm(a, e)
    if math.isfinite(den) and math.isfinite(num):
        if den < _TINY:
            return (0.0 if num < _TINY else math.inf), True
        return num / den, True
    a = a.to(dtype=e.dtype)
    finite_ref = torch.isfinite(e)
    if not bool(torch.isfinite(a)[finite_ref].all()):
        return math.inf, False
    a, e = a[finite_ref], e[finite_ref]
    den = max(float(torch.linalg.vector_norm(e)), floor)
    num = float(torch.linalg.vector_norm(a - e))
    if den < _TINY:
        return (0.0 if num < _TINY else math.inf), False
    return num / den, False


CHUNK = 1 << 16  # elements: a float64 chunk (512 KiB) and its operands stay in one core's cache


def chunked(e: torch.Tensor, a: torch.Tensor | None = None) -> bool:
    """Whether ``chunked_norms`` takes ``e`` (and ``a``, compared with it) in chunks: a large real
    float64 tensor on the CPU (a GPU streams a whole tensor at full speed)."""
    return (e.device.type == "cpu" and e.dtype == torch.float64 and e.numel() >= 4 * CHUNK
            and (a is None or (a.is_floating_point() and a.shape == e.shape and a.device == e.device)))


def chunked_norms(e: torch.Tensor, xs: tuple = (), rounded_to: torch.dtype | None = None,
                  whole: bool = False) -> list[float]:
    """From one pass over ``e`` (``chunked``) in cache-sized chunks: ||x - e|| for each x in ``xs``,
    then ||e.to(rounded_to) - e|| where asked, then with ``whole`` ||e|| and max|e|, in float64.
    Each chunk is cast, subtracted and summed while it is in the cache, where whole tensors at
    once make and read back float64 copies from memory, and each measure reads ``e`` again from it
    (ResNet-18's first activation, one difference: 2.0 -> 1.2 ms). The norms move only in their
    last bits (the order of the sum); a NaN/Inf shows as a non-finite result."""
    flat_e, flats = e.detach().reshape(-1), [x.detach().reshape(-1) for x in xs]
    parts: list[list[torch.Tensor]] = [[] for _ in range(len(xs) + (rounded_to is not None) + 2 * whole)]
    buf = torch.empty(CHUNK, dtype=e.dtype)
    norm = torch.linalg.vector_norm
    for part_e, *part_xs in zip(flat_e.split(CHUNK), *(x.split(CHUNK) for x in flats)):
        b = buf if part_e.numel() == CHUNK else buf[:part_e.numel()]
        for j, part_x in enumerate(part_xs):
            parts[j].append(norm(b.copy_(part_x).sub_(part_e)))
        j = len(flats)
        if rounded_to is not None:
            parts[j].append(norm(b.copy_(part_e.to(rounded_to)).sub_(part_e)))
            j += 1
        if whole:
            parts[j].append(norm(part_e))
            parts[j + 1].extend(torch.aminmax(part_e))  # (a max-norm kernel is 6x slower than aminmax)
    out = [float(torch.linalg.vector_norm(torch.stack(p))) for p in (parts[:-1] if whole else parts)]
    if whole:
        out.append(float(torch.linalg.vector_norm(torch.stack(parts[-1]), ord=math.inf)))
    return out


def difference_norm(a: torch.Tensor, e: torch.Tensor, rounded_to: torch.dtype | None = None) -> float:
    """||a - e|| in ``e``'s float64 (``a`` on ``e``'s device, same shape); with ``rounded_to``,
    ``a`` is ``e`` rounded to that dtype (``a`` is then not read). In chunks where ``chunked``."""
    if not chunked(e, a):
        whole = e.to(rounded_to) if rounded_to is not None else a
        return float(torch.linalg.vector_norm(_difference(whole, e)))
    return chunked_norms(e, () if rounded_to is not None else (a,), rounded_to)[0]


def rounding_error(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """``rel_l2(ref.to(dtype), ref)``: the rounding of ``ref`` to ``dtype``, without the rounded copy
    of a large tensor (``difference_norm``)."""
    e = ref.detach().to(dtype=torch.float64)
    den, num = _norm(ref, e), difference_norm(e, e, rounded_to=dtype)
    if not (math.isfinite(den) and math.isfinite(num)):  # NaN/Inf, or past the dtype's range: rel_l2's rules
        return rel_l2(ref.to(dtype), ref)
    if den < _TINY:
        return 0.0 if num < _TINY else math.inf
    return num / den


SMALL = 1 << 15  # elements: below this a torch call costs more than the arithmetic it does


def _difference(a: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """``a - e`` in float64 (``e`` is). A large ``a`` is cast first and the difference taken in place:
    the same values as ``torch.sub(a, e)``, whose mixed-dtype kernel is 1.6x slower (2.6 vs 4.1 ms on
    1.6 M elements, one CPU thread); a small one in that one call (a call fewer, ~10 us, where the
    arithmetic takes less: LeNet's rows make ~60 differences)."""
    if a.dtype == e.dtype or not a.is_floating_point() or a.numel() < SMALL:  # complex, integer: torch's promotion
        return torch.sub(a, e)
    return a.to(dtype=e.dtype).sub_(e)


_NORMS: dict[int, tuple] = {}  # id(ref) -> (weak reference, version, ||ref||): parity compares one
_NORMS_KEPT = 4096             # judge tensor with several results in a row


def _norm(ref: torch.Tensor, e: torch.Tensor) -> float:
    """||e|| (``ref`` in float64), remembered while ``ref`` lives unchanged."""
    norm = _remembered(ref)
    if norm is None:
        norm = float(torch.linalg.vector_norm(e))
        remember_norm(ref, norm)
    return norm


def _remembered(ref: torch.Tensor) -> float | None:
    try:
        hit = _NORMS.get(id(ref))
        return hit[2] if hit is not None and hit[0]() is ref and hit[1] == ref._version else None
    except RuntimeError:  # an inference tensor keeps no version: not remembered
        return None


def remember_norm(ref: torch.Tensor, norm: float) -> None:
    """``rel_l2``'s denominator for ``ref`` while it lives unchanged (found by a pass of the caller's)."""
    try:
        version = ref._version
    except RuntimeError:
        return
    if len(_NORMS) >= _NORMS_KEPT:
        _NORMS.clear()
    _NORMS[id(ref)] = (weakref.ref(ref), version, norm)


def max_abs(x: torch.Tensor, ref: torch.Tensor) -> float:
    a, e = _pair(x, ref)
    d = (a - e).abs()
    return float(d.max()) if d.numel() else 0.0


def cosine(x: torch.Tensor, ref: torch.Tensor) -> float:
    a, e = (t.flatten() for t in _pair(x, ref))
    den = float(a.norm() * e.norm())
    return float(a @ e) / den if den > _TINY else 1.0


def ulp_distance(x: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Median distance in ulps of ``dtype`` at the reference's magnitude."""
    a, e = _pair(x, ref)
    eps = torch.finfo(dtype).eps
    tiny = torch.finfo(dtype).tiny
    spacing = torch.clamp(e.abs(), min=tiny) * eps
    d = (a - e).abs() / spacing
    d = d[torch.isfinite(d)]
    return float(d.median()) if d.numel() else math.inf


def param_distance(a: nn.Module, b: nn.Module, b_norm_sq: float | None = None) -> float:
    """||theta_a - theta_b|| / ||theta_b|| over every parameter, in float64 on ``b``'s device.
    ``b_norm_sq`` is ``param_norm_sq(b)`` when the caller already has it."""
    num = 0.0
    for pa, pb in zip(a.parameters(), b.parameters()):
        vb = _as_float64(pb)
        # the difference promotes ``pa`` to float64 inside the kernel: no float64 copy of it is made
        num += float(torch.linalg.vector_norm(torch.sub(pa.detach().to(vb.device), vb))) ** 2
    return relative_distance(num, param_norm_sq(b) if b_norm_sq is None else b_norm_sq)


def relative_distance(num_sq: float, den_sq: float) -> float:
    """sqrt(num_sq / den_sq): inf for a non-finite numerator, NaN for a zero denominator."""
    if not math.isfinite(num_sq):
        return math.inf
    return math.sqrt(num_sq / den_sq) if den_sq > 0 else math.nan


def param_norm_sq(m: nn.Module) -> float:
    """||theta||^2 over every parameter of ``m``, in float64 (``param_distance``'s denominator)."""
    return sum((float(torch.linalg.vector_norm(_as_float64(p))) ** 2 for p in m.parameters()), 0.0)


def _as_float64(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t if t.dtype == torch.float64 else t.to(dtype=torch.float64)


def expected_bound(unit_roundoff: float, reduction_length: int) -> float:
    """Typical relative error of a length-K reduction: u*sqrt(K), and at least u."""
    return unit_roundoff * max(1.0, math.sqrt(max(1, reduction_length)))


def reduction_length(module: nn.Module, inputs: tuple, output: torch.Tensor) -> int:
    """K, the length of the longest sum behind one output element of ``module``."""
    if isinstance(module, nn.Linear):
        return module.in_features
    if isinstance(module, nn.modules.conv._ConvNd):
        return (module.in_channels // module.groups) * math.prod(module.kernel_size)
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        x = inputs[0]
        return max(1, x.numel() // x.shape[1]) if module.training else 1
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return math.prod(module.normalized_shape)
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):  # its statistics each sample's channel's
        x = inputs[0]
        uses_running = module.track_running_stats and not module.training
        return 1 if uses_running or x.dim() < 2 else max(1, x[0, 0].numel() if x.dim() > 2 else x.shape[-1])
    if isinstance(module, nn.GroupNorm):
        x = inputs[0]
        return max(1, x[0].numel() // module.num_groups)
    if isinstance(module, (nn.AvgPool2d, nn.AvgPool1d, nn.AvgPool3d)):
        k = module.kernel_size
        return math.prod(k) if isinstance(k, tuple) else k ** (inputs[0].dim() - 2)
    if isinstance(module, (nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool3d)):
        return max(1, inputs[0][0, 0].numel() // max(1, output[0, 0].numel()))
    if isinstance(module, (nn.ReLU, nn.MaxPool2d, nn.MaxPool1d, nn.Identity, nn.Flatten, nn.Dropout)):
        return 1
    # An unknown module: assume it may reduce over everything one sample holds.
    x = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
    if x is None or x.dim() == 0:
        return 1
    return max(1, x[0].numel() if x.dim() > 1 else x.numel())


def grad_reduction_length(param: torch.Tensor, batch_size: int, output: torch.Tensor | None) -> int:
    """K for a parameter's gradient: it sums over the batch and every output position."""
    if output is None or output.dim() < 2:
        return max(1, batch_size)
    spatial = output[0, 0].numel() if output.dim() > 2 else 1
    return max(1, batch_size * spatial)
