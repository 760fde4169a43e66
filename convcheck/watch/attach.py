"""The watch's hooks attached to nothing the user's objects carry (issue 45).

A hook registered on a module lives in its ``_forward_hooks`` (an ``OrderedDict`` in the module's ``__dict__``):
``torch.save(model)``, ``pickle``, ``copy.deepcopy`` and ``AveragedModel(model)`` copy it, and a bound method of
the ``Watch`` drags the whole watch (its open file, its SHA-256 object) into the copy - they raised
``PicklingError`` / ``cannot pickle '_hashlib.HASH'`` inside the block, and a copy made there was watched twice.

Here the watch registers process-wide hooks instead (``torch.nn.modules.module.register_module_forward_pre_hook``,
``register_module_forward_hook``, ``torch.optim.optimizer.register_optimizer_step_pre_hook``/``_post_hook``), one
set for all the watches open, each dispatching by identity to the watch that holds the module or optimizer
called: nothing is added to a module's or an optimizer's ``__dict__``, so a pickle, a deep copy or an
``AveragedModel`` of the model is exactly what it is without the watch, loads where convcheck is not installed,
and a copy (another object) is never recorded. Every other module and optimizer of the process pays one dict
lookup per call. The hooks are removed when the last watch closes.

Every call into a watch is guarded: an exception in convcheck's own code stops that watch's recording
(``Watch.fail``: said in its manifest and on stderr) and the user's call goes on as without the watch. The
module's own forward and the optimizer's step run outside these hooks, so the user's exceptions are theirs.

Order: a global hook runs before a module's own hooks, so the watch sees a layer's output before a hook of the
user's that replaces it. Under dynamo (``torch.compile``) a layer's dispatch returns at once (nothing of the watch
is traced into a graph); a root's runs eagerly at the graph's edge (``compiled.outside_graphs``).

``user_name``: a module or parameter name with the wrappers' prefixes taken out (``module.`` of DataParallel /
DistributedDataParallel at the front, ``_orig_mod.`` of ``torch.compile``, ``_fsdp_wrapped_module.`` of FSDP,
``_checkpoint_wrapped_module.`` of activation checkpointing), so a wrapped run names its layers as an unwrapped
one does.
"""

from __future__ import annotations

import warnings

import torch
from torch.nn.modules import module as _module
from torch.optim import optimizer as _optimizer

from convcheck.watch import functional_losses
from convcheck.watch.compiled import outside_graphs

# id(object) -> (object, [watches]): the object held (the watch holds it anyway while open), checked by identity
_ROOTS: dict[int, tuple] = {}
_LAYERS: dict[int, tuple] = {}
_OPTIMIZERS: dict[int, tuple] = {}
_ROOT_IDS: frozenset = frozenset()  # what dynamo reads of the roots (a constant it can guard on)
_WATCHES: list = []  # the watches open, innermost last (``current``)
_HANDLES: list = []
_SEEN_OPTIMIZERS: dict[int, object] = {}  # optimizers met stepping that are not the watches' (found once each)
# how deep in module calls the process is: the output of an outermost call of a module no watch holds (a GAN's
# generator when the discriminator is watched) is made by the process, not data (``Watch.made_elsewhere``)
_DEPTH = [0]
_OUTERMOST: list = [None]  # the module of the outermost call now running (a loss function called inside it is its)

# a warning OptimizedModule gives on every call while any global module hook exists; the watch's are invisible
_GLOBAL_HOOK_WARNING = r"Using `torch.compile\(module\)` when there are global hooks"

WRAPPER_PARTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
PARALLEL = ("DataParallel", "DistributedDataParallel")


def user_name(name: str, parallel: bool = False, wrappers: frozenset = frozenset()) -> str:
    """``name`` as the user's model names it: the wrappers' parts taken out; ``module`` only where it is a
    DataParallel/DDP's child - at the front with ``parallel``, or after a prefix in ``wrappers`` (``parallel_prefixes``:
    a user's own child may be called ``module``)."""
    given = name.split(".")
    parts = []
    for i, p in enumerate(given):
        if p in WRAPPER_PARTS or p == "module" and (i == 0 and parallel or ".".join(given[:i]) in wrappers):
            continue
        parts.append(p)
    return ".".join(parts)


def parallel_prefixes(model) -> frozenset:
    """The names of ``model``'s DataParallel/DDP children (their ``module`` child is the user's model)."""
    return frozenset(n for n, m in model.named_modules()
                     if n and any(c.__name__ in PARALLEL for c in type(m).__mro__))


def outermost() -> None:
    """A step's end: no module call is running (one that raised left the count above 0)."""
    _DEPTH[0] = 0
    _OUTERMOST[0] = None


