"""Two watched runs' recipes diffed field by field, before any tensor (issue 42): the first place a difference can
exist. Each finding is a ``watched_evidence.Setup`` named in the user's words - which parameters, which setting,
A's value and B's ("weight_decay 0.005 on bn1.weight, bn1.bias in B; A: 0").

Read from the manifest's ``recipe`` (``watch/recipe.py``; runs recorded before it have none and are left to
``watched_setup.py``'s group-by-group checks) and from ``steps.jsonl``: the learning rate each parameter's group
used at each step, which parameters got a gradient at all, the modules that ran in another training mode.

What a precision policy is (the autocast dtype, the weights' dtype, the TF32 switches, the thread count) is said by
``precision_policy``: two runs that differ only there are a *precision pair*, judged by their outcome
(``watched_causal.outcome``), never a setup difference."""

from __future__ import annotations

from convcheck.diagnose.remedies import (FREEZE_REMEDIES, GROUP_REMEDIES, LR_REMEDIES, NO_GRADIENT_REMEDIES,
                                         OPTIMIZER_REMEDIES, MODEL_REMEDIES, RECIPE_REMEDIES, TRAIN_MODE_REMEDIES)
from convcheck.diagnose.detectors.watched_setup import lr_difference, lrs_text, same_setting, settings_difference
from convcheck.diagnose.watched_checks import pair_check
from convcheck.diagnose.watched_evidence import Setup

SHOWN_NAMES = 4  # parameter names spelled out before "and N more"


def recipe(run) -> dict | None:
    r = run.manifest.get("recipe")
    return r if isinstance(r, dict) and isinstance(r.get("param_groups"), list) else None


def names_text(names, every: list[str]) -> str:
    """``names`` as a person writes them: a module's parameters all named as ``module.*``, the rest listed."""
    names = [n for n in every if n in set(names)]
    out, done = [], set()
    for n in names:
        if n in done:
            continue
        prefix = n.rsplit(".", 1)[0] if "." in n else None
        while prefix:  # the widest module whose every parameter is in ``names``
            under = [m for m in every if m.startswith(prefix + ".")]
            if not all(m in names for m in under):
                break
            wider = prefix.rsplit(".", 1)[0] if "." in prefix else None
            if wider is None or not all(m in names for m in every if m.startswith(wider + ".")):
                break
            prefix = wider
        under = [m for m in every if prefix and m.startswith(prefix + ".")]
        if prefix and len(under) > 1 and all(m in names for m in under):
            out.append(prefix + ".*")
            done.update(under)
        else:
            out.append(n)
            done.add(n)
    shown = ", ".join(out[:SHOWN_NAMES])
    return shown + (f" and {len(out) - SHOWN_NAMES} more" if len(out) > SHOWN_NAMES else "")


def _every(run) -> list[str]:
    r = recipe(run)
    return list(r.get("trainable") or []) if r else []


def _all_params(run) -> list[str]:
    """Every parameter's name as the recipe records them (the user's names, wrappers' prefixes dropped)."""
    r = recipe(run)
    names = (r or {}).get("parameters")
    return list(names) if isinstance(names, list) else [p["name"] for p in run.manifest["model"]["parameters"]]


def _group_of(r: dict) -> dict[str, int]:
    return {n: g for g, grp in enumerate(r["param_groups"]) for n in grp.get("parameters", [])}


def _show(v) -> str:
    return "none" if v is None else (f"{v:g}" if isinstance(v, float) else repr(v))


def _by_values(pairs: dict) -> list[tuple[tuple, list[str]]]:
    """``{name: (a, b)}`` grouped by the value pair, the largest group first."""
    groups: dict = {}
    for n, ab in pairs.items():
        groups.setdefault(repr(ab), (ab, []))[1].append(n)
    return sorted(groups.values(), key=lambda g: -len(g[1]))


