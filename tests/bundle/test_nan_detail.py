"""Issue 24: a recorded run carries what made its first NaN/Inf (``training.nonfinite_detail``), so a diff
of two recordings names the producer, its op and its magnitude as ``compare`` does."""

from __future__ import annotations

from pathlib import Path

from convcheck.bundle.diff import diff_bundles
from convcheck.bundle.reader import open_bundle
from convcheck.pipeline import compare
from convcheck.plan.config import CompareConfig

USER_CODE = Path(__file__).resolve().parents[1] / "scenarios" / "user_code.py"
RUN = dict(steps=12, envelope=0, optimizer="sgd", lr=0.05)
SHAPE = dict(input_shape=(1, 28, 28), num_classes=10)


def test_a_diff_of_recordings_names_the_op_that_overflowed_mid_training(tmp_path):
    """A hand-written attention whose exp overflows float16 mid-training (its parity step is finite): the
    producer is only known from training, and the diff names it as compare does."""
    from convcheck.bundle.record import record_run

    spec = f"{USER_CODE}:attention_net"
    for target, name in (("cpu", "A"), ("cpu:fp16", "B")):
        (tmp_path / name).mkdir()
        record_run(spec, target, CompareConfig(**RUN), tmp_path / name, **SHAPE)
    detail = open_bundle(tmp_path / "B")["training"]["nonfinite_detail"]
    assert detail["cpu:fp16"]["callable"] == "module" and detail["cpu:fp16"]["op"] == "exp"
    assert detail["cpu:fp16"]["magnitude"] > 65504
    assert "op" not in detail["cpu:float64"]  # the judge stays finite

    diffed, _, _ = diff_bundles(tmp_path / "A", tmp_path / "B")
    live = compare(spec, "cpu,cpu:fp16", env_findings=[], verify=False, **RUN, **SHAPE)
    assert live.verdict.headline.startswith("float16 overflow in exp in '3' (its own code) on cpu:fp16 at training "
                                            "step "), live.verdict.headline
    assert diffed.verdict.category == "numerics" and diffed.verdict.layer == "3"
    assert diffed.verdict.headline == live.verdict.headline
    assert diffed.verdict.remedies[0] == live.verdict.remedies[0]
    assert "subtract the maximum before exp" in diffed.verdict.remedies[0]
