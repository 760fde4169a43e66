"""Issue 35: the tables people expect from a dump diff of two watched runs (``convcheck diff --csv``, and the
report folder's ``watch_layers.csv``, ``watch_snapshots.csv``, ``watch_grads.csv``, ``watch_report.html``).

Two runs of one small model, recorded as a user would; in B the last layer computes under bfloat16 autocast.
At step 0 every layer before it sees the same weights and batch, so the tables must name it alone."""

from __future__ import annotations

import csv
import html
import math
import os
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn as nn

import convcheck
from convcheck.cli.main import main
from convcheck.analysis.tables import (GRAD_COLUMNS, LAYER_COLUMNS, SNAPSHOT_COLUMNS, Table, compare_arrays, ratio,
                                    relative, watch_tables)


class Net(nn.Module):
    def __init__(self, bf16_head: bool = False):
        super().__init__()
        self.bf16_head = bf16_head
        self.fc1, self.fc2, self.head = nn.Linear(10, 32), nn.Linear(32, 32), nn.Linear(32, 3)

    def forward(self, x):
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16_head):
            return self.head(h).float()


def record(out, bf16_head: bool, snapshot_steps) -> None:
    convcheck.seed_everything(0)
    model = Net(bf16_head)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    with convcheck.watch(model, opt, out=out, snapshot_steps=snapshot_steps) as w:
        for _ in range(4):
            x, y = torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tables")
    record(tmp / "a", False, (0, 2))
    record(tmp / "b", True, (0, 2, 3))  # B also snapshots step 3: its update at step 2 is measured
    return tmp