def current():
    """The innermost ``convcheck.watch`` block open in this process (None outside every block): ``w.step(loss)``
    reachable from the user's functions without passing ``w`` down."""
    return _WATCHES[-1] if _WATCHES else None


def _add(table: dict, obj, w) -> None:
    entry = table.get(id(obj))
    if entry is None or entry[0] is not obj:
        table[id(obj)] = (obj, [w])
    elif w not in entry[1]:
        entry[1].append(w)


def _drop(table: dict, w) -> None:
    for key, (obj, ws) in list(table.items()):
        if w in ws:
            ws.remove(w)
        if not ws:
            del table[key]


def _watches(table: dict, obj) -> list:
    entry = table.get(id(obj))
    return entry[1] if entry is not None and entry[0] is obj else ()


def attach(w, roots, layers, optimizers) -> "Attached":
    """Route the calls of ``roots`` (the root hooks: ``w._root_pre``, ``w._root_forward``), ``layers``
    (``w._forward``) and the steps of ``optimizers`` (``w._pre_step``, ``w._post_step``) to ``w``."""
    global _ROOT_IDS
    for m in roots:
        _add(_ROOTS, m, w)
    for m in layers:
        _add(_LAYERS, m, w)
    for o in optimizers:
        _add(_OPTIMIZERS, o, w)
    _ROOT_IDS = frozenset(_ROOTS)
    _WATCHES.append(w)
    if not _HANDLES:
        _HANDLES.append(_module.register_module_forward_pre_hook(_pre))
        _HANDLES.append(_module.register_module_forward_hook(_post, with_kwargs=True))
        _HANDLES.append(_optimizer.register_optimizer_step_pre_hook(_opt_pre))
        _HANDLES.append(_optimizer.register_optimizer_step_post_hook(_opt_post))
        warnings.filterwarnings("ignore", message=_GLOBAL_HOOK_WARNING)
        functional_losses.install(_functional_loss)
    return Attached(w)


def _functional_loss(name: str, bound) -> None:
    """A loss function of ``torch.nn.functional`` called (``functional_losses``): each open watch records it when
    no module's call is running, or when the outermost one is the user's own code - neither a watched model (whose
    labels, when it computes its loss, are among its inputs) nor a loss module (whose call is recorded whole)."""
    if _DEPTH[0]:
        outer = _OUTERMOST[0]
        if outer is None or id(outer) in _ROOT_IDS or isinstance(outer, torch.nn.modules.loss._Loss) \
                or _watches(_LAYERS, outer):
            return
    for w in list(_WATCHES):
        try:
            w.functional_loss(name, bound)
        except Exception as error:  # noqa: BLE001 - as ``_root_pre_eager``
            w.fail(error, f"F.{name}")


def add_optimizer(w, optimizer) -> None:
    """An optimizer found stepping the watched parameters after the block opened: routed to ``w`` from now on."""
    _add(_OPTIMIZERS, optimizer, w)


class Attached:
    """The handle ``attach`` returns: ``remove()`` routes nothing more to the watch (the hooks go with the last);
    ``detach()`` the same from inside a hook (``Watch.fail``), torch's hooks left in place until ``remove``: an
    optimizer iterates its global hooks' dict while it calls them, and one removed then would raise in the loop."""

    def __init__(self, w):
        self.w = w

    def detach(self) -> None:
        global _ROOT_IDS
        w = self.w
        if w is None:
            return
        for table in (_ROOTS, _LAYERS, _OPTIMIZERS):
            _drop(table, w)
        _ROOT_IDS = frozenset(_ROOTS)
        if w in _WATCHES:
            _WATCHES.remove(w)

    def remove(self) -> None:
        if self.w is None:
            return
        self.detach()
        self.w = None
        if not _WATCHES:
            for h in _HANDLES:
                h.remove()
                # torch's handle leaves its id in the with_kwargs table (which makes ``_has_any_global_hook`` true
                # for good: every OptimizedModule call would warn after the block)
                getattr(_module, "_global_forward_hooks_with_kwargs", {}).pop(h.id, None)
            _HANDLES.clear()
            _SEEN_OPTIMIZERS.clear()
            _OUTERMOST[0] = None
            functional_losses.uninstall()
            warnings.filters[:] = [f for f in warnings.filters
                                   if not (f[1] is not None and f[1].pattern == _GLOBAL_HOOK_WARNING)]


# --- the process-wide hooks -------------------------------------------------------------------------------
_exporting = getattr(torch.compiler, "is_exporting", lambda: False)

