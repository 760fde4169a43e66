"""The verdict: rules over parity, curves, symptoms and environment findings.

Categories (ARCHITECTURE.md, "Verdict categories"): ``ok``, ``numerics``,
``layer``, ``version``, ``hardware``, ``setup``, ``nondeterminism``.
``diagnose(result)`` gathers the evidence once (``evidence.gather``), then runs
the registered rules (``rules``) by priority; the first that applies decides:

==== ===== ================ ================ ==================================================
id   prio  name             category         fires when
==== ===== ================ ================ ==================================================
V001 10    stochastic-layer nondeterminism   a layer draws random numbers no mask is shared for
V002 20    judge-fails      setup            the judge's loss is NaN/Inf too (any run length), or it
                                             does not converge either with a training problem or
                                             in a run long enough to say (one-step parity naming
                                             no target-only cause, no target NaN while the judge
                                             trains sanely); a judge merely not converged yet
                                             (still falling, short run) is noted by ``ok``
V003 30    fragile-envelope setup            every target converges, envelope runs fail
V004 40    self-difference  nondeterminism   a target differs from itself run to run
V005 50    hardware-finding hardware         a target symptom with a hardware finding
V006 60    version-finding  version          a target symptom with a version finding
V009 65    ddp-setup        setup            a ddp: target's loss is off by the world size, or its
                                             per-rank BatchNorm statistics (drift beyond envelope
                                             and an outcome the envelope runs do not reach; else a
                                             note); registered by convcheck.ddp.rules
V007 70    layer-error      layer            the main target symptom: a layer's local error far
                                             above its bound
V008 80    precision-effect numerics         any other target symptom (NaN/Inf producer: a module,
                                             its own code's op, the loss, the optimizer step, the
                                             schedule; GradScaler collapse, underflow, lost updates,
                                             drift beyond the envelope (a note between same-precision
                                             targets that end alike), a failed outcome)
==== ===== ================ ================ ==================================================

When none fires the verdict is ``ok``. Diagnose never runs a model and never
calls into ``convcheck.measure.train``: everything it reads is in the comparison result.

Layout: ``verdict`` (``Verdict``, ``CATEGORIES``), ``evidence`` (``Evidence``,
``gather``), ``registry`` (``VerdictRule``, ``@verdict_rule``, ``RULES``,
``decide``), ``rules`` (the rules and ``ok_verdict``). A kind of target that
runs outside this process brings its own rules, registered when its executor
loads (``convcheck.targets.executors.load_plugins``, called here).
"""

from __future__ import annotations

from convcheck.diagnose.evidence import Evidence, LayerMargin, TargetFacts, gather
from convcheck.diagnose.registry import RULES, VerdictRule, decide, verdict_rule
from convcheck.diagnose.verdict import CATEGORIES, Verdict
from convcheck.diagnose import rules  # noqa: E402,I001 - importing the rules registers them
from convcheck.diagnose.rules import ok_verdict
from convcheck.targets.executors import load_plugins


def _with_plugins() -> list:
    """``RULES`` with the executors' own rules registered (V009, ``convcheck.ddp.rules``): loaded when a
    verdict is first asked for, not when this package is imported (a plugin's modules import it)."""
    load_plugins()
    return RULES


def __getattr__(name: str):
    if name == "RULE_IDS":  # {id: name} of every rule registered now (a plugin's included)
        return {r.id: r.name for r in _with_plugins()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def diagnose(result) -> Verdict:
    """Turn one comparison's evidence into a verdict."""
    _with_plugins()
    return decide(gather(result), ok_verdict)


__all__ = [
    "CATEGORIES", "RULES", "RULE_IDS", "Evidence", "LayerMargin", "TargetFacts", "Verdict", "VerdictRule",
    "decide", "diagnose", "gather", "ok_verdict", "rules", "verdict_rule",
]
