"""What a failure means: one exit code and one line, decided in one place.

Exit codes (``convcheck --help`` and the README list them):

====  ==========================================================================
0     ok
1     a discrepancy (or a critical environment finding) was diagnosed
2     usage or input error, including the user's model, loss or data failing
3     resource: out of memory (CPU or GPU), disk full, interrupted (Ctrl-C, SIGTERM, SIGHUP)
4     internal error: a bug in convcheck (traceback plus a request to report it)
5     inconclusive: the float64 judge checked less than the layers the verdict rests on (``diff RUN --judge``)
====  ==========================================================================

Whose code failed is read from the traceback: the innermost frame that is
neither the standard library nor a package convcheck itself calls (torch,
numpy, pandas, matplotlib, ...). If that frame is in convcheck (or its
reference models) the failure is convcheck's own (4); otherwise it is the
user's code, or a package only their code reaches (timm, torchvision), and the
failure is exit 2, reported in one line naming the layer, function, file,
line, exception type and message, and the stage of the run.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import sys
import sysconfig
import traceback
from dataclasses import dataclass
from pathlib import Path

from convcheck.errors import ConvcheckError, RunFailed, UserCodeError

EXIT_OK, EXIT_DISCREPANCY, EXIT_USAGE, EXIT_RESOURCE, EXIT_INTERNAL, EXIT_INCONCLUSIVE = 0, 1, 2, 3, 4, 5

EXIT_CODES = (
    (EXIT_OK, "ok: the targets agree, or an environment audit found nothing critical"),
    (EXIT_DISCREPANCY, "a discrepancy was diagnosed (or a critical environment finding)"),
    (EXIT_USAGE, "usage or input error, including your model, loss or data failing (one line; --debug for "
                 "the traceback)"),
    (EXIT_RESOURCE, "out of memory (CPU or GPU), disk full, or interrupted (Ctrl-C, SIGTERM, SIGHUP)"),
    (EXIT_INTERNAL, "internal error: a bug in convcheck (traceback, please report it)"),
    (EXIT_INCONCLUSIVE, "inconclusive: the float64 judge could not check the layers the verdict rests on (it says "
                        "which and why; never ok on a judge that replayed nothing)"),
)


def verdict_exit(category: str | None) -> int:
    """The exit code of a verdict's category: 0 ok, 5 inconclusive, 1 any finding."""
    return {"ok": EXIT_OK, "inconclusive": EXIT_INCONCLUSIVE}.get(category, EXIT_DISCREPANCY)

_OOM_TEXTS = ("out of memory", "can't allocate memory", "cannot allocate memory", "failed to allocate memory")
_DISK_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_MAX_MESSAGE = 300

