"""What the watch records of the run's *recipe*: what a person would call the way the model is trained, whole
and structured, so that ``diff`` compares two runs' recipes field by field before any tensor.

As the block starts (``recipe_of``): every parameter group's hyperparameters with the names of the parameters in
it, the parameters that train (``requires_grad``) and those no optimizer group holds, the dtypes the weights are
kept in, the wrapper the model came in. At each step's first forward (``forward_state``): the autocast dtype the
forward ran under, if any, and the leaves whose training mode is not the model's (a BatchNorm frozen in eval
mode). After each backward (``grad_sample``): a few fixed entries of every parameter's gradient, so that ``diff``
can tell gradients that accumulate across steps (no ``zero_grad``) from gradients that merely differ.

Names are the watch's: the user's layer names, wrappers' parts taken out (``attach.user_name``).
"""

from __future__ import annotations

import torch

from convcheck.numerics.formats import coarsest_dtype
from convcheck.watch.layouts import dense
from convcheck.watch.settings import optimizer_settings

SAMPLES = 4  # gradient entries kept per parameter per step (evenly spaced, the same indices every step)
WEIGHT_NORM = "(weights)"  # the key in ``grad_sample`` that holds the global norm of the weights at the step's start


def recipe_of(w) -> dict:
    """The recipe of the ``Watch`` ``w`` as its block starts (see the module's docstring), in the watch's own names
    of the parameters (the user's, wrappers' parts taken out: ``attach.user_name``); every optimizer's groups."""
    names = {id(p): n for n, p in w.params}
    groups, held = [], set()
    optimizers = list(getattr(w, "optimizers", None) or ([w.optimizer] if w.optimizer is not None else []))
    for opt in optimizers:
        for g, s in zip(opt.param_groups, optimizer_settings(opt) or []):
            members = [names[id(p)] for p in g["params"] if id(p) in names]
            held.update(id(p) for p in g["params"])
            groups.append({"parameters": members, "settings": s})
    return {"optimizer": type(optimizers[0]).__name__ if optimizers else None,
            "optimizers": [type(o).__name__ for o in optimizers],
            "parameters": [n for n, _ in w.params],
            "param_groups": groups, "trainable": [n for n, p in w.params if p.requires_grad],
            "not_in_optimizer": [] if not optimizers else
            [n for n, p in w.params if p.requires_grad and id(p) not in held],
            "weights_dtypes": sorted({str(p.dtype).removeprefix("torch.") for _, p in w.params}),
            "wrappers": [x for x in (getattr(w, "wrapper", None),
                                     type(w.outer).__name__ if w.outer is not w.model else None) if x]}


def forward_state(model: torch.nn.Module, names: dict, device: str, params=None) -> dict:
    """The state a step's forward ran in: the autocast dtype (None without autocast) and the modules whose
    training mode differs from the model's (sorted names). ``params``: the model's parameters as ``(name, p)``
    pairs, listed already (``model.parameters()`` walks the module tree: 0.2 ms a step on a small CNN)."""
    kind = device.split(":")[0]
    try:
        autocast = str(torch.get_autocast_dtype(kind)).removeprefix("torch.") \
            if torch.is_autocast_enabled(kind) else None
    except (RuntimeError, TypeError, AttributeError):  # a device type autocast does not know
        autocast = None
    odd = sorted(names[m] for m in names if m is not model and m.training != model.training)
    state = {"autocast": autocast, "modes_differ": odd}
    if any(p.dim() == 4 and not p.is_contiguous() and p.is_contiguous(memory_format=torch.channels_last)
           for p in (model.parameters() if params is None else (p for _, p in params))):
        state["memory_format"] = "channels_last"  # other conv kernels: rounding-level differences, as threads
    return state


