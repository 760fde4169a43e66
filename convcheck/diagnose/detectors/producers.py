"""Where NaN/Inf first appear, read from the parity table (DeepLocalize's scan): the first call that
turns finite inputs into NaN/Inf in the forward pass, else the call closest to the output whose
backward turns a finite gradient into NaN/Inf; a module's own code counts as a call. An overflow is
judged against the target's own format (``convcheck.numerics.formats``): float16's 65504, FP8 E5M2's 57344;
a format that saturates instead (FP8 E4M3 at 448) makes no NaN/Inf, so ``saturation`` finds the
first call whose values leave its range."""

from __future__ import annotations

import math

import pandas as pd

from convcheck.measure.layer_names import is_own_code, own_code_op
from convcheck.numerics.formats import NumberFormat
from convcheck.diagnose.detectors.training import (NONFINITE_BACKWARD, NONFINITE_FORWARD, NONFINITE_USER_CODE,
                                                   NONFINITE_WEIGHTS, OUT_OF_RANGE, Symptom)


def nonfinite_producer(layers: pd.DataFrame, target: str, fmt: NumberFormat) -> Symptom | None:
    """DeepLocalize's scan: the first layer that turns finite inputs into NaN/Inf, forward
    (input -> output), then backward (output -> input). ``fmt``: the target's format with the
    smallest range (``PrecisionModel.narrowest``); judge values beyond it there are an overflow."""
    t = layers[layers["target"] == target]
    fwd = t[(t["kind"] == "forward") & ((t["nan"] + t["inf"]) > 0) & (t["input_nonfinite"] == 0)]
    if len(fwd):
        r = fwd.sort_values("order").iloc[0]
        overflow = r["ref_absmax"] > fmt.largest if math.isfinite(r["ref_absmax"]) else False
        what = (f"'{r['layer']}' ({r['module']}) turns finite inputs into {int(r['nan'])} NaN / {int(r['inf'])} Inf "
                f"in the forward pass")
        if overflow:
            what += f"; the judge's values there reach {r['ref_absmax']:.4g}, above the {fmt} maximum {fmt.largest:g}"
        extra = {"overflow": bool(overflow), "module": str(r["module"]), "format": fmt.name}
        if is_own_code(r["module"]):
            extra.update(own_code=True, op=own_code_op(r["module"]))
        return Symptom(NONFINITE_FORWARD, target, what, layer=r["layer"], step=0,
                       value=float(r["ref_absmax"]), extra=extra)
    fwd_rows = t[t["kind"] == "forward"]
    own_back = backward_producer(fwd_rows)
    if own_back is not None:
        r = own_back
        return Symptom(NONFINITE_BACKWARD, target,
                       f"'{r['layer']}' ({r['module']}) turns a finite gradient into {int(r['grad_in_nonfinite'])} "
                       f"NaN/Inf in the backward pass: the gradient reaching its output is finite, the one it "
                       f"passes back to its input is not", layer=r["layer"], step=0,
                       extra={"module": str(r["module"])})
    back = fwd_rows[fwd_rows["grad_out_nonfinite"] == 0].sort_values("order")
    poisoned = t[(t["kind"] == "grad") & ((t["nan"] + t["inf"]) > 0)]
    if len(poisoned):
        # the producer in backward: the deepest (closest to the output) layer whose own
        # output gradient is still finite but whose parameter gradients are not
        cand = poisoned[poisoned["layer"].isin(set(back["layer"]))].sort_values("order")
        r = (cand if len(cand) else poisoned.sort_values("order")).iloc[-1]
        return Symptom(NONFINITE_BACKWARD, target,
                       f"the gradient of '{r['param']}' holds {int(r['nan'])} NaN / {int(r['inf'])} Inf while the "
                       f"gradient reaching '{r['layer']}' is finite", layer=r["layer"], step=0)
    return None


def saturation(layers: pd.DataFrame, target: str, fmt: NumberFormat) -> Symptom | None:
    """For a format that saturates (E4M3: no Inf, an overflow becomes +-448): the first call whose
    judge values leave ``fmt``'s range while a later call reads its operands in ``fmt`` (its ``u``
    column is ``fmt``'s unit roundoff: a matmul/conv of the target); that call's values are cut to
    the largest finite value there, silently. None for a format that overflows to Inf."""
    if not fmt.saturates:
        return None
    fwd = layers[(layers["target"] == target) & (layers["kind"] == "forward")].sort_values("order")
    readers = fwd[fwd["u"] == fmt.unit_roundoff]["order"]
    if not len(readers):
        return None
    beyond = fwd[(fwd["ref_absmax"] > fmt.largest) & (fwd["order"] < readers.max())]
    if not len(beyond):
        return None
    r = beyond.iloc[0]
    return Symptom(OUT_OF_RANGE, target,
                   f"'{r['layer']}' ({r['module']}): the judge's values there reach {r['ref_absmax']:.4g}, above the "
                   f"{fmt} maximum {fmt.largest:g}; a matmul/conv reading them saturates them there",
                   layer=r["layer"], step=0, value=float(r["ref_absmax"]),
                   extra={"overflow": True, "module": str(r["module"]), "format": fmt.name})


