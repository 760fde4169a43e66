"""convcheck.watch on models given tensors that are not strided memory (a sparse adjacency, a nested tensor, a
quantized or a meta tensor, a wrapper subclass; a sparse embedding's gradients): the loop trains exactly as
without the watch, the batch is hashed through its indices and values, the layers' statistics read their values,
and a snapshot says which arrays it could not keep (``watch/layouts.py``). Found on pytorch/examples gcn/main.py,
whose sparse adjacency stopped the user's loop inside the watch's hooks."""

from __future__ import annotations

import contextlib
import json
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import convcheck
from convcheck.analysis.diff import diff_watched
from convcheck.runformat.reader import open_watched
from convcheck.watch.batches import batch_hash, data_tensors, rounded_hashes


class GraphConvolution(nn.Module):
    """pytorch/examples gcn's layer: ``adj @ (x @ W) + b`` with a sparse ``adj``."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_in, d_out))
        self.bias = nn.Parameter(torch.zeros(d_out))
        nn.init.xavier_uniform_(self.weight)

    def forward(self, x, adj):
        return torch.sparse.mm(adj, x @ self.weight) + self.bias


class GCN(nn.Module):
    def __init__(self):
        super().__init__()
        self.gc1, self.gc2 = GraphConvolution(12, 16), GraphConvolution(16, 4)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x, adj):
        h = self.dropout(F.relu(self.gc1(x, adj)))
        return F.log_softmax(self.gc2(h, adj), dim=1)


def _graph(layout: str):
    g = torch.Generator().manual_seed(3)
    n = 30
    a = (torch.rand(n, n, generator=g) < 0.15).float()
    a = ((a + a.T + torch.eye(n)) > 0).float()
    a = a / a.sum(1, keepdim=True)
    adj = a.to_sparse() if layout == "coo" else a.to_sparse_csr()
    return torch.randn(n, 12, generator=g), adj, torch.randint(0, 4, (n,), generator=g)


def _train_gcn(out=None, layout="coo", steps=4, **kw) -> list[float]:
    torch.manual_seed(0)
    x, adj, y = _graph(layout)
    model = GCN()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR's "beta" warning
        with (convcheck.watch(model, opt, out=out, **kw) if out else contextlib.nullcontext()):
            for _ in range(steps):
                model.train()
                opt.zero_grad()
                loss = F.nll_loss(model(x, adj), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
    return losses


@pytest.mark.parametrize("layout,sync", [("coo", "layer"), ("csr", "layer"), ("coo", "step")])
def test_a_gcn_with_a_sparse_adjacency_trains_as_without_the_watch_and_diffs_ok(tmp_path, layout, sync):
    bare = _train_gcn(layout=layout)
    assert _train_gcn(tmp_path / "a", layout, sync=sync) == bare  # bitwise
    assert _train_gcn(tmp_path / "b", layout, sync=sync) == bare
    run = open_watched(tmp_path / "a")
    assert len(run.steps) == 4 and not run["truncated"] and run["watch_error"] is None
    layers = run.steps[0]["layers"]
    assert layers["gc1"]["n"] == 30 * 16 and layers["gc2"]["n"] == 30 * 4  # the outputs' statistics
    (entry,) = run["snapshots"]
    # the adjacency is not kept as an array (its values alone would replay as the argument they are not)
    assert any(s.startswith("in/gc1/0/1: a sparse_") for s in entry["not_stored"])
    assert entry["calls"]["gc1/0"]["args"][1] == {"opaque": f"a sparse_{layout} tensor"}
    d = diff_watched(tmp_path / "a", tmp_path / "b", judge="cpu:float64")
    assert d.verdict.category == "ok", d.lines()
    assert any("sparse_" in line for line in d.lines())  # the judge says why gc1/gc2 were not replayed


def test_the_sparse_gcn_records_with_snapshots_off(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVCHECK_SNAPSHOT_STEPS", "none")
    assert _train_gcn(tmp_path / "a") == _train_gcn()
    assert len(open_watched(tmp_path / "a").steps) == 4


def test_a_sparse_batch_is_hashed_through_its_indices_and_values():
    _, adj, _ = _graph("coo")
    dense = adj.to_dense()
    again = torch.sparse_coo_tensor(adj.indices().flip(1), adj.values().flip(0), adj.shape)  # another order
    other = dense.clone()
    other[0, 0] += 1
    assert batch_hash((again,), {}) == batch_hash((adj,), {})  # coalesced: the same entries hash alike
    assert batch_hash((other.to_sparse(),), {}) != batch_hash((adj,), {})
    assert batch_hash((adj,), {}) != batch_hash((dense,), {})  # the layout counts
    wider = torch.sparse_coo_tensor(adj.indices(), adj.values(), (30, 31))
    assert batch_hash((wider,), {}) != batch_hash((adj,), {})  # and the size
    assert rounded_hashes((adj,), {}) == rounded_hashes((again,), {})
    assert rounded_hashes((adj.to_sparse_csr(),), {}) is not None
    out = torch.sparse.mm(adj, torch.ones(30, 2))
    assert data_tensors((adj, out), {}, made=[adj.to_dense()]) == [adj, out]


class Scale(nn.Module):
    def forward(self, adj):
        return adj * 0.5  # a layer whose output is sparse


class Recommender(nn.Module):
    """A sparse embedding (sparse gradients, SparseAdam), a layer with a sparse output, and an extra argument
    it ignores (a nested, quantized, meta or wrapper-subclass tensor)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8, sparse=True)
        self.scale = Scale()
        self.head = nn.Linear(8, 3)

    def forward(self, idx, adj, extra=None):
        return self.head(torch.sparse.mm(self.scale(adj), self.emb(idx)))