def cli(capsys, *args) -> tuple[int, str, str]:
    code = main(["diff", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def rows_of(path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def test_csv_names_the_changed_layer(runs, tmp_path, capsys):
    code, out, err = cli(capsys, runs / "a", runs / "b", "--csv", tmp_path / "layers.csv", "--no-save")
    # four steps: too few to judge whether the bfloat16 head changes how the runs end (issue 48's outcome rule)
    assert code == 5 and "verdict: inconclusive: the runs part at step 1 in fc2, as their precisions can explain" in " ".join(out.split()) and err == ""
    header, rows = rows_of(tmp_path / "layers.csv")
    assert (tmp_path / "layers.csv").read_text().splitlines()[0] == (
        "step,layer,dtype_a,dtype_b,max_abs_a,max_abs_b,max_abs_rel,mean_rel,std_rel,zeros_rel,min_nonzero_rel,"
        "nan_a,nan_b,inf_a,inf_b,calls_a,calls_b,worst_call_a,worst_call_b,nonfinite_call_a,nonfinite_call_b,"
        "worst_rel")
    assert tuple(header) == LAYER_COLUMNS
    assert [(r["step"], r["layer"]) for r in rows] == [(str(k), n) for k in range(4) for n in ("fc1", "fc2", "head")]
    step0 = {r["layer"]: r for r in rows if r["step"] == "0"}
    assert step0["fc1"]["worst_rel"] == step0["fc2"]["worst_rel"] == "0.0"  # the same weights and batch
    assert float(step0["head"]["worst_rel"]) > 1e-4 and step0["head"]["dtype_b"] == "bfloat16"
    assert max(rows, key=lambda r: float(r["worst_rel"]))["layer"] == "head"


def test_snapshot_and_gradient_tables(runs):
    t = watch_tables(runs / "a", runs / "b")
    assert (t.snapshots.columns, t.grads.columns) == (SNAPSHOT_COLUMNS, GRAD_COLUMNS)
    snaps = t.snapshots.rows
    assert sorted({r["step"] for r in snaps}) == [0, 2]  # the steps both snapshotted
    assert "step 3 snapshotted by B only: no array compared there" in t.snapshots.skipped
    outputs = {r["name"]: r for r in snaps if r["step"] == 0 and r["kind"] == "output"}
    assert outputs["fc1"]["cosine"] == outputs["fc2"]["cosine"] == 1.0
    assert outputs["fc1"]["max_abs_err"] == outputs["fc2"]["rel_l2_err"] == 0.0
    for k in (0, 2):  # of the forward tensors, the head's output is the furthest apart at each snapshot step
        forward = [r for r in snaps if r["step"] == k and r["kind"] != "grad"]
        assert min(forward, key=lambda r: r["cosine"])["key"] == "out/head/0/0"
        assert max(forward, key=lambda r: r["rel_l2_err"])["key"] == "out/head/0/0"
    assert outputs["head"]["cosine"] < 1.0
    head = outputs["head"]
    assert 0 < head["rel_l2_err"] < 0.05 and 0 < head["max_rel_err"] <= 2 and head["max_abs_err"] > 0
    assert [r["key"] for r in snaps if r["step"] == 0][:4] == ["in/fc1/0/0", "out/fc1/0/0", "in/fc2/0/0", "out/fc2/0/0"]
    grads = {(r["step"], r["param"]): r for r in t.grads.rows}
    assert len(grads) == 4 * 6
    g = grads[(0, "head.weight")]
    assert g["norm_ratio"] == pytest.approx(g["norm_b"] / g["norm_a"]) and g["norm_ratio"] != 1.0
    assert 0.99 < g["cosine"] < 1.0 and grads[(1, "head.weight")]["cosine"] is None  # step 1: no snapshot
    assert grads[(2, "fc1.weight")]["update_ratio_b"] > 0 and grads[(2, "fc1.weight")]["update_ratio_a"] is None
    assert t.curves["A"]["loss"][0] == pytest.approx(t.curves["B"]["loss"][0], rel=0.05)
    assert all(v > 0 for v in t.curves["B"]["grad_norm"])


def test_csv_never_overwrites_without_force_nor_writes_through_anything_else(runs, tmp_path, capsys):
    a, b = runs / "a", runs / "b"
    mine = tmp_path / "mine.csv"
    mine.write_text("my own numbers\n")
    code, out, err = cli(capsys, a, b, "--csv", mine)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "--csv" in err and "pass --force" in err and "Traceback" not in err
    assert mine.read_text() == "my own numbers\n"
    assert cli(capsys, a, b, "--csv", mine, "--force")[0] == 5
    assert mine.read_text().startswith("step,layer,dtype_a,")
    link = tmp_path / "link.csv"
    link.symlink_to(tmp_path / "elsewhere.csv")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, words in ((tmp_path, "is a directory"), (link, "is a symbolic link"), (fifo, "is a FIFO"),
                        (tmp_path / "no" / "t.csv", "does not exist"), (a / "t.csv", "diff never writes into a run")):
        code, out, err = cli(capsys, a, b, "--csv", path, "--force")
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and words in err, (path, err)
    assert not (tmp_path / "elsewhere.csv").exists() and not (a / "t.csv").exists()
    code, out, err = cli(capsys, a, "--judge", "cpu:float64", "--csv", tmp_path / "one.csv")
    assert code == 2 and "--csv writes the table of two watched runs" in err
    for side in ("x", "y"):  # two recorded runs (convcheck record): their folder holds layers.csv instead
        (tmp_path / side).mkdir()
        (tmp_path / side / "manifest.json").write_text('{"schema": "convcheck.bundle/1"}')
    code, out, err = cli(capsys, tmp_path / "x", tmp_path / "y", "--csv", tmp_path / "rec.csv")
    assert code == 2 and "of recorded runs, --out DIR writes layers.csv" in err
    assert not any((tmp_path / n).exists() for n in ("one.csv", "rec.csv"))


def test_out_writes_the_tables_and_a_page(runs, tmp_path, capsys):
    rep = tmp_path / "rep"
    code, out, _ = cli(capsys, runs / "a", runs / "b", "--out", rep, "--csv", tmp_path / "t.csv")
    assert code == 5
    assert sorted(p.name for p in rep.iterdir()) == ["watch_diff.json", "watch_grads.csv", "watch_layers.csv",
                                                     "watch_report.html", "watch_snapshots.csv"]
    assert (rep / "watch_layers.csv").read_text() == (tmp_path / "t.csv").read_text()
    assert tuple(rows_of(rep / "watch_snapshots.csv")[0]) == SNAPSHOT_COLUMNS
    assert tuple(rows_of(rep / "watch_grads.csv")[0]) == GRAD_COLUMNS
    page = (rep / "watch_report.html").read_text()
    verdict = next(line for line in out.splitlines() if line.startswith("verdict: "))
    assert html.escape(verdict) in page
    assert page.count("<img ") == 2 and "data:image/png;base64," in page
    assert "every row of each table is in its CSV file" in page
    code, _, err = cli(capsys, runs / "a", runs / "b", "--out", rep)  # never replaced without --force
    assert code == 2 and "already holds a report (watch_diff.json); pass --force" in err
    (rep / "watch_diff.json").unlink()
    code, _, err = cli(capsys, runs / "a", runs / "b", "--out", rep)
    assert code == 2 and "watch_layers.csv" in err and "pass --force" in err


def test_names_from_the_run_are_escaped_in_the_page(runs):
    from convcheck.report.watch_report import render_watch_report, table_html
    from convcheck.analysis.diff import diff_watched

    t = watch_tables(runs / "a", runs / "b")
    hostile = "x<script>alert(1)</script>"
    rows = [{**r, "layer": hostile} for r in t.layers.rows]
    t = replace(t, layers=replace(t.layers, rows=rows, skipped=(f"{hostile} in one run only",)))
    page = render_watch_report(diff_watched(runs / "a", runs / "b", judge="cpu:float64"), t, images={})
    assert "<script>" not in page and "x&lt;script&gt;alert(1)&lt;/script&gt;" in page
    part = table_html(t.snapshots, n=5)  # worst first, capped, the rest counted
    assert "the worst 5 of 24 rows; 19 more left out here, all in watch_snapshots.csv" in part
    assert "in/fc1/0/0" not in part  # equal in both runs: not among the worst


def test_nan_inf_and_none_never_crash_and_read_honestly():
    assert relative(1.0, 1.0) == relative(0.0, 0.0) == relative(None, None) == relative(math.inf, math.inf) == 0.0
    assert relative(2.0, 1.0) == 0.5 and relative(1e308, -1e308) == 2.0
    assert relative(None, 1.0) is None and relative(math.nan, 1.0) is None
    assert relative(1.0, math.inf) == math.inf
    assert ratio(0.0, 0.0) == 1.0 and ratio(0.0, 1.0) == math.inf and ratio(math.inf, 1.0) == 0.0
    assert ratio(None, 1.0) is None and ratio(1.0, math.nan) is None and ratio(2.0, 1.0) == 0.5
    x = np.array([1.0, 2.0, np.nan, 4.0], dtype=np.float32)
    r = compare_arrays(x, np.array([1.0, 2.0, 3.0, np.inf]))
    assert (r["nonfinite_a"], r["nonfinite_b"]) == (1, 1) and r["cosine"] == 1.0 and r["max_abs_err"] == 0.0
    assert compare_arrays(np.full(3, np.nan), np.ones(3))["cosine"] is None
    assert compare_arrays(np.zeros(3), np.zeros(3))["cosine"] == 1.0
    assert compare_arrays(np.zeros(3), np.ones(3))["cosine"] == 0.0
    big = compare_arrays(np.array([3e38, -3e38], dtype=np.float32), np.array([-3e38, 3e38], dtype=np.float32))
    assert big["cosine"] == pytest.approx(-1.0) and big["max_rel_err"] == 2.0 and big["rel_l2_err"] == 2.0
    text = Table("t", ("a", "b", "c", "d"), [{"a": None, "b": math.nan, "c": math.inf, "d": "n,1"}]).csv()
    assert text == 'a,b,c,d\n,,inf,"n,1"\n'