def backward_producer(fwd_rows: pd.DataFrame):
    """The call closest to the output whose backward turns the finite gradient reaching its output
    into NaN/Inf at its input; a module with children only when none of its descendants does
    (then its own code did). None when no call does (or the table predates the column)."""
    if "grad_in_nonfinite" not in fwd_rows or not len(fwd_rows):
        return None
    grad_in = fwd_rows["grad_in_nonfinite"].fillna(0)
    cand = fwd_rows[(fwd_rows["grad_out_nonfinite"] == 0) & (grad_in > 0)]
    if not len(cand):
        return None
    last = int(fwd_rows["order"].max())  # the root's own-code row comes last: every call is inside it

    def base(layer: str) -> str:
        return str(layer).split("#", 1)[0]

    def inside(o, r) -> bool:
        return o["order"] != r["order"] and (base(o["layer"]).startswith(base(r["layer"]) + ".")
                                             or (int(r["order"]) == last and is_own_code(r["module"])))

    rows = [r for _, r in cand.iterrows()]
    innermost = [r for r in rows if not any(inside(o, r) for o in rows)]
    return max(innermost, key=lambda r: r["order"]) if innermost else None


_RECIPE_KEYS = ("callable", "optimizer", "eps", "loss", "lr", "operand_absmin", "float64_magnitude",
                "float64_operand_absmin")


def training_producer(arm: str, step: int, name: str, detail: dict, fmt: NumberFormat, *, weights: bool,
                      finite_gradients: bool) -> Symptom:
    """The first producer of NaN/Inf during training (``TrainResult.nonfinite_producer`` and its
    ``nonfinite_detail``): a module (with the op of its own code that made it, and that op's float64
    magnitude), the loss function (the same), or the update before (the optimizer step, the schedule)."""
    kind = detail.get("callable", "module")
    op, mag = detail.get("op"), detail.get("magnitude", math.nan)
    mag = float(mag) if mag is not None else math.nan
    overflow = bool(op) and math.isfinite(mag) and mag > fmt.largest
    extra = {k: detail[k] for k in _RECIPE_KEYS if k in detail}
    extra.update(op=op, overflow=overflow, format=fmt.name, callable=kind, finite_gradients=finite_gradients)
    size = ""
    if op and overflow:
        size = f"; in float64 that {op} reaches {mag:.4g}, above the {fmt} maximum {fmt.largest:g}"
    elif op and detail.get("operand_absmin") == 0.0:
        wide = detail.get("float64_operand_absmin")
        size = (f"; its operand holds exact zeros at {arm}'s precision ({op} of 0)"
                + (f", where the same loss in float64 on the same output has {wide:.3g}"
                   if wide is not None and math.isfinite(wide) and wide > 0 else ""))
    elif op and math.isfinite(mag):
        size = f"; in float64 that {op} stays finite (largest {mag:.4g})"
    elif op and mag == math.inf:
        size = f"; recomputed in float64 on the same operands, that {op} overflows too"
    if weights:
        lr = detail.get("lr")
        if kind == "schedule":
            return Symptom(NONFINITE_USER_CODE, arm, f"the learning-rate schedule set lr = {lr} before training step "
                           f"{step}, and the optimizer step made the weights of '{name}' NaN/Inf", layer=name,
                           step=step, extra=extra)
        return Symptom(NONFINITE_WEIGHTS, arm, f"the optimizer step after training step {step - 1} made the weights "
                       f"of '{name}' NaN/Inf" + (" while its gradients were finite" if finite_gradients else ""),
                       layer=name, step=step, extra=extra)
    if kind == "loss" and detail.get("direction") == "backward":
        loss = detail.get("loss") or "loss"
        extra["direction"] = "backward"
        return Symptom(NONFINITE_USER_CODE, arm, f"the backward of the loss function '{loss}' makes the gradient "
                       f"into the model's output NaN/Inf at training step {step}, from a finite loss", step=step,
                       extra=extra)
    if kind == "loss":
        loss = detail.get("loss") or "loss"
        what = (f"the loss function '{loss}' turns the model's finite output into NaN/Inf at training step {step}"
                + (f"; {op} is its first op to do so" if op else "") + size)
        return Symptom(NONFINITE_USER_CODE, arm, what, step=step, value=mag if op else None, extra=extra)
    if op:
        extra["own_code"] = True
    what = f"'{name}' turned finite inputs into NaN/Inf at training step {step}" + (f" ({op} of its own code)"
                                                                                      if op else "") + size
    return Symptom(NONFINITE_FORWARD, arm, what, layer=name, step=step, value=mag if op else None, extra=extra)
