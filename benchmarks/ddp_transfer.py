"""The price of getting rank 0's parameters to the parent, per DDP training step (issue 12, item 4).

    python benchmarks/ddp_transfer.py lenet cifar_cnn resnet18 resnet50

One forked child holds the model, as rank 0 does. Per step, the old way: its ``state_dict`` cloned and
sent through a ``torch.multiprocessing`` pipe (each tensor moved to a new shared-memory segment and
its handle passed), then copied into the parent's mirror; the new way (``convcheck.ddp.arm``): the
child copies its parameters into shared tensors the parent allocated once, answers ``None``, and the
parent copies them into the mirror. Prints the median per-step time of each (40 steps each,
interleaved in two rounds, so a busy machine affects both alike).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.multiprocessing as tmp

from reference_models import get_spec


def _child(conn, name: str, shared: dict) -> None:
    torch.set_num_threads(1)
    model = get_spec(name).factory()
    while True:
        cmd = conn.recv()
        if cmd == "stop":
            return
        if cmd == "old":
            conn.send({k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
            continue
        with torch.no_grad():
            for n, p in model.named_parameters():
                shared[n].copy_(p)
        conn.send(None)


def measure(name: str, steps: int = 20) -> dict:
    torch.set_num_threads(1)
    mirror = get_spec(name).factory()
    shared = {n: torch.empty(p.shape, dtype=p.dtype).share_memory_() for n, p in mirror.named_parameters()}
    ctx = tmp.get_context("fork")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=_child, args=(theirs, name, shared))
    child.start()
    times: dict[str, list[float]] = {"old": [], "new": []}
    for way in ("old", "new", "old", "new"):
        for _ in range(steps):
            t0 = time.perf_counter()
            mine.send(way)
            answer = mine.recv()
            with torch.no_grad():
                if way == "old":
                    for k, v in mirror.state_dict().items():
                        v.copy_(answer[k])
                else:
                    for n, p in mirror.named_parameters():
                        p.copy_(shared[n])
            times[way].append(time.perf_counter() - t0)
    mine.send("stop")
    child.join()
    params = sum(p.numel() for p in mirror.parameters())
    return {"model": name, "params": params, "old_ms": 1e3 * statistics.median(times["old"]),
            "new_ms": 1e3 * statistics.median(times["new"]), "steps_each": len(times["old"])}


if __name__ == "__main__":
    for model_name in sys.argv[1:] or ["lenet"]:
        r = measure(model_name)
        print(f"{r['model']} ({r['params'] / 1e6:.2f}M parameters): per step, median of {r['steps_each']}: "
              f"state through the pipe {r['old_ms']:.2f} ms, shared memory {r['new_ms']:.2f} ms")
