"""A synthetic Cora in Cora's file format (cora/cora.content: id, binary word features, class name; cora/cora.cites:
cited id, citing id), packed as cora.tgz for the gcn example: V nodes in 7 classes, F words, each class with its own
likelier words, edges mostly within a class (homophily), seeded. Usage: python make_cora.py OUT.tgz [V] [F]"""
import io
import sys
import tarfile

import numpy as np

out = sys.argv[1]
V = int(sys.argv[2]) if len(sys.argv) > 2 else 1700
F = int(sys.argv[3]) if len(sys.argv) > 3 else 200
rng = np.random.default_rng(0)
classes = ["Case_Based", "Genetic_Algorithms", "Neural_Networks", "Probabilistic_Methods",
           "Reinforcement_Learning", "Rule_Learning", "Theory"]
y = rng.integers(0, len(classes), V)
ids = rng.choice(np.arange(1, 10 ** 6), V, replace=False)
pref = rng.random((len(classes), F)) < 0.08          # each class's likelier words
p = np.where(pref[y], 0.25, 0.02)
x = (rng.random((V, F)) < p).astype(int)
x[x.sum(1) == 0, 0] = 1
content = "\n".join(f"{ids[i]}\t" + "\t".join(map(str, x[i])) + f"\t{classes[y[i]]}" for i in range(V)) + "\n"
edges = set()
while len(edges) < 2 * V:
    a = int(rng.integers(V))
    same = np.flatnonzero(y == y[a]) if rng.random() < 0.8 else np.arange(V)
    b = int(rng.choice(same))
    if a != b:
        edges.add((a, b))
cites = "\n".join(f"{ids[a]}\t{ids[b]}" for a, b in sorted(edges)) + "\n"
with tarfile.open(out, "w:gz") as tar:
    for name, text in (("cora/cora.content", content), ("cora/cora.cites", cites)):
        data = text.encode()
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
