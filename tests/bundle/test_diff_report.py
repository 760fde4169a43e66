"""Issue 26: the diff's reports are titled as a diff (terminal header and report.html)."""

from __future__ import annotations

from convcheck.cli.main import main


def test_the_diff_report_is_titled_as_a_diff(bundles, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["diff", str(bundles[0]), str(bundles[1]), "--out", str(tmp_path / "R")]) in (0, 1)
    out = capsys.readouterr().out
    assert out.startswith("convcheck diff  model lenet (zoo, input 1x28x28, 10 classes)")
    page = (tmp_path / "R" / "report.html").read_text()
    assert "<h1>convcheck diff: lenet, the recorded runs cpu vs cpu:bf16</h1>" in page
    assert "<title>convcheck diff: lenet</title>" in page
    assert "convcheck compare" not in page
