"""The matrix's cases: planted faults (run B against a healthy run A of the same family) and healthy variations.

Each case states its truth (the category a right diagnosis gives, and words one of which the verdict's headline,
sub-cause or evidence must hold for the cause to count as named) and a check, run on plain-torch traces of both
runs (``loop.train(..., out=None)``, no convcheck), that the fault does what it claims; a fault that does not
manifest, or a healthy pair that does not end alike, is a bug in the matrix (``CaseInvalid``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .families import FAMILIES
from .loop import Run, Trace


class CaseInvalid(AssertionError):
    """The planted fault did not do what the case claims (or a healthy variation is not healthy)."""


@dataclass(frozen=True)
class Kind:
    name: str
    truth: str  # ok / setup / numerics
    a: Run
    b: Run
    words: tuple = ()  # one of them in the verdict's headline/sub_cause/evidence: the cause is named
    check: Callable | None = None  # check(fam, trace_a, trace_b) raises CaseInvalid when the fault did not show
    families: tuple | None = None  # the families it applies to (None: all)
    about: str = ""
    skip: dict = field(default_factory=dict)  # family -> why this case is not run there


def need(cond: bool, why: str) -> None:
    if not cond:
        raise CaseInvalid(why)


def _finite(t: Trace) -> bool:
    return all(math.isfinite(x) for x in t.losses) and all(t.params_finite)


def _tail(t: Trace, k: int = 6) -> float:
    return sum(t.losses[-k:]) / k


def _moved(t: Trace, names) -> float:
    """The fraction of the named parameters' elements whose value changed over the run."""
    tot = ch = 0
    for n in names:
        tot += t.before[n].numel()
        ch += int((t.before[n] != t.after[n]).sum())
    return ch / max(tot, 1)


def _losses_differ(a: Trace, b: Trace, step: int = 0, rel: float = 1e-4) -> bool:
    x, y = a.losses[step], b.losses[step]
    return not math.isfinite(y) or abs(x - y) > rel * max(abs(x), 1e-12)


def _outcome_differs(a: Trace, b: Trace) -> bool:
    return not _finite(b) or abs(_tail(a) - _tail(b)) > 0.02 * abs(_tail(a)) or any(
        not torch.equal(a.after[n], b.after[n]) for n in a.after)


# --- checks -------------------------------------------------------------------------------------------------------
def check_accumulates(fam, a, b):
    need(not any(a.accumulated), "A's gradients were non-zero before a backward (A should zero them)")
    need(all(b.accumulated[1:]), "B's gradients were not carried into the next step (no accumulation)")
    need(_outcome_differs(a, b), "B ends like A")


def check_loss_differs(fam, a, b):
    need(_losses_differ(a, b, 0), f"the losses at step 0 are the same ({a.losses[0]} / {b.losses[0]})")
    need(_outcome_differs(a, b), "B ends like A")


def check_lr(fam, a, b):
    need(all(x != y for x, y in zip(a.lrs[0], b.lrs[0])), f"the lrs at step 0 are alike: {a.lrs[0]} {b.lrs[0]}")
    need(_outcome_differs(a, b), "B ends like A")


def check_wd_norms(fam, a, b):
    nod = [n for n, (lr, wd) in a.group_of.items() if wd == 0.0]
    need(bool(nod), "A has no parameter without weight decay")
    need(all(b.group_of[n][1] > 0 for n in nod), "B does not decay A's no-decay parameters")
    need(any(not torch.equal(a.after[n], b.after[n]) for n in nod), "B's norm/bias parameters end as A's")


def check_frozen(fam, a, b):
    bb = [n for n in a.before if n.startswith(fam.backbone)]
    need(bool(bb), "the family has no backbone parameters")
    need(not any(n in b.grad_seen for n in bb), "B's backbone got a gradient")
    need(_moved(b, bb) == 0.0, "B's backbone moved")
    need(_moved(a, bb) > 0.5, "A's backbone did not train")


def check_head_missing(fam, a, b):
    head = [n for n in a.before if n.startswith(fam.head + ".")]
    need(bool(head) and not any(n in b.in_optimizer for n in head), "B's optimizer holds the head")
    need(all(n in b.grad_seen for n in head), "B's head gets no gradient (it should: only the optimizer lacks it)")
    need(_moved(b, head) == 0.0 and _moved(a, head) > 0.5, "the head moved in B or not in A")