def settings_per_parameter(a, b) -> Setup | None:
    """Every optimizer hyperparameter as each *parameter* gets it (its group's), A against B: one group against
    two with the same values is the same recipe; weight decay on the norms in B only is named as such."""
    ra, rb = recipe(a), recipe(b)
    if ra is None or rb is None or ra.get("optimizer") != rb.get("optimizer"):
        return None
    ga, gb = _group_of(ra), _group_of(rb)
    every = _all_params(a)
    diffs: dict[str, dict] = {}
    for n in every:
        if n not in ga or n not in gb:
            continue
        sa, sb = ra["param_groups"][ga[n]].get("settings") or {}, rb["param_groups"][gb[n]].get("settings") or {}
        for key in sorted(set(sa) | set(sb)):
            if not same_setting(sa.get(key), sb.get(key)):
                diffs.setdefault(key, {})[n] = (sa.get(key), sb.get(key))
    if not diffs:
        return None
    key = max(diffs, key=lambda k: len(diffs[k]))  # the setting most parameters get differently
    lines = []
    for k, per in diffs.items():
        for (va, vb), names in _by_values(per):
            lines.append(f"{k} {_show(vb)} on {names_text(names, every)} in B; A: {_show(va)}")
    (va, vb), names = _by_values(diffs[key])[0]
    if len(names) == len([n for n in every if n in ga and n in gb]):  # every parameter: the optimizer's setting
        head = f"different {ra.get('optimizer') or 'optimizer'} settings: A's {key} is {va!r}, B's is {vb!r}"
    else:
        head = (f"different optimizer settings per parameter: {key} {_show(vb)} on {names_text(names, every)} in B; "
                f"A: {_show(va)}")
    return Setup(head, "optimizer", evidence=[f"the recipes' parameter groups: {x}" for x in lines],
                 remedies=list(GROUP_REMEDIES), step=0)


def unheld(a, b) -> Setup | None:
    """Parameters that train in one run but that run's optimizer holds in no group (they never move)."""
    ra, rb = recipe(a), recipe(b)
    if ra is None or rb is None:
        return None
    na, nb = set(ra.get("not_in_optimizer") or []), set(rb.get("not_in_optimizer") or [])
    if na == nb:
        return None
    side, names = ("B", nb - na) if nb - na else ("A", na - nb)
    text = names_text(names, _all_params(a))
    return Setup(f"{text} {'is' if len(names) == 1 else 'are'} in no parameter group of {side}'s optimizer: "
                 f"{'it never trains' if len(names) == 1 else 'they never train'} in {side}", "parameter groups",
                 evidence=[f"the recipes: {side}'s optimizer holds none of {text} (requires_grad True)"],
                 remedies=list(GROUP_REMEDIES), step=0)


def frozen(a, b, steps: int) -> Setup | None:
    """Parameters that train in one run only: ``requires_grad`` False as the block starts, or given no gradient from
    a step on where the other run's are (a backbone never unfrozen, requires_grad turned off mid-run, a branch the
    loss does not reach)."""
    every = _all_params(a)
    ta, tb = recipe(a), recipe(b)
    if ta is not None and tb is not None:
        fa, fb = set(ta.get("trainable") or []), set(tb.get("trainable") or [])
        if fa != fb:
            side, names = ("B", fa - fb) if fa - fb else ("A", fb - fa)
            text = names_text(names, every)
            return Setup(f"{text} frozen in {side} (requires_grad False) and trained in {_other(side)}", "frozen",
                         evidence=[f"the recipes' trainable parameters: {text} in {_other(side)} only"],
                         remedies=list(FREEZE_REMEDIES), step=0)
    for k in range(steps):  # the first step at which one run's parameters get a gradient the other's do not
        ga, gb = (set(r.steps[k].get("grad_norms") or {}) for r in (a, b))
        if not ga and not gb or ga == gb:
            continue
        if not ga or not gb:  # no parameter at all has a gradient when that run's optimizer steps
            return _no_gradients(a, b, k, "A" if not ga else "B", steps)
        side, names = ("B", ga - gb) if ga - gb else ("A", gb - ga)
        run = b if side == "B" else a
        text = names_text(names, every)
        got = [j for j in range(steps) if names & set(run.steps[j].get("grad_norms") or {})]
        if not got:
            other = a if side == "B" else b
            since = min(j for j in range(steps) if names & set(other.steps[j].get("grad_norms") or {}))
            head = f"{text} never get a gradient in {side}; in {_other(side)} they do from step {since}"
        elif max(got) < k:
            head = (f"{text} stop getting a gradient in {side} from step {k} (requires_grad turned off, or the loss no "
                    f"longer reaches them); in {_other(side)} they still do")
        else:
            head = f"{text} get no gradient in {side} at step {k} where they do in {_other(side)}"
        return Setup(head, "frozen", evidence=[f"steps.jsonl grad_norms at step {k}: no gradient for {text} in {side}"],
                     remedies=list(FREEZE_REMEDIES), step=k)
    return None


def _no_gradients(a, b, k: int, side: str, steps: int) -> Setup:
    run = a if side == "A" else b
    since = sum(1 for j in range(k, steps) if not run.steps[j].get("grad_norms"))
    head = (f"no parameter has a gradient when {side}'s optimizer steps, from step {k}"
            + (f" ({since} steps)" if since > 1 else "") + f"; in {_other(side)} they all do")
    return Setup(head, "no gradients",
                 evidence=[f"steps.jsonl grad_norms at step {k}: empty in {side} - every parameter's .grad was None at "
                           "optimizer.step(), so the step changed nothing"],
                 remedies=list(NO_GRADIENT_REMEDIES), step=k)


