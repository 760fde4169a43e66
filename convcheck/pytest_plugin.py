"""pytest plugin: assert CPU/GPU (or two-mode) parity within tolerances.

Declares the ``--convcheck-*`` options (the same ones ``convcheck compare``
takes), the ``convcheck`` marker, and the ``convcheck_compare`` fixture::

    def test_parity(convcheck_compare):
        result = convcheck_compare("lenet", targets="cpu,cpu:emulate-tf32")
        convcheck.assert_parity(result)

Registered through the ``pytest11`` entry point.
"""

from __future__ import annotations

import pytest

from convcheck.options import declare_compare_options, tolerances_from

PREFIX = "convcheck-"


def pytest_addoption(parser):
    group = parser.getgroup("convcheck", "convcheck: CPU/GPU parity")
    declare_compare_options(group.addoption, prefix=PREFIX)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "convcheck(**options): default keyword arguments for the convcheck_compare fixture")


@pytest.fixture
def convcheck_compare(request):
    """``run(model, targets=None, **kwargs) -> CompareResult`` with the session's --convcheck-* defaults."""
    from convcheck.pipeline import compare

    opts = {k: v for k, v in vars(request.config.option).items() if k.startswith("convcheck_")}
    defaults = dict(
        targets=opts["convcheck_targets"], steps=opts["convcheck_steps"],
        batch_size=opts["convcheck_batch_size"], optimizer=opts["convcheck_optimizer"],
        lr=opts["convcheck_lr"], seed=opts["convcheck_seed"], envelope=opts["convcheck_envelope"],
        data=opts["convcheck_data"], tolerances=tolerances_from(opts, PREFIX),
    )
    marker = request.node.get_closest_marker("convcheck")
    if marker:
        defaults.update(marker.kwargs)

    def run(model, targets=None, **kwargs):
        args = {**defaults, **kwargs}
        if targets is not None:
            args["targets"] = targets
        return compare(model, **args)

    return run