def check_head_lr(fam, a, b):
    head = [n for n in a.before if n.startswith(fam.head + ".")]
    need(all(b.group_of[n][0] != a.group_of[n][0] for n in head), "the head's lr is the same in both")
    need(_outcome_differs(a, b), "B ends like A")


def check_eval(fam, a, b):
    need(a.train_mode and not b.train_mode, "B is not in eval mode")
    check_loss_differs(fam, a, b)


def check_sched(fam, a, b):
    need(a.lrs[0] != b.lrs[0], "the schedules give the same lr at step 0")
    need(_outcome_differs(a, b), "B ends like A")


def check_data_order(fam, a, b):
    need(a.batch_hashes[0] != b.batch_hashes[0], "the first batches are the same")
    need(_outcome_differs(a, b), "B ends like A")  # one dataset by construction (the family's), another order


def check_nonfinite(fam, a, b):
    need(_finite(a) and all(a.grads_finite), "A is not finite")
    need(not all(b.grads_finite) or not _finite(b), "B never produced Inf/NaN")


def check_lost_updates(fam, a, b):
    weights = [n for n in a.before if a.before[n].dim() >= 2]
    ma, mb = _moved(a, weights), _moved(b, weights)
    need(ma > 0.9, f"A's weights did not move ({ma:.2f} of elements changed)")
    need(mb < 0.5 * ma, f"B's bfloat16 weights kept most updates ({mb:.2f} of elements changed, A {ma:.2f})")


def seed_spread(fam, k: int = 8, seeds=(1, 2, 3)) -> float:
    """How far apart the healthy recipe's final losses (mean of the last ``k``) land when only the data order's
    seed changes: the noise a precision or thread-count difference may move a run's outcome within."""
    from .loop import train

    tails = [_tail(train(fam, Run(shuffle_seed=s)), k) for s in (0, *seeds)]
    return max(tails) - min(tails)


def check_healthy(fam, a, b):
    need(_finite(a) and _finite(b), "a healthy run produced Inf/NaN")
    ta, tb = _tail(a, 8), _tail(b, 8)
    if ta == tb:
        return
    spread = seed_spread(fam)
    need(abs(ta - tb) <= max(spread, 0.02 * abs(ta)),
         f"the healthy pair does not end alike: mean of the last 8 losses {ta:.4f} / {tb:.4f}, "
         f"beyond the data-order seeds' spread {spread:.4f}")
    need(b.losses[-1] < b.losses[0] or fam.kind == "gan", "B did not learn")


CLASSIFIERS = ("mlp", "cnn", "resnet", "gru", "transformer")
NOT_GAN = tuple(f for f in FAMILIES if f != "gan")
BASE = Run()