def module_settings(a, b) -> Setup | None:
    """torch's own layers built with other settings (a Dropout's p, a BatchNorm's momentum, eps or
    track_running_stats, an activation's slope), from the manifests' ``model.leaf_specs``: the model differs."""
    sa, sb = (r.manifest.get("model", {}).get("leaf_specs") or {} for r in (a, b))
    found = []
    for layer in sa:
        x, y = sa[layer], sb.get(layer)
        if not isinstance(x, dict) or not isinstance(y, dict):
            continue
        if x.get("class") != y.get("class"):
            found.append(f"{layer} is a {y.get('class')} in B, a {x.get('class')} in A")
            continue
        ax, ay = x.get("attrs") or {}, y.get("attrs") or {}
        found += [f"{layer} ({x.get('class')}).{k} is {ay.get(k)!r} in B, {ax.get(k)!r} in A"
                  for k in sorted(set(ax) | set(ay)) if ax.get(k) != ay.get(k)]
    if not found:
        return None
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return Setup(f"the models' layers are built differently: {found[0]}{more}", "model",
                 evidence=[f"the manifests' layer settings: {x}" for x in found[:8]],
                 remedies=list(MODEL_REMEDIES), step=0)


def _other(side: str) -> str:
    return "A" if side == "B" else "B"


def lr_per_parameter(a, b, steps: int) -> Setup | None:
    """The first aligned step where a parameter's learning rate (its group's) differs: a schedule off by one, a
    group given another lr; groups that differ only in how the parameters are split are the same recipe."""
    ra, rb = recipe(a), recipe(b)
    if ra is None or rb is None:
        return None
    ga, gb = _group_of(ra), _group_of(rb)
    every = _all_params(a)
    for k in range(steps):
        la, lb = a.steps[k]["lr"], b.steps[k]["lr"]
        per = {n: (float(la[ga[n]]), float(lb[gb[n]])) for n in every
               if n in ga and n in gb and ga[n] < len(la) and gb[n] < len(lb)}
        apart = {n: v for n, v in per.items() if not same_setting(*v)}
        if not apart:
            continue
        (va, vb), names = _by_values(apart)[0]
        where = "" if len(apart) == len(per) else f" on {names_text(names, every)}"
        before = f" (the same before: {lrs_text(a.steps[k - 1]['lr'])})" if k and all(
            same_setting(*v) for v in _lr_at(a, b, ga, gb, every, k - 1)) else ""
        return Setup(f"different learning rates: B's learning rate{where} is {vb!r} where A's is {va!r} from step "
                     f"{k}{before}",
                     "learning rate", evidence=[f"steps.jsonl lr at step {k}: {la} | {lb}"],
                     remedies=list(LR_REMEDIES), step=k)
    return None


def _lr_at(a, b, ga, gb, every, k):
    la, lb = a.steps[k]["lr"], b.steps[k]["lr"]
    return [(float(la[ga[n]]), float(lb[gb[n]])) for n in every if n in ga and n in gb and ga[n] < len(la)
            and gb[n] < len(lb)]


def modes_difference(a, b, steps: int) -> Setup | None:
    """Modules that run in another training mode than the model in one run only (a BatchNorm or Dropout left in
    eval mode, or put back in train mode), from the first step it shows."""
    for k in range(steps):
        ma, mb = set(a.steps[k].get("modes_differ") or []), set(b.steps[k].get("modes_differ") or [])
        if ma == mb:
            continue
        side, names = ("B", mb - ma) if mb - ma else ("A", ma - mb)
        every = sorted(ma | mb)
        return Setup(f"{names_text(names, every)} run{'s' if len(names) == 1 else ''} in another training mode than "
                     f"the model in {side} (eval mode while training) from step {k}", "module mode",
                     evidence=[f"steps.jsonl modes_differ at step {k}: {sorted(ma)} | {sorted(mb)}"],
                     remedies=list(TRAIN_MODE_REMEDIES), step=k)
    return None


def _criterion_text(c: dict) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in sorted((c.get("settings") or {}).items()))
    return f"{c.get('class')}({args})"


