"""The rules for watched DDP runs (``convcheck diff`` of rank folders), reading ``RankEvidence``; when none
fires, ``ranks_otherwise`` gives the first rank pair's own verdict (chosen from its ``PairEvidence`` by the
same rules as any two watched runs), else ``ok``.

==== ==== ================ ======== ==============================================================
id   prio name             category fires on
==== ==== ================ ======== ==============================================================
W201 10   ranks-unsynced   setup    a rank whose parameters, averaged gradients or learning rates part
                                    from rank 0's where DDP makes them equal
W202 20   ranks-same-data  setup    two ranks that trained on the same batches at every step
W203 30   ranks-epoch-order setup   every epoch in the same order (``sampler.set_epoch`` not called)
==== ==== ================ ======== ==============================================================
"""

from __future__ import annotations

from convcheck.diagnose.registry import verdict_rule
from convcheck.diagnose.remedies import SET_EPOCH_REMEDIES, UNSHARDED_REMEDIES, UNSYNCED_REMEDIES
from convcheck.diagnose.verdict import Verdict
from convcheck.diagnose.watched_evidence import RankEvidence

UNSYNCED = ("gradients", "parameters", "lr")


@verdict_rule("W201", "ranks-unsynced", priority=10, category="setup", reads=RankEvidence,
              headline="in {run}, rank {rank} parts from rank {reference} at step {step}: its {kind} differ where "
                       "DDP makes them equal", remedies=tuple(UNSYNCED_REMEDIES))
def ranks_unsynced(ev: RankEvidence) -> Verdict | None:
    """A run whose ranks part is wrong on its own, whatever the other run did."""
    f = next((f for f in ev.findings if f.kind in UNSYNCED), None)
    if f is None:
        return None
    return ranks_unsynced.verdict([x.line() for x in ev.findings], vars(f), target=f.run,
                                  sub_cause="ranks not synchronised")


@verdict_rule("W202", "ranks-same-data", priority=20, category="setup", reads=RankEvidence,
              headline="in {run}, ranks {reference} and {rank} trained on the same batches at every step",
              remedies=tuple(UNSHARDED_REMEDIES))
def ranks_same_data(ev: RankEvidence) -> Verdict | None:
    """Every rank of a run saw rank 0's batches: the data is not sharded (no DistributedSampler)."""
    f = next((f for f in ev.findings if f.kind == "same data"), None)
    if f is None:
        return None
    return ranks_same_data.verdict([x.line() for x in ev.findings], vars(f), target=f.run,
                                   sub_cause="data not sharded")


@verdict_rule("W203", "ranks-epoch-order", priority=30, category="setup", reads=RankEvidence,
              headline="in {run}, every epoch trains on the same batches in the same order (epochs of {step} "
                       "steps): the sampler is not told the epoch", remedies=tuple(SET_EPOCH_REMEDIES))
def ranks_epoch_order(ev: RankEvidence) -> Verdict | None:
    """A DDP run whose epochs repeat one order: ``DistributedSampler.set_epoch`` never called."""
    f = next((f for f in ev.findings if f.kind == "epoch order"), None)
    if f is None:
        return None
    return ranks_epoch_order.verdict([x.line() for x in ev.findings], vars(f), target=f.run,
                                     sub_cause="sampler.set_epoch missing")


def ranks_otherwise(ev: RankEvidence) -> Verdict:
    """The first rank pair that is not ``ok`` (its verdict, prefixed with the rank), else ``ok``."""
    for k, v in enumerate(ev.per_rank):
        if v.category != "ok":
            return Verdict(v.category, f"rank {k}: {v.headline}", evidence=list(v.evidence), remedies=list(v.remedies),
                           target=v.target, layer=v.layer, sub_cause=v.sub_cause)
    evidence = [x.line() for x in ev.findings]
    if ev.per_rank:
        return Verdict("ok", "every rank agrees with its counterpart within rounding, and within each run the "
                             "ranks agree where DDP makes them equal", evidence=evidence)
    return Verdict("ok", "the two ranks agree where DDP makes them equal (parameters, averaged gradients, learning "
                         "rates); their different batches are the sampler's sharding, not a data difference",
                   evidence=evidence)
