"""The bundle format ``convcheck.bundle/2`` and its limits (no torch import).

A bundle is a directory, or one ``.zip`` of that directory's files::

    manifest.json            every scalar: model spec, config, target, judge, versions, env fingerprint,
                             SHA-256 of the source file, the initial weights and every batch, the parity
                             rows, per-step curves, and an index of the arrays below
    forward/NNNNN.npz        one leaf call's forward output of the parity step (array ``a``)
    grads/NNNNN.npz          one parameter's gradient of the parity step (array ``a``), loss scale removed
    snapshots/step_NNNNN.npz the parameters after N training steps (arrays ``p00000``... in the
                             order ``manifest["arrays"]["parameters"]`` names)

Each array file's SHA-256 is in its index entry (``sha256``; bundles written before it have none and
are still read); the reader checks it, and checks the contents against the manifest's rows: an array is
finite where its parity row counts no NaN/Inf, a snapshot where training kept the weights finite, each
parity row's ``flagged`` is what its own numbers give, and a non-finite loss is marked ``nonfinite_loss``.

Arrays are plain ``.npz`` (``np.savez``, uncompressed), read with ``allow_pickle=False``. A float64
array is stored as float64; every other floating dtype (float32, bfloat16, float16) as float32,
which holds it exactly; ``dtype`` in the index is the dtype the run had.

Versions: ``/2`` adds ``training.nonfinite_detail`` (per arm, what made its first NaN/Inf: ``callable``
(module, loss, optimizer, schedule), the ``op`` of user code and its float64 ``magnitude``, the
optimizer's name and eps; ``DETAIL_KINDS``), required there; a ``/1`` bundle is still read, without it.
"""

from __future__ import annotations

SCHEMA = "convcheck.bundle/2"
READABLE = ("convcheck.bundle/1", SCHEMA)  # the recorded-run versions this convcheck reads
# A watched run (``convcheck.watch``, issue 25): another kind of bundle, versioned on its own; its files
# are described in ``convcheck/runformat/layout.py``. ``convcheck diff`` tells the two kinds by this field.
WATCH_SCHEMA = "convcheck.watch/1"
# ``convcheck diff`` of watched runs, as ``--json`` prints it and ``watch_diff.json`` / ``watch_judge.json`` hold it
# (1: the pair, the single run against the judge, the ranked DDP diff; own_findings, pair_findings)
WATCH_DIFF_SCHEMA = "convcheck.watch-diff/1"
SCHEMAS = {**{s: "recorded" for s in READABLE}, WATCH_SCHEMA: "watched"}
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 * 1024 * 1024  # curves and parity rows of a large model are a few MB
MAX_TOTAL_BYTES = 16 * 1024**3  # what a bundle's index may claim in all
MAX_MEMBERS = 200_000
NPZ_SLACK = 4096  # npy header and zip directory around one array
STORAGE = {"float64": "float64", "float32": "float32", "bfloat16": "float32", "float16": "float32"}
ARRAY_GROUPS = ("forward", "grads", "snapshots")


def storage_dtype(dtype: str) -> str:
    """The numpy dtype an array of torch dtype ``dtype`` ('float32', 'bfloat16'...) is stored as."""
    return STORAGE[dtype]

# ``training.nonfinite_detail``'s known keys and the JSON kinds each may hold (other keys: a scalar)
_NUMBER = (int, float)
DETAIL_KINDS = {"callable": str, "op": str, "magnitude": _NUMBER, "operand_absmin": _NUMBER,
                "float64_magnitude": _NUMBER, "float64_operand_absmin": _NUMBER, "lr": _NUMBER,
                "gradients_finite": bool, "optimizer": str, "eps": (*_NUMBER, type(None)), "loss": str}
CALLABLES = ("module", "loss", "optimizer", "schedule")
