"""Issue 44: report.html and watch_report.html read in a browser window 1200 px wide: the column each table is
sorted by (``own/floor``, ``worst_rel``) and the verdict are inside the window, and the page itself never
scrolls sideways (a wide table scrolls inside its own box). Each page is rendered by headless Chromium, which
runs a script measuring the elements' boxes and writes the figures into the DOM it dumps. Layer names are made
long on purpose (a user's ``encoder.layers.11.self_attention.output_projection``...).

Skipped, saying so, where no Chromium is installed (``apt-get install chromium``)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import torch
import torch.nn as nn

import convcheck
from convcheck.cli.main import main

BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no Chromium here (apt-get install chromium) to render "
                                                        "the reports in; their layout is not checked")
WIDTH = 1200

MEASURE = """<script>
window.addEventListener('load', () => {
  const vw = document.documentElement.clientWidth, m = {vw: vw, page: document.documentElement.scrollWidth};
  const right = el => {   // its right edge; Infinity when a scrolling box it sits in hides that edge
    const x = el.getBoundingClientRect().right;
    for (let p = el.parentElement; p; p = p.parentElement)
      if (getComputedStyle(p).overflowX !== 'visible' && x > p.getBoundingClientRect().right + 0.5) return Infinity;
    return x; };
  m.sort = [...document.querySelectorAll('th.sort')].map(th => [th.textContent, right(th)]);
  m.verdict = [...document.querySelectorAll('.verdict')].map(right);
  document.body.setAttribute('data-measured', JSON.stringify(m));
});
</script>"""


def measured(page, tmp_path) -> dict:
    """The page's figures as Chromium lays it out in a window ``WIDTH`` px wide."""
    shown = tmp_path / f"measured-{page.name}"
    shown.write_text(page.read_text(encoding="utf-8").replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    done = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--window-size={WIDTH},900", "--virtual-time-budget=3000", "--dump-dom",
                           shown.as_uri()], capture_output=True, text=True, timeout=180)
    found = re.search(r'data-measured="([^"]*)"', done.stdout)
    assert found, f"{BROWSER} rendered nothing measurable (exit {done.returncode}): {done.stderr[-2000:]}"
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))


def check(m: dict, sort_columns: set[str]) -> None:
    assert m["vw"] <= WIDTH and m["page"] <= m["vw"], f"the page scrolls sideways: {m}"
    assert {name for name, _ in m["sort"]} == sort_columns, m["sort"]
    assert all(x <= m["vw"] for _, x in m["sort"]), f"a sort column is off the window's right edge: {m}"
    assert m["verdict"] and all(x <= m["vw"] for x in m["verdict"]), f"the verdict is off the window: {m}"


class LongNames(nn.Module):
    """Module names as long as a real model's dotted paths."""

    def __init__(self):
        super().__init__()
        self.encoder_layers_11_self_attention_output_projection = nn.Linear(12, 48)
        self.decoder_blocks_7_cross_attention_value_projection_weight = nn.Linear(48, 48)
        self.classification_head_with_a_really_long_descriptive_name = nn.Linear(48, 3)

    def forward(self, x):
        h = torch.relu(self.encoder_layers_11_self_attention_output_projection(x.flatten(1)))
        h = torch.relu(self.decoder_blocks_7_cross_attention_value_projection_weight(h))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=getattr(self, "bf16", False)):
            return self.classification_head_with_a_really_long_descriptive_name(h).float()


def _record(out, bf16: bool) -> None:
    convcheck.seed_everything(0)
    model = LongNames()
    model.bf16 = bf16
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    with convcheck.watch(model, opt, out=out, snapshot_steps=(0, 2)) as w:
        for _ in range(3):
            x, y = torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


def test_watch_report_shows_its_sort_columns_and_verdict_at_1200px(tmp_path, capsys):
    _record(tmp_path / "a", False)
    _record(tmp_path / "b", True)
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "rep")]) in (0, 1, 5)
    capsys.readouterr()
    check(measured(tmp_path / "rep" / "watch_report.html", tmp_path), {"worst_rel", "rel_l2_err", "norm_ratio",
                                                                        "cosine"})


def test_report_html_shows_its_sort_column_and_verdict_at_1200px(tmp_path):
    from convcheck.report.export import write_run

    result = convcheck.compare(LongNames, "cpu,cpu:bf16", steps=2, envelope=0, batch_size=8, input_shape=(1, 3, 4),
                               num_classes=3, verify=False)
    write_run(result, tmp_path / "run")
    check(measured(tmp_path / "run" / "report.html", tmp_path), {"own/floor"})