def loss_function(a, b) -> Setup | None:
    """The loss modules (``nn.CrossEntropyLoss(label_smoothing=0.1)``...) each run called, when both called one
    and they differ in class or in a setting (a loss written as a function is not seen: the step-0 loss says it)."""
    ca, cb = (recipe(a) or {}).get("criteria") or [], (recipe(b) or {}).get("criteria") or []
    if not ca or not cb or ca == cb:
        return None
    for x, y in zip(ca, cb):
        if x == y:
            continue
        if x.get("class") != y.get("class"):
            what = f"B uses {_criterion_text(y)}, A {_criterion_text(x)}"
        else:
            sx, sy = x.get("settings") or {}, y.get("settings") or {}
            key = next(k for k in sorted(set(sx) | set(sy)) if sx.get(k) != sy.get(k))
            what = f"{y.get('class')}'s {key} is {sy.get(key)!r} in B, {sx.get(key)!r} in A"
        return Setup(f"different loss functions: {what}", "loss function",
                     evidence=[f"the recipes' loss modules: {', '.join(map(_criterion_text, ca))} | "
                               f"{', '.join(map(_criterion_text, cb))}"],
                     remedies=list(RECIPE_REMEDIES), step=0)
    return None


def recipe_differences(a, b, steps: int) -> list[Setup]:
    """Every recipe difference, in the order a step uses them: the layers' own settings, the loss function, which
    parameters train, their groups, their settings, their learning rates, the modules' modes."""
    found = (module_settings(a, b), loss_function(a, b), unheld(a, b), frozen(a, b, steps), settings_per_parameter(a, b),
             lr_per_parameter(a, b, steps), modes_difference(a, b, steps))
    return [f for f in found if f is not None]


def has_recipe(a, b) -> bool:
    return recipe(a) is not None and recipe(b) is not None


def _autocast(run) -> str | None:
    """The autocast dtype the run's steps computed in; None when it entered one that changed nothing: every layer
    output recorded under it is float64 (autocast leaves float64 ops alone - a float64 model under it is float64)."""
    fmt = next((s.get("autocast") for s in run.steps if s.get("autocast")), None)
    dtypes = {r.get("dtype") for s in run.steps if s.get("autocast") == fmt
              for r in (s.get("layers") or {}).values() if isinstance(r, dict)}
    return None if fmt is None or dtypes == {"float64"} else fmt


def _loss_dtype(run) -> str | None:
    return next((s.get("loss_dtype") for s in run.steps if s.get("loss_dtype")), None)


def precision_policy(a, b) -> list[str]:
    """How the two runs' precision policies differ, in words (empty when they do not): autocast, the weights'
    dtypes, the loss's dtype, compiled or eager, the TF32 switches, the CPU thread count (another split of every
    reduction)."""
    out = []
    ca, cb = _autocast(a), _autocast(b)
    if ca != cb:
        out.append(f"autocast: {ca or 'off'} | {cb or 'off'}")
    ra, rb = recipe(a), recipe(b)
    wa = (ra or {}).get("weights_dtypes") or sorted({p.get("dtype") for p in a.manifest["model"]["parameters"]})
    wb = (rb or {}).get("weights_dtypes") or sorted({p.get("dtype") for p in b.manifest["model"]["parameters"]})
    if wa != wb:
        out.append(f"weights kept in {', '.join(map(str, wa))} | {', '.join(map(str, wb))}")
    la, lb = _loss_dtype(a), _loss_dtype(b)
    if la and lb and la != lb:  # a loss handed over as a number says nothing of its dtype
        out.append(f"the loss computed in {la} | {lb}")
    ma, mb = (next((s.get("memory_format") for s in r.steps if s.get("memory_format")), None) for r in (a, b))
    if ma != mb:
        out.append(f"memory format: {ma or 'contiguous'} | {mb or 'contiguous'}")
    ka, kb = ((r.manifest.get("compiled") or {}).get("how") for r in (a, b))
    if ka != kb:  # another set of kernels (fused, reordered): rounding-level differences, as threads
        out.append(f"compiled: {ka or 'eager'} | {kb or 'eager'}")
    fa, fb = a.manifest.get("math_flags") or {}, b.manifest.get("math_flags") or {}
    for k in sorted(set(fa) | set(fb)):
        if ("tf32" in k.lower() or "precision" in k or k == "threads") and fa.get(k) != fb.get(k):
            out.append(f"{k}: {fa.get(k)} | {fb.get(k)}")
    return out


# --- the pair's setup checks (``watched_checks``) -------------------------------------------------------

@pair_check("recipe", order=20)
def _recipe_check(a, b, steps: int) -> list:
    """The recipe parameter by parameter; runs recorded before it (no ``recipe``) group by group."""
    if has_recipe(a, b):
        return recipe_differences(a, b, steps)
    return [settings_difference(a, b), lr_difference(a, b, steps)]

