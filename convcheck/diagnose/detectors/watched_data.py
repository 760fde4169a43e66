"""What the two runs were given: the model's batches and the loss's targets.

``same_batches``: whether a step of both runs gave the model the same data (the diff's first data difference and
the targets' check read it); ``target_difference`` (a setup check, ``watched_checks``): the first step whose loss
- a loss module or a loss function of ``torch.nn.functional`` (``watch/functional_losses.py``) - was given other
targets while the model's inputs were the same: a label mapping, a target transform.
"""

from __future__ import annotations

from convcheck.diagnose.remedies import TARGET_REMEDIES
from convcheck.diagnose.watched_checks import pair_check
from convcheck.diagnose.watched_evidence import Setup
from convcheck.numerics.formats import coarsest_dtype
from convcheck.watch.batches import ROUNDED


def same_batches(a, b, k: int) -> bool:
    """Whether step ``k`` of both runs gave the model the same data: the same batches, each counted once
    (``_distinct``), by their bytes or, when the coarser run computes in bfloat16 or float16, rounded to that format
    (``batch_rounded``: a model cast with ``model.to(torch.bfloat16)`` is fed ``x.to(torch.bfloat16)``). A run
    recorded before ``batch_rounded`` is compared by its bytes alone."""
    sa, sb = a.steps[k], b.steps[k]
    (ha, ra), (hb, rb) = _distinct(sa), _distinct(sb)
    if ha == hb:
        return True
    dtypes = {r["dtype"] for s in (sa, sb) for r in s["layers"].values()}
    fmt = coarsest_dtype(dtypes)
    if fmt not in ROUNDED or ra is None or rb is None or len(ra) != len(rb) or len(ha) != len(hb):
        return False
    return all(x == y or (isinstance(rx, dict) and isinstance(ry, dict) and rx.get(fmt) is not None
                          and rx.get(fmt) == ry.get(fmt))
               for x, y, rx, ry in zip(ha, hb, ra, rb))


def _distinct(step: dict) -> tuple[list, list | None]:
    """A step's batches, each once, in the order first fed (with their rounded hashes): a closure the optimizer
    evaluates several times a step feeds one batch as often as it runs - 8 times in one run, 20 in the other."""
    hashes, rounded = step["batch_sha256"], step.get("batch_rounded")
    keep = [i for i, h in enumerate(hashes) if h not in hashes[:i]]
    return [hashes[i] for i in keep], ([rounded[i] for i in keep] if rounded is not None
                                        and len(rounded) == len(hashes) else None)


@pair_check("targets", order=100)
def target_difference(a, b, steps: int) -> Setup | None:
    """The first aligned step whose loss modules were given other targets (labels) - compared as batches are, the
    same bytes or the same values rounded to the coarser run's format - with the model's inputs the same."""
    for k in range(steps):
        sa, sb = a.steps[k], b.steps[k]
        ta, tb = sa.get("target_sha256"), sb.get("target_sha256")
        if not ta or not tb or len(ta) != len(tb) or ta == tb:
            continue
        if not same_batches(a, b, k):  # other inputs too: a loader's order, not the targets alone (the data's)
            continue
        fmt = coarsest_dtype({r["dtype"] for s in (sa, sb) for r in s["layers"].values()} | {"float32"})
        ra, rb = sa.get("target_rounded") or [None] * len(ta), sb.get("target_rounded") or [None] * len(tb)
        if all(x == y or (isinstance(u, dict) and isinstance(v, dict) and u.get(fmt) is not None
                          and u.get(fmt) == v.get(fmt)) for x, y, u, v in zip(ta, tb, ra, rb)):
            continue
        return Setup(f"the loss was given other targets (labels) from step {k}, with the same model inputs",
                     "targets", evidence=[f"the hashes of what the loss modules were given besides the model's "
                                          f"output differ at step {k}: a label mapping, a target transform or a "
                                          "loader that pairs inputs with other labels"],
                     remedies=list(TARGET_REMEDIES), step=k)
    return None