_PACKAGE_ROOTS = tuple(
    str(Path(p).resolve()) + os.sep
    for p in (Path(__file__).parent, Path(__file__).parent.parent / "reference_models")
)
_STDLIB_ROOTS = tuple(
    str(Path(p).resolve()) + os.sep
    for p in {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib")} if p
)
# The packages convcheck itself calls (and the test harness): a frame in them is neither convcheck's
# own code nor the user's. Any other installed package (timm, torchvision, transformers) is reached only
# through the user's model, loss or data, so its frames count as the user's side.
_LIBRARY_MODULES = {"torch", "numpy", "pandas", "matplotlib", "PIL", "rich", "pygments", "markdown_it", "pynvml",
                    "sklearn", "scipy", "tomli", "typing_extensions", "functorch", "triton", "_pytest", "pytest",
                    "pluggy", "hypothesis", "importlib"}


class Interrupted(KeyboardInterrupt):
    """A stop signal other than Ctrl-C (SIGTERM from ``timeout``, docker, Slurm, Kubernetes; SIGHUP when the
    terminal closes), handled as Ctrl-C is: exit 3, what is known kept, empty folders removed."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


@dataclass(frozen=True)
class Failure:
    code: int
    line: str  # one line, without the "convcheck: " prefix
    internal: bool = False


def resource_reason(exc: BaseException) -> str | None:
    """Why ``exc`` is the machine's limit (memory, disk, interrupt), or None when it is not."""
    if isinstance(exc, Interrupted):
        return f"interrupted ({exc.signal_name})"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    if isinstance(exc, MemoryError):
        return "out of memory"
    if isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:
        where = f" writing {exc.filename}" if exc.filename else ""
        return f"disk full{where} ({exc.strerror or os.strerror(exc.errno)})"
    if isinstance(exc, OSError) and exc.errno == errno.ENOMEM:
        return "out of memory"
    if isinstance(exc, BrokenPipeError):  # `convcheck env | head -1`: the reader stopped reading
        return "interrupted: the output was closed before it was all written (broken pipe)"
    if isinstance(exc, RuntimeError):
        text = first_line(exc).lower()
        if any(t in text for t in _OOM_TEXTS) or type(exc).__name__ == "OutOfMemoryError":
            where = "GPU memory" if any(g in text for g in ("cuda", "gpu", "mps", "hip")) else "memory"
            return f"out of {where}: {first_line(exc)}"
    return None


_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` safe for one terminal line: ANSI colour/cursor sequences (a user exception's message,
    coloured by their logger) dropped, other control characters (a newline in a path) written as escapes."""
    text = _ANSI.sub("", text)
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def first_line(exc: BaseException, limit: int = _MAX_MESSAGE) -> str:
    lines = [ln for ln in _ANSI.sub("", str(exc)).strip().splitlines() if ln.strip()]
    text = printable(lines[0].strip()) if lines else ""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _whole_line(exc: BaseException, limit: int = 2000) -> str:
    """convcheck's own message, all of it on one line (a path holding a newline is not cut there)."""
    text = printable(str(exc).strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."


_UNWRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM}


def unwritable(exc: BaseException) -> str | None:
    """A file or folder this machine will not let convcheck write (a read-only mount, no permission): the
    user's choice of path, exit 2 naming it. None for anything else."""
    if isinstance(exc, OSError) and exc.errno in _UNWRITABLE and exc.filename:
        return f"cannot write {printable(str(exc.filename))}: {exc.strerror or os.strerror(exc.errno)}"
    return None


def _is_library(filename: str, module: str | None) -> bool:
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string> from exec: not a user's file
        return True
    if module and module.split(".")[0] in _LIBRARY_MODULES:
        return True
    path = os.path.abspath(filename)
    if path.startswith(_PACKAGE_ROOTS):
        return False
    installed = f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path
    return path.startswith(_STDLIB_ROOTS) and not installed


def _is_ours(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE_ROOTS)


def culprit(exc: BaseException):
    """The innermost traceback frame outside the libraries: ``(frame, lineno, ours)`` or None."""
    found = None
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        filename = frame.f_code.co_filename
        if not _is_library(filename, frame.f_globals.get("__name__")):
            found = (frame, tb.tb_lineno, _is_ours(filename))
        tb = tb.tb_next
    return found


def _where(frame, lineno: int) -> str:
    path = frame.f_code.co_filename
    with contextlib.suppress(ValueError):
        rel = os.path.relpath(path)
        path = rel if not rel.startswith("..") else path
    func = frame.f_code.co_name
    owner = frame.f_locals.get("self")
    if owner is not None and func != "<module>":
        func = f"{type(owner).__name__}.{func}"
    return f"{func} ({path}:{lineno})"


def _is_module(obj) -> bool:
    return callable(getattr(obj, "named_modules", None)) and callable(getattr(obj, "forward", None))


def layer_name(exc: BaseException, frame) -> str | None:
    """The dotted name of the layer whose code ``frame`` runs ('encoder.block2'), found among the
    modules the traceback passes through on its way in (torch calls each module with itself as
    ``self``); None when ``frame`` is not a module's code or the model is not on the way."""
    layer = frame.f_locals.get("self")
    if not _is_module(layer):
        return None
    tb = exc.__traceback__
    while tb is not None:  # outermost first: the first module that holds the layer is the whole model
        root = tb.tb_frame.f_locals.get("self")
        if _is_module(root) and root is not layer:
            with contextlib.suppress(Exception):
                for name, module in root.named_modules():
                    if module is layer:
                        return name or None
        tb = tb.tb_next
    return None


def innermost_layer(exc: BaseException, root) -> str | None:
    """The dotted name (in ``root``) of the innermost module the traceback runs in, torch's own included
    (a ``BatchNorm1d`` inside an ``nn.Sequential``); None when there is none."""
    names = {}
    with contextlib.suppress(Exception):
        names = {id(m): n for n, m in root.named_modules()}
    found = None
    tb = exc.__traceback__
    while tb is not None:
        layer = tb.tb_frame.f_locals.get("self")
        if _is_module(layer) and names.get(id(layer)):
            found = f"'{names[id(layer)]}' ({type(layer).__name__})"
        tb = tb.tb_next
    return found


def user_code_error(exc: BaseException, during: str = "") -> UserCodeError | None:
    """A one-line ``UserCodeError`` when the innermost non-library frame is the user's, else None."""
    found = culprit(exc)
    if found is None or found[2]:
        return None
    frame, lineno, _ = found
    message = first_line(exc)
    if isinstance(exc, SystemExit):  # sys.exit(...) in the user's code ends their code, not convcheck's run
        what = f"SystemExit (sys.exit({exc.code!r}))"
    else:
        what = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    when = f" during {during}" if during else ""
    layer = layer_name(exc, frame)
    where = f"layer '{layer}', {_where(frame, lineno)}" if layer else _where(frame, lineno)
    return UserCodeError(f"your code raised {what} in {where}{when}")


def user_callable_error(what: str, message: str, exc: BaseException) -> UserCodeError:
    """``what`` (``loss 'focal.loss'``) raised ``exc``: one line with ``message`` (what was raised) and the
    file and line of the user's frame it came from. Where the run catches it (``user_failures``), the stage
    and step are added: a loss fails at a step, not once at setup."""
    found = culprit(exc)
    where = f" in {_where(found[0], found[1])}" if found is not None and not found[2] else ""
    error = UserCodeError(f"{what} raised {message}{where}")
    error.stage_unknown = True
    return error


# convcheck's dispatch modes see every op a layer runs and pass it on: frames that are not the failure
_PASSTHROUGH = {"__torch_dispatch__", "__torch_function__"}


def model_on_data_error(exc: BaseException, during: str = "") -> UserCodeError | None:
    """torch's own layer raising inside the user's model on the batch it was given (3-channel inputs into a
    1-channel convolution, samples of another size into a Linear): the user's model and data disagree, exit
    2 naming the layer. None when the traceback reaches no torch module below convcheck's innermost frame
    (a hook of convcheck's raising inside a module is convcheck's own)."""
    layer_frame = None
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        code = frame.f_code
        if code.co_name == "forward" and _is_module(frame.f_locals.get("self")) and \
                _is_library(code.co_filename, frame.f_globals.get("__name__")):
            layer_frame = frame  # torch's own layer (the user's own forward is user_code_error's)
        elif not _is_library(code.co_filename, frame.f_globals.get("__name__")) and \
                code.co_name not in _PASSTHROUGH:
            layer_frame = None  # code that is not torch's ran below the layer: not the layer failing
        tb = tb.tb_next
    if layer_frame is None:
        return None
    module = layer_frame.f_locals["self"]
    name = layer_name(exc, layer_frame)
    where = f"layer '{name}' ({type(module).__name__})" if name else f"a {type(module).__name__} layer"
    message = first_line(exc)
    what = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    when = f" during {during}" if during else ""
    return UserCodeError(f"your model failed on the data in {where}{when}: {what} (do the batches match what "
                         "the model takes: shapes, channels, dtypes?)")


def user_exit(exc: BaseException) -> bool:
    """``exc`` is a ``SystemExit`` raised by the user's code (``sys.exit`` in a factory, ``forward``, a loss,
    a Dataset, a module's top level): the user's code failing, never the end of convcheck's run."""
    if not isinstance(exc, SystemExit):
        return False
    found = culprit(exc)
    return found is not None and not found[2]


def classify(exc: BaseException, during: str = "") -> Failure:
    """Exit code and line for any exception that reached the top."""
    if isinstance(exc, ConvcheckError):
        return Failure(exc.exit_code, _whole_line(exc) or type(exc).__name__)
    reason = resource_reason(exc)
    if reason:
        when = f" during {during}" if during else ""
        hint = " (try a smaller --batch-size)" if "memory" in reason else ""
        return Failure(EXIT_RESOURCE, f"{reason}{when}{hint}")
    if unwritable(exc):  # whoever's code tried: the path is the user's to change
        return Failure(EXIT_USAGE, unwritable(exc))
    user = user_code_error(exc, during) or model_on_data_error(exc, during)
    if user is not None:
        return Failure(EXIT_USAGE, str(user))
    if isinstance(exc, SystemExit):  # convcheck never raises one: sys.exit itself given as a factory (sys:exit)
        when = f" during {during}" if during else ""
        return Failure(EXIT_USAGE, f"the run was ended by SystemExit (sys.exit({exc.code!r})){when}: a model, data, "
                                   "loss or optimizer given to convcheck called sys.exit")
    return Failure(EXIT_INTERNAL, f"internal error ({type(exc).__name__}: {first_line(exc)})", internal=True)


def as_convcheck_error(exc: BaseException, during: str = "") -> ConvcheckError | None:
    """What the Python API raises instead of ``exc``: RunFailed for the machine's limits (not an
    interrupt: KeyboardInterrupt stays what it is), UserCodeError for the user's code, None for a bug."""
    if isinstance(exc, ConvcheckError) or isinstance(exc, KeyboardInterrupt):
        return None
    if isinstance(exc, SystemExit) and not user_exit(exc):
        return None
    failure = classify(exc, during)
    if failure.code == EXIT_RESOURCE:
        return RunFailed(failure.line)
    if failure.code == EXIT_USAGE:
        return UserCodeError(failure.line)
    return None


def report(exc: BaseException, *, debug: bool = False, stream=None, hint: str = "") -> int:
    """Print ``exc`` as the CLI does (one line; a traceback only for a bug or with ``debug``), return its code."""
    stream = stream or sys.stderr
    failure = classify(exc)
    if isinstance(exc, BrokenPipeError):  # nothing more can reach stdout; keep Python's exit flush quiet
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if failure.internal or debug:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=stream)
    if failure.internal:
        from convcheck import __version__

        print(f"convcheck: {failure.line}: this is a bug in convcheck {__version__}; please report it to the "
              "convcheck maintainers with the command line and the traceback above", file=stream)
        return failure.code
    extra = hint if isinstance(exc, UserCodeError) and not debug else ""
    print(f"convcheck: error: {failure.line}{extra}", file=stream)
    return failure.code