def _extra(kind: str):
    from torch.testing._internal.two_tensor import TwoTensor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {"none": None, "meta": torch.empty(3, device="meta"),
                "quantized": torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8),
                "subclass": TwoTensor(torch.randn(3), torch.randn(3)),
                "nested": torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged),
                "nested_strided": torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)]),
                "sparse_int": torch.eye(3, dtype=torch.int64).to_sparse_csr()}[kind]


def _train_recommender(out=None, kind="none", sync="layer") -> list[float]:
    torch.manual_seed(0)
    idx, y = torch.arange(10), torch.randint(0, 3, (10,))
    adj = ((torch.rand(10, 10) < 0.3).float() + torch.eye(10)).to_sparse()
    extra = _extra(kind)
    model = Recommender()
    sparse_opt = torch.optim.SparseAdam(list(model.emb.parameters()), lr=0.01)
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    losses = []
    watch = convcheck.watch(model, optimizers=[sparse_opt, opt], out=out, sync=sync, snapshot_steps=[0, 1]) \
        if out else contextlib.nullcontext()
    with watch:
        for _ in range(3):
            sparse_opt.zero_grad()
            opt.zero_grad()
            loss = F.cross_entropy(model(idx, adj, extra), y)
            loss.backward()
            sparse_opt.step()
            opt.step()
            losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind", ["none", "meta", "quantized", "subclass", "nested", "nested_strided", "sparse_int"])
@pytest.mark.parametrize("sync", ["layer", "step"])
def test_other_layouts_and_sparse_gradients_train_as_without_the_watch(tmp_path, kind, sync):
    assert _train_recommender(tmp_path / "a", kind, sync) == _train_recommender(kind=kind)
    run = open_watched(tmp_path / "a")
    assert len(run.steps) == 3 and run["watch_error"] is None
    assert run.steps[0]["grad_norms"]["emb.weight"] > 0  # a sparse gradient's norm: its values'
    assert run.steps[0]["layers"]["scale"]["n"] > 0  # a sparse output's statistics: its values'
    assert "grad/emb.weight: a sparse_coo tensor (not kept)" in run["snapshots"][0]["not_stored"]
    _train_recommender(tmp_path / "b", kind, sync)
    assert diff_watched(tmp_path / "a", tmp_path / "b").verdict.category == "ok"


def test_two_optimizers_snapshot_each_gradient_once(tmp_path):
    """Each optimizer's step read every gradient again: a snapshot listed them twice and diff refused the run."""
    _train_recommender(tmp_path / "a")
    keys = [a["key"] for a in json.loads((tmp_path / "a" / "manifest.json").read_text())["snapshots"][0]["arrays"]]
    assert len(keys) == len(set(keys)) and "grad/head.weight" in keys
