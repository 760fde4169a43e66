"""``convcheck.integrations.lightning.ConvcheckCallback``: a PyTorch Lightning run recorded by ``convcheck.watch``.

    trainer = L.Trainer(..., callbacks=[ConvcheckCallback(out="runs/gpu")])

At ``on_train_start`` it opens a watch on the LightningModule and the trainer's optimizers, with the
precision plugin's GradScaler when there is one; each optimizer step is one watched step (with several optimizers -
a GAN's, ``automatic_optimization = False`` - one batch is one step, each optimizer's gradient norms read at its own
step: ``convcheck.watch(optimizers=[...])``), ended at
``on_train_batch_end`` with the loss ``training_step`` returned (summed over the micro-batches of an
accumulated step: Lightning hands each one over divided by ``accumulate_grad_batches``). The hash of the
batch the loader gave is recorded at ``on_train_batch_start`` (besides the model's own forward inputs, which
the watch hashes when ``training_step`` calls ``self(...)``). ``on_train_end`` closes the watch;
``on_exception`` closes it as stopped (the manifest's ``stopped``: the exception and the step), and
``convcheck diff`` reads the steps up to there. Under DDP each rank
writes ``out/rank<k>/`` (``convcheck.watch`` does that).
"""

from __future__ import annotations

from convcheck.integrations._extra import require, scalar
from convcheck.runformat.layout import DEFAULT_MAX_BYTES
from convcheck.watch.recorder import watch


def _callback_base():
    try:
        return require("lightning.pytorch", "lightning", "PyTorch Lightning").Callback
    except Exception:
        try:  # the standalone package: its Trainer takes only its own Callback class
            import pytorch_lightning

            return pytorch_lightning.Callback
        except ImportError:
            pass
        raise


class ConvcheckCallback(_callback_base()):
    """Watch a Lightning run into ``out`` (see ``convcheck.watch`` for the options)."""

    def __init__(self, out, *, snapshot_steps=(0,), snapshot_nonfinite: bool = True,
                 max_bytes: int = DEFAULT_MAX_BYTES, force: bool = False):
        super().__init__()
        self.out = out
        self.options = dict(snapshot_steps=snapshot_steps, snapshot_nonfinite=snapshot_nonfinite,
                            max_bytes=max_bytes, force=force)
        self.watch = None
        self._losses: list = []
        self._stepped = False

    def on_train_start(self, trainer, pl_module) -> None:
        optimizers = list(trainer.optimizers)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        w = watch(pl_module, out=self.out, scaler=scaler, optimizers=optimizers or None, **self.options)
        self.watch = w.__enter__()
        self._losses, self._stepped = [], False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.watch is not None and pl_module.training:
            self.watch.hash_batch((batch,), {})

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._stepped = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.watch is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self._losses.append(scalar(loss))
        if self._stepped:  # an optimizer step ended this batch (not a micro-batch of an accumulated step)
            losses, self._losses, self._stepped = self._losses, [], False
            self.watch.step(None if None in losses else sum(losses))

    def on_train_end(self, trainer, pl_module) -> None:
        self._close(None)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._close(exception)

    def _close(self, exc: BaseException | None) -> None:
        w, self.watch = self.watch, None
        if w is not None:
            w.__exit__(None if exc is None else type(exc), exc, None if exc is None else exc.__traceback__)
