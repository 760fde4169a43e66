"""pytest plugin: assert CPU/GPU (or two-mode) parity within tolerances.

Declares the ``--convcheck-*`` options (the same ones ``convcheck compare``
takes), the ``convcheck`` marker, and the ``convcheck_compare`` fixture::

    @pytest.mark.convcheck(bound_factor=4, steps=10)
    def test_parity(convcheck_compare):
        result = convcheck_compare("lenet", targets="cpu,cpu:emulate-tf32")
        convcheck.assert_parity(result)

The marker and the fixture take the CLI's option names (``bound_factor``,
``min_error``, ``judge``, ...). Registered through the ``pytest11`` entry point.
"""

from __future__ import annotations

import pytest

from convcheck.plan.options import declare_compare_options

PREFIX = "convcheck-"


def pytest_addoption(parser):
    group = parser.getgroup("convcheck", "convcheck: CPU/GPU parity")
    declare_compare_options(group.addoption, prefix=PREFIX)
    group.addoption("--convcheck-record", dest="convcheck_record", default=None, metavar="DIR",
                    help="record a baseline bundle per convcheck_baseline call into DIR (the test is then skipped)")
    group.addoption("--convcheck-against", dest="convcheck_against", default=None, metavar="DIR",
                    help="diagnose each convcheck_baseline call against its baseline in DIR (missing: the test fails)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "convcheck(**options): default options for the convcheck_compare fixture "
                   "(the names of convcheck compare's options: targets, judge, steps, bound_factor, ...)")


def _session_config(pytest_config):
    """The project's [tool.convcheck] (pyproject.toml at the rootdir or above), then the --convcheck-*
    options actually given on top (an option left at its default does not override the file)."""
    from pathlib import Path

    from convcheck.plan.config import CompareConfig, default, with_options
    from convcheck.plan.options import OPTION_NAMES
    from convcheck.plan.project import load_project

    values, _ = load_project(start=Path(str(pytest_config.rootpath)))
    base = with_options(CompareConfig(), **{k: v for k, v in values.items()
                                            if k.replace("_", "-") in OPTION_NAMES})
    opts = vars(pytest_config.option)
    given = {}
    for name in OPTION_NAMES:
        field = name.replace("-", "_")
        value = opts.get(f"convcheck_{field}")
        if value != default(field):
            given[field] = value
    return with_options(base, **given)


def _test_config(request):
    """The session's config with the test's ``convcheck`` marker on top."""
    from convcheck.plan.config import with_options

    config = _session_config(request.config)
    marker = request.node.get_closest_marker("convcheck")
    return with_options(config, **marker.kwargs) if marker else config


@pytest.fixture
def convcheck_compare(request):
    """``run(model, targets=None, **options) -> CompareResult`` with the session's --convcheck-* defaults."""
    from convcheck.pipeline import compare

    config = _test_config(request)

    def run(model, targets=None, **options):
        return compare(model, targets, config=config, **options)

    return run


@pytest.fixture
def convcheck_baseline(request):
    """``run(model, target, name=None, input_shape=None, num_classes=None, **options) -> CompareResult``: this run
    of ``target`` diagnosed against the baseline recorded with ``--convcheck-record DIR`` (checked with
    ``--convcheck-against DIR``); the input shape and class count where the model cannot tell (recorded with
    the baseline, which the check then uses)."""
    from convcheck.bundle.baseline import run_baseline
    from convcheck.plan.config import with_options

    config = _test_config(request)
    opts = request.config.option

    def run(model, target, name=None, input_shape=None, num_classes=None, **options):
        return run_baseline(model, target, with_options(config, **options), record_dir=opts.convcheck_record,
                            against_dir=opts.convcheck_against, nodeid=f"{request.node.path.stem}.{request.node.name}", name=name,
                            fail=pytest.fail, skip=pytest.skip, input_shape=input_shape, num_classes=num_classes)

    return run