FAULTS = [
    Kind("no_zero_grad", "setup", BASE, Run(zero_grad=False), ("zero_grad", "accumulat"), check_accumulates,
         about="optimizer.zero_grad() missing in B: gradients accumulate"),
    Kind("loss_scale", "setup", BASE, Run(loss_scale=10.0), ("loss",), check_loss_differs,
         about="B's loss x10"),
    Kind("term_sign", "setup", BASE, Run(term_sign=-1.0), ("sign", "kl", "loss term", "auxiliary", "loss"),
         check_loss_differs, families=NOT_GAN,
         about="the sign of one loss term flipped in B (the VAE's KL; the others' auxiliary logit penalty)"),
    Kind("lr_x100", "setup", BASE, Run(lr_mult=100.0), ("learning rate", " lr"), check_lr,
         about="B's learning rate x100"),
    Kind("wd_norms", "setup", BASE, Run(groups="one"), ("weight decay", "weight_decay"), check_wd_norms,
         families=tuple(f for f in NOT_GAN),
         about="A: two groups (no weight decay on norms/biases); B: one group, weight decay on all"),
    Kind("frozen", "setup", BASE, Run(freeze=True), ("requires_grad", "frozen", "no gradient", "never get",
                                                      "trainable"), check_frozen, families=NOT_GAN,
         about="B's backbone requires_grad=False, never unfrozen"),
    Kind("head_missing", "setup", BASE, Run(drop_head=True), ("optimizer", "param group", "not updated",
                                                               "never updated"), check_head_missing,
         families=NOT_GAN, about="B's head parameters left out of the optimizer"),
    Kind("head_lr", "setup", BASE, Run(head_lr_mult=10.0), ("learning rate", " lr", "param group"), check_head_lr,
         families=NOT_GAN, about="B's head in its own param group with 10x the lr"),
    Kind("eval_mode", "setup", BASE, Run(eval_mode=True), ("eval", "train mode", "training mode", "dropout",
                                                            "batchnorm"), check_eval,
         about="B trains in eval mode (model.train() forgotten): dropout off / BatchNorm on running stats"),
    Kind("label_smoothing", "setup", BASE, Run(label_smoothing=0.1), ("label smoothing", "label_smoothing",
                                                                      "loss function"), check_loss_differs,
         families=CLASSIFIERS, about="label smoothing 0.1 in B only"),
    Kind("sched_off_by_one", "setup", BASE, Run(sched_extra=True), ("learning rate", " lr", "schedul"), check_sched,
         about="B calls scheduler.step() once before the first optimizer.step()"),
    Kind("data_order", "setup", BASE, Run(shuffle_seed=1), ("data", "batch", "shuffle", "order"), check_data_order,
         about="B's shuffle from another seed"),
    Kind("fp16_overflow", "numerics", BASE, Run(autocast="float16", static_scale=2.0**24),
         ("inf", "nan", "non-finite", "overflow"), check_nonfinite,
         about="B: float16 autocast with a hand-written loss scale 2**24 and no GradScaler: the backward overflows"),
    Kind("bf16_lost_updates", "numerics", Run(lr_mult=0.002), Run(lr_mult=0.002, weights_dtype="bfloat16"),
         ("bfloat16", "bf16", "lost", "round", "update"), check_lost_updates,
         about="both at 1/500 of the family's lr; B's weights kept in bfloat16 (model.to(torch.bfloat16))"),
    Kind("log_softmax_fp16", "numerics", Run(log_softmax="float32"), Run(log_softmax="float16"),
         ("softmax", "log", "inf", "nan", "non-finite"), check_nonfinite, families=CLASSIFIERS,
         about="both: nll(torch.log(torch.softmax(logits / T))) (T per family, 0.1-0.35); B computes it in float16: log(0) = -inf"),
]

VARIATIONS = [
    Kind("identical", "ok", BASE, BASE, (), check_healthy, about="the same run twice"),
    Kind("bf16_autocast", "ok", BASE, Run(autocast="bfloat16"), (), check_healthy,
         about="B under torch.autocast('cpu', dtype=torch.bfloat16)"),
    Kind("fp16_scaler", "ok", BASE, Run(autocast="float16", scaler=True), (), check_healthy,
         about="B under float16 autocast with torch.amp.GradScaler('cpu')"),
    Kind("threads", "ok", BASE, Run(threads=2), (), check_healthy,
         about="the same shuffle seed; torch.set_num_threads 1 vs 2"),
    Kind("compile", "ok", BASE, Run(compile=True), (), check_healthy,
         about="B's model torch.compile(backend='aot_eager')"),
]

KINDS = {k.name: k for k in FAULTS + VARIATIONS}


@dataclass(frozen=True)
class Case:
    family: str
    kind: str

    @property
    def name(self) -> str:
        return f"{self.family}/{self.kind}"


def all_cases(families=None, kinds=None) -> list[Case]:
    out = []
    for k in FAULTS + VARIATIONS:
        if kinds and k.name not in kinds:
            continue
        for f in FAMILIES:
            if families and f not in families:
                continue
            if k.families is not None and f not in k.families:
                continue
            out.append(Case(f, k.name))
    return out


def named(words, verdict) -> bool:
    """Whether one of the case's words is in the verdict's headline, sub-cause or evidence (case-insensitive)."""
    if not words:
        return True
    text = " ".join([verdict.get("headline") or "", verdict.get("sub_cause") or "",
                     *(verdict.get("evidence") or [])]).lower()
    return any(w.lower() in text for w in words)
