"""An ok verdict from a run too short for the float64 judge itself to converge says so on the training lines,
"convergence not judged: N steps, too few for the judge", instead of "did not converge" under an ok verdict
(issue 44)."""

from __future__ import annotations

import dataclasses

import convcheck
from convcheck.report.summary import training_states


def test_a_run_too_short_for_the_judge_says_convergence_not_judged():
    result = convcheck.compare("lenet", "cpu,cpu:float64", steps=6, envelope=0, batch_size=8, lr=1e-7,
                               verify=False, threads=1)
    assert result.verdict.category == "ok"
    assert not result.training.outcomes[result.config.judge].converged
    states = training_states(result)
    assert set(states) == {"cpu", "cpu:float64"}
    for state in states.values():
        assert state.startswith("convergence not judged: 6 steps, too few for the judge (loss ")
    # another verdict keeps the arms' own outcome: the judge not converging is then no excuse
    other = dataclasses.replace(result, verdict=dataclasses.replace(result.verdict, category="numerics"))
    assert all(s.startswith("did not converge (loss ") for s in training_states(other).values())
