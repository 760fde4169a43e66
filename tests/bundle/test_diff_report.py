"""Issue 26: the diff's reports are titled as a diff (terminal header and report.html)."""

from __future__ import annotations

import io

from convcheck.bundle.diff import diff_bundles
from convcheck.report.html import render_html
from convcheck.report.text import make_console, render_compare


def test_the_diff_report_is_titled_as_a_diff(bundles):
    result, _, _ = diff_bundles(*bundles)
    page = render_html(result, {})
    assert "<h1>convcheck diff: lenet, the recorded runs cpu vs cpu:bf16</h1>" in page
    assert "<title>convcheck diff: lenet</title>" in page
    assert "convcheck compare" not in page
    buf = io.StringIO()
    render_compare(result, make_console(buf, width=100))
    assert buf.getvalue().startswith("convcheck diff  model lenet (bundle, input 1x28x28, 10 classes)")