@outside_graphs
def _root_pre_eager(module, args):
    for w in list(_watches(_ROOTS, module)):
        try:
            w._root_pre(module, args)
        except Exception as error:  # noqa: BLE001 - the watch's own: it stops recording, the loop goes on
            w.fail(error, f"the forward pre-hook of {type(module).__name__}")


@outside_graphs
def _root_post_eager(module, args, kwargs, output):
    for w in list(_watches(_ROOTS, module)):
        try:
            w._root_forward(module, args, kwargs, output)
        except Exception as error:  # noqa: BLE001 - as ``_root_pre_eager``
            w.fail(error, f"the forward hook of {type(module).__name__}")


def _pre(module, args):
    compiling = torch.compiler.is_compiling()
    if compiling:
        if _exporting():  # torch.export: fake tensors, no graph break allowed - the watch stays out of it
            return None
    elif torch._C._get_tracing_state():  # torch.jit.trace: nothing of the watch is traced
        return None
    if id(module) in _ROOT_IDS:
        _root_pre_eager(module, args)
    if not compiling:
        if _DEPTH[0] == 0:
            _OUTERMOST[0] = module
        _DEPTH[0] += 1
    return None


def _post(module, args, kwargs, output):
    compiling = torch.compiler.is_compiling()  # read once: every module call of the process pays this hook
    if compiling:
        if _exporting():  # torch.export: fake tensors, no graph break allowed - the watch stays out of it
            return None
    elif torch._C._get_tracing_state():  # torch.jit.trace: nothing of the watch is traced
        return None
    if id(module) in _ROOT_IDS:
        _root_post_eager(module, args, kwargs, output)
    if compiling:  # a layer inside a compiled graph: nothing of the watch is traced into it
        return None
    _DEPTH[0] = max(_DEPTH[0] - 1, 0)
    if _DEPTH[0] == 0:
        _OUTERMOST[0] = None
    if _DEPTH[0] == 0 and id(module) not in _ROOT_IDS:
        for w in list(_WATCHES):
            try:
                w.made_elsewhere(module, args, kwargs, output)
            except Exception as error:  # noqa: BLE001 - as ``_root_pre_eager``
                w.fail(error, f"the forward hook of {type(module).__name__}")
    entry = _LAYERS.get(id(module))
    if entry is not None and entry[0] is module:
        for w in list(entry[1]):
            try:
                w._forward(module, args, output, kwargs)
            except Exception as error:  # noqa: BLE001 - as ``_root_pre_eager``
                w.fail(error, f"the forward hook of {type(module).__name__}")
    return None


def _skip_frames(*fns) -> None:
    """Dynamo never converts these functions as frames of their own (a compiled module's hooks are called as
    separate frames under its dynamo context: an empty frame each, counted); traced inline, they still return at
    once for a layer and break only at a root, as above."""
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:  # an older torch: its frames are converted, to nothing
        return
    for fn in fns:
        skip_code(fn.__code__)


_skip_frames(_pre, _post)


def _opt_pre(optimizer, args, kwargs):
    ws = _watches(_OPTIMIZERS, optimizer) or _adopt(optimizer)
    for w in list(ws):
        try:
            w._pre_step(optimizer, args, kwargs)
        except Exception as error:  # noqa: BLE001 - as ``_opt_post``
            w.fail(error, f"{type(optimizer).__name__}.step's pre-hook")
    return None


def _opt_post(optimizer, args, kwargs):
    for w in list(_watches(_OPTIMIZERS, optimizer)):
        try:
            w._post_step(optimizer, args, kwargs)
        except Exception as error:  # noqa: BLE001 - the watch's own: it stops recording, the loop goes on
            w.fail(error, f"{type(optimizer).__name__}.step's post-hook")
    return None


def _adopt(optimizer) -> list:
    """An optimizer none of the watches was given, met at its first step: each open watch whose parameters it
    holds (an optimizer made inside the block, or one not passed) takes it (``Watch.found_optimizer``)."""
    key = id(optimizer)
    if _SEEN_OPTIMIZERS.get(key) is optimizer:
        return ()
    _SEEN_OPTIMIZERS[key] = optimizer
    held = {id(p) for group in getattr(optimizer, "param_groups", ()) for p in group.get("params", ())}
    for w in list(_WATCHES):
        try:
            if held & w.param_ids and w.found_optimizer(optimizer):
                _add(_OPTIMIZERS, optimizer, w)
        except Exception as error:  # noqa: BLE001 - as ``_opt_post``
            w.fail(error, f"{type(optimizer).__name__}.step's pre-hook")
    return _watches(_OPTIMIZERS, optimizer)