def sample_parts(params) -> tuple[list[str], list[int], torch.Tensor | None]:
    """``(names, sizes, values)``: ``SAMPLES`` evenly spaced entries of every parameter's gradient (flattened), as
    one float64 tensor on the gradients' device (read now by ``grad_sample``, or with a deferred step's buffer)."""
    picked, keys = [], []
    for n, p in params:
        g = p.grad
        if g is None or not dense(g) or not g.numel():  # a sparse gradient (Embedding(sparse=True)): not sampled
            continue
        flat = g.detach().reshape(-1)
        stride = max(1, flat.numel() // SAMPLES)
        picked.append(flat[::stride][:SAMPLES].double())
        keys.append(n)
    weights = weight_norm(params)
    if weights is not None:  # the weights' global norm rides along: a loss that rises while they blow up diverges
        picked.append(weights.reshape(1).to(picked[0].device if picked else weights.device))
        keys.append(WEIGHT_NORM)
    if not picked:
        return [], [], None
    return keys, [t.numel() for t in picked], torch.cat([t.to(picked[0].device) for t in picked])


def weight_norm(params) -> torch.Tensor | None:
    """The global L2 norm of every parameter (float64, on the parameters' device): one ``_foreach_norm`` per dtype."""
    by: dict = {}
    for _, p in params:
        if p.is_floating_point() and p.numel() and not p.is_sparse:
            by.setdefault((p.dtype, p.device), []).append(p.detach())
    if not by:
        return None
    parts = [torch.stack(torch._foreach_norm(ts)).double() for ts in by.values()]
    device = parts[0].device
    return torch.linalg.vector_norm(torch.cat([t.to(device) for t in parts]))


def samples_of(keys: list[str], sizes: list[int], values: list[float]) -> dict[str, list[float]]:
    out, i = {}, 0
    for n, k in zip(keys, sizes):
        out[n] = values[i:i + k]
        i += k
    return out


def grad_sample(params) -> dict[str, list[float]]:
    """Every parameter's sampled gradient entries (``sample_parts``), read in one transfer; where every gradient is a
    contiguous float32/float64 CPU tensor, picked through numpy views (the same entries and values, without four
    torch dispatches a parameter: ~0.5 ms a step on cifar_cnn)."""
    picked = _cpu_samples(params)
    if picked is not None:
        weights = weight_norm(params)
        if weights is not None:
            picked[WEIGHT_NORM] = [float(weights)]
        return picked
    keys, sizes, t = sample_parts(params)
    return {} if t is None else samples_of(keys, sizes, t.tolist())


def _cpu_samples(params) -> dict[str, list[float]] | None:
    """``sample_parts``' entries of every gradient read through numpy, or None where one is not a plain contiguous
    float32/float64 CPU tensor (``sample_parts`` reads them all then)."""
    out = {}
    for n, p in params:
        g = p.grad
        if g is None or not dense(g) or not g.numel():
            continue
        if g.device.type != "cpu" or g.dtype not in (torch.float32, torch.float64) or type(g) is not torch.Tensor \
                or not g.is_contiguous() or g.is_neg():
            return None
        flat = g.detach().numpy().reshape(-1)
        out[n] = flat[::max(1, flat.size // SAMPLES)][:SAMPLES].tolist()
    return out


LOSS_GRAPH_NODES = 256  # the most autograd nodes ``loss_dtype`` reads between the loss and the model's output



def loss_dtype(loss, stop=()) -> str | None:
    """The coarsest floating dtype the step's loss was computed in: the loss tensor's own, and every op's between
    it and the model's output (``stop``: its autograd nodes), read from the graph's input metadata, which outlives
    the backward (``nll(torch.log(torch.softmax(logits.half())).float())`` is float16). None for a number."""
    if not isinstance(loss, torch.Tensor):
        return None
    seen, found = set(), {loss.dtype}
    todo = [loss.grad_fn] if loss.grad_fn is not None else []
    stop = {id(n) for n in stop}
    while todo and len(seen) < LOSS_GRAPH_NODES:
        node = todo.pop()
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen.add(id(node))
        for m in getattr(node, "_input_metadata", ()) or ():
            if getattr(m, "dtype", None) is not None and m.dtype.is_floating_point:
                found.add(m.dtype)
        todo.extend(n for n, _ in getattr(node, "next_functions", ()) if n is not None)
    return coarsest_dtype(str(d).removeprefix("torch.") for d in found if d.is_floating_point)


def criterion_of(module: torch.nn.Module) -> dict | None:
    """A loss module's class and settings (``nn.CrossEntropyLoss(label_smoothing=0.1)``: its reduction, label
    smoothing, ignore index, a class weight of up to 16 entries...), None for any other module."""
    if not isinstance(module, torch.nn.modules.loss._Loss):
        return None
    settings = {k: v for k, v in vars(module).items()
                if not k.startswith("_") and k != "training" and isinstance(v, (bool, int, float, str))}
    for k, t in module.named_buffers():
        if t is not None and t.numel() <= 16:
            settings[k] = [round(float(x), 6) for x in t.detach().reshape(-1).tolist()]
        elif t is not None:
            settings[k] = f"{t.numel()} values"
    return {"class": type(module).__name__, "settings": settings}
