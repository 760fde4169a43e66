"""The remedy catalogue (issue 46): every remedy a verdict gives is an entry declared once - its id, its text
template, the causes it answers, the reduced-precision formats it names, and the change ``verify`` makes to apply
it (none: a change to the user's code that convcheck cannot make).

A verdict carries ``Remedy`` values: an entry's id and the fields its template is filled with. A ``Remedy`` *is*
its text (a ``str``), so a reader, a renderer or a user's own code that prints or compares remedies sees exactly
the sentence; what decides anything reads ``id`` and ``entry``, never the words: ``verify`` picks the actions of the
entries a verdict lists, in the order it lists them, and ``offered`` holds a watched verdict's remedies to the
formats its runs used by the formats each entry declares. The stock entries are declared in ``remedies.py``; a
new remedy, with its action, is one more ``declare`` (``tests/test_extending.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from convcheck.numerics.thresholds import CLIP_NORM, LOWERED_WEIGHT_DECAY, LR_FACTOR, RAISED_EPS


@dataclass(frozen=True)
class Change:
    """What ``verify`` changes in a re-run of the failing arm to apply a remedy: ``kind`` names the action (a
    registered deriver in ``verify/actions.py`` refines it from the verdict and the recipe; a kind with none is
    applied as declared) and the fields say what it changes."""

    kind: str
    modules_float32: bool = False  # the verdict's layer kept in float32 in a 16-bit model
    loss_float32: bool = False  # the loss computed in float32 on the model's 16-bit output, outside autocast
    eps: float | None = None  # the optimizer's eps raised to at least this
    lr_factor: float | None = None  # every group's learning rate times this
    clip: float | None = None  # gradients clipped to this norm
    weight_decay: float | None = None  # every group's weight decay lowered to at most this
    tf32_off: bool = False  # the same device without TF32
    deterministic: bool = False  # torch.use_deterministic_algorithms(True) while it runs
    settings: tuple[tuple[str, object], ...] = ()  # options of the run's config changed (``--ddp-sync-bn``)


# the changes verify knows how to fit to a verdict (``verify/actions.ACTIONS`` has a deriver for each)
FLOAT32_MODULE = Change("float32-module", modules_float32=True)
LOSS_FLOAT32 = Change("loss-float32", loss_float32=True)
RAISE_EPS = Change("optimizer-eps", eps=RAISED_EPS)
LOWER_LR = Change("lower-lr", lr_factor=LR_FACTOR)
CLIP = Change("clip-gradients", clip=CLIP_NORM)
LOWER_WEIGHT_DECAY = Change("lower-weight-decay", weight_decay=LOWERED_WEIGHT_DECAY)
TF32_OFF = Change("tf32-off", tf32_off=True)
DETERMINISTIC = Change("deterministic", deterministic=True)
SYNC_BATCHNORM = Change("sync-batchnorm", settings=(("ddp_sync_bn", True),))


SHORT_NAMES = {"bfloat16": "bf16", "float16": "fp16", "tf32": "tf32", "fp8": "fp8"}


class Formats(tuple):
    """A field naming reduced-precision formats as alternatives (``bf16/fp16``): ``offered`` keeps the ones the
    runs used."""

    def __str__(self) -> str:
        return "/".join(SHORT_NAMES.get(f, f) for f in self)


@dataclass(frozen=True)
class Entry:
    """One remedy of the catalogue. ``template`` is filled with a remedy's fields (``str.format``); ``answers``
    the verdict causes (``sub_cause``, else category) it answers - () any; ``formats`` the reduced-precision
    formats its text names: it is offered only where the runs used every one, else ``otherwise`` (an entry id)
    is, or nothing; ``actions`` the changes it asks for, in the order its text names them (() a code change)."""

    id: str
    template: str
    answers: tuple[str, ...] = ()
    formats: frozenset[str] = frozenset()
    otherwise: str | None = None
    actions: tuple[Change, ...] = ()

    def remedy(self, **fields) -> Remedy:
        return Remedy(self.id, tuple(fields.items()))

    def answer(self, cause: str | None) -> bool:
        """Whether this entry answers a verdict of ``cause``."""
        return not self.answers or cause in self.answers


CATALOGUE: dict[str, Entry] = {}


def declare(id: str, template: str, *, answers=(), formats=(), otherwise: str | None = None,
            actions=()) -> Entry:
    """Add an entry to the catalogue (an id declared twice with another entry is an error)."""
    entry = Entry(id, template, tuple(answers), frozenset(formats), otherwise,
                  tuple(actions) if isinstance(actions, (tuple, list)) else (actions,))
    if CATALOGUE.get(id, entry) != entry:
        raise ValueError(f"remedy {id!r} is declared twice")
    CATALOGUE[id] = entry
    return entry


class Remedy(str):
    """A remedy as a verdict gives it: the catalogue entry ``id`` and the ``fields`` its template is filled
    with. Its string value is its text (``text()``), so that ``print``, JSON and the user's ``in``/``==`` see
    the sentence; nothing in convcheck decides from that text."""

    def __new__(cls, id: str, fields: tuple[tuple[str, object], ...] = ()):
        entry = CATALOGUE[id]
        fields = tuple(fields)
        self = super().__new__(cls, entry.template.format(**dict(fields)))
        self.__dict__.update(id=id, fields=fields)
        return self

    def __setattr__(self, name, value):
        raise AttributeError(f"a Remedy is immutable ({name})")

    def __reduce__(self):
        return Remedy, (self.id, self.fields)

    def __repr__(self) -> str:
        return f"Remedy({self.id!r}, {dict(self.fields)!r})"

    @property
    def entry(self) -> Entry:
        return CATALOGUE[self.id]

    def text(self) -> str:
        return str.__str__(self)

    def with_fields(self, **fields) -> Remedy:
        """This remedy with ``fields`` set (the others kept)."""
        return Remedy(self.id, tuple({**dict(self.fields), **fields}.items()))

    def to_dict(self) -> dict:
        return {"id": self.id, "fields": {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.fields}}

    def fitted(self, used: set[str]) -> Remedy | None:
        """This remedy as offered to runs that used the reduced-precision formats ``used``: its ``Formats`` fields
        trimmed to the used ones; its entry's ``otherwise`` where it names a format they did not use (or a
        ``Formats`` field keeps none); None where there is nothing to offer."""
        entry, fields = self.entry, dict(self.fields)
        for k, v in fields.items():
            if isinstance(v, Formats):
                fields[k] = Formats(f for f in v if f in used)
        if entry.formats <= used and all(v for v in fields.values() if isinstance(v, Formats)):
            return Remedy(self.id, tuple(fields.items()))
        if entry.otherwise is None:
            return None
        return Remedy(entry.otherwise, tuple((k, v) for k, v in self.fields
                                             if "{" + k in CATALOGUE[entry.otherwise].template)).fitted(used)


WRITTEN = declare("written", "{text}")  # a fix written where it was found (an audit rule's, a finding's): no action


def as_remedy(r) -> Remedy:
    """``r`` as a ``Remedy``: a plain string is a ``written`` one (a code change; nothing to apply)."""
    return r if isinstance(r, Remedy) else WRITTEN.remedy(text=str(r))


def offered(remedies, used: set[str], fallback: Remedy | None = None) -> list[Remedy]:
    """``remedies`` as offered to runs that used the reduced-precision formats ``used`` (``Remedy.fitted``: the one
    check, on the entries' declared formats); where none is left, ``fallback``."""
    out = [f for f in (as_remedy(r).fitted(used) for r in remedies) if f is not None]
    if remedies and not out and fallback is not None:
        out.append(fallback)
    return out


def changes(remedies, cause: str | None) -> list[tuple[tuple[int, int], Change]]:
    """The changes ``remedies`` ask for, with where they are listed ((remedy, position in its text)), from the
    entries that answer a verdict of ``cause``."""
    out = []
    for n, r in enumerate(remedies or ()):
        entry = as_remedy(r).entry
        if entry.answer(cause):
            out += [((n, k), c) for k, c in enumerate(entry.actions)]
    return out
