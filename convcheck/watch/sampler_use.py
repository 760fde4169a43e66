"""How the loop's ``DistributedSampler`` is driven (issue 36): whether it shuffles, and whether the loop tells it
the epoch. A ``DistributedSampler(shuffle=True)`` draws its order from its seed and ``set_epoch``'s epoch: a loop
that never calls ``set_epoch`` repeats the first epoch's order every epoch. With ``shuffle=False`` the order is
the same by choice, whatever ``set_epoch`` says.

While the watch is open, ``DistributedSampler.__iter__`` (the class's, restored on exit) records each sampler's
``shuffle`` and the epoch it iterates at; the manifest's ``sampler`` holds them (None when no
``DistributedSampler`` was iterated). ``analysis/rankdiff.py`` names an epoch order that repeats only when the
sampler shuffles and was never told another epoch."""

from __future__ import annotations

MAX_EPOCHS = 1000


class SamplerSpy:
    def __init__(self, on_error=None):
        self.on_error = on_error  # an exception of the spy's own, met inside the loop (``Watch.fail``)
        self.shuffle: bool | None = None
        self.epochs: set[int] = set()
        self.saved = None

    def install(self) -> "SamplerSpy":
        try:
            from torch.utils.data.distributed import DistributedSampler
        except Exception:  # noqa: BLE001 - a torch without it: nothing to watch
            return self
        self.cls, self.saved = DistributedSampler, DistributedSampler.__dict__.get("__iter__")
        spy, original = self, DistributedSampler.__iter__

        def __iter__(sampler):
            try:
                spy.seen(sampler)
            except Exception as error:  # noqa: BLE001 - the watch's own: recording stops, the loop goes on
                if spy.on_error is None:
                    raise
                spy.on_error(error, "DistributedSampler.__iter__")
            return original(sampler)

        DistributedSampler.__iter__ = __iter__
        return self

    def seen(self, sampler) -> None:
        """A DistributedSampler iterated: whether it shuffles, the epoch it was told."""
        self.shuffle = bool(self.shuffle) or bool(getattr(sampler, "shuffle", False))
        epoch = getattr(sampler, "epoch", None)
        if isinstance(epoch, int) and len(self.epochs) < MAX_EPOCHS:
            self.epochs.add(epoch)

    def remove(self) -> None:
        if self.saved is not None:
            self.cls.__iter__ = self.saved
            self.saved = None

    def record(self) -> dict | None:
        """The manifest's ``sampler``: whether a DistributedSampler shuffled and the epochs it was told."""
        if self.shuffle is None:
            return None
        return {"shuffle": self.shuffle, "epochs": sorted(self.epochs)}
