"""The table of run_all.sh: one row per diffed pair (truth, verdict category and headline, right category, whether the
headline names the planted cause - read by hand, from judgement.tsv - and each run's loss range: mean of its first /
last 5 recorded steps, min..max). Usage: report.py RUNS_DIR [JUDGEMENT_TSV]"""
import json
import math
import os
import sys

runs = sys.argv[1]
judge_path = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(runs.rstrip("/")), "judgement.tsv")
judged = {}
if os.path.exists(judge_path):
    for line in open(judge_path):
        if line.strip() and not line.startswith("#"):
            s, name, named = line.rstrip("\n").split("\t")[:3]
            judged[(s, name)] = named


def losses(path):
    try:
        ls = [json.loads(line).get("loss") for line in open(os.path.join(path, "steps.jsonl"))]
    except OSError:
        return "no run"
    ls = [x for x in ls if isinstance(x, (int, float))]
    if not ls:
        return "no loss"
    fin = [x for x in ls if math.isfinite(x)]
    head, tail = sum(ls[:5]) / len(ls[:5]), sum(ls[-5:]) / len(ls[-5:])
    rng = f", min {min(fin):.4g} max {max(fin):.4g}" if fin else ""
    return f"{len(ls)} steps, {head:.4g} -> {tail:.4g}{rng}" + ("" if len(fin) == len(ls) else
                                                                 f" ({len(ls) - len(fin)} non-finite)")


rows = []
for line in open(os.path.join(runs, "pairs.tsv")):
    s, name, a, b, rc, truth = line.rstrip("\n").split("\t")
    try:
        v = json.load(open(os.path.join(runs, s, f"{name}.json")))["verdict"]
        cat, head = v["category"], " ".join(v["headline"].split())
    except (OSError, ValueError, KeyError, TypeError):
        err = open(os.path.join(runs, s, f"{name}.err")).read().strip().splitlines()
        cat, head = "(error)", (err[-1] if err else f"exit {rc}")
    want = truth.split(":")[0]
    named = judged.get((s, name), "-" if want == "ok" else "?")
    rows.append((s, name, truth, cat, "yes" if cat == want else "NO", named, head,
                 f"{a}: {losses(os.path.join(runs, s, a))}; {b}: {losses(os.path.join(runs, s, b))}"))

md = ["| script | pair | truth | verdict | right category | names the cause | headline | runs (steps, loss first5 -> last5 mean, range) |",
      "|---|---|---|---|---|---|---|---|"]
md += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
healthy = [r for r in rows if r[2].startswith("ok")]
faults = [r for r in rows if not r[2].startswith("ok")]
md.append("")
md.append(f"Healthy pairs ok: {sum(r[4] == 'yes' for r in healthy)} of {len(healthy)}. "
          f"Faults in the right category: {sum(r[4] == 'yes' for r in faults)} of {len(faults)}; "
          f"naming the cause: {sum(r[5] == 'yes' for r in faults)} of {len(faults)}.")
open(os.path.join(runs, "results.md"), "w").write("\n".join(md) + "\n")
for r in rows:
    print(f"{r[0]:<25} {r[1]:<5} truth={r[2].split(':')[0]:<6} verdict={r[3]:<15} right={r[4]:<3} named={r[5]:<8} {r[6]}")
    print(f"{'':<31}{r[7]}")
print(md[-1])
