"""``convcheck.integrations.hf.ConvcheckCallback``: a Hugging Face ``Trainer`` run recorded by ``convcheck.watch``.

    trainer = Trainer(model, args, train_dataset=..., callbacks=[ConvcheckCallback(out="runs/gpu")])

At ``on_train_begin`` it opens a watch on the trainer's model and optimizer (the torch optimizer inside
accelerate's ``AcceleratedOptimizer``, with its GradScaler when there is one) - the ones it trains: the Trainer
points its callback handler at its model, optimizer and scheduler just before ``on_train_begin``, so a
``model_init``'s fresh model is the one handed over; each optimizer step is one
watched step, ended at ``on_step_end`` with the loss the model returned (its output's ``loss``, as the
Trainer reads it; the mean over the micro-batches of an accumulated step; None when the model returned no
loss, e.g. a ``compute_loss`` of the user's own). ``on_train_end`` closes the watch. The Trainer has no
callback for a failed run: a run that raised leaves its watch open and its bundle incomplete, which
``convcheck diff`` refuses. Under DDP each rank writes ``out/rank<k>/`` (``convcheck.watch`` does that). The loss is
read by a process-wide forward hook routed by identity to the trained model, never a hook on the model: a copy,
pickle or ``torch.save`` of the model during training (an EMA, a checkpoint) is what it is without the callback.
"""

from __future__ import annotations

from torch.nn.modules.module import register_module_forward_hook

from convcheck.integrations._extra import require, scalar
from convcheck.runformat.layout import DEFAULT_MAX_BYTES
from convcheck.watch.recorder import watch

_transformers = require("transformers", "hf", "Hugging Face transformers")


def _loss_of(output):
    """The loss in a model's output as the Trainer reads it: ``output["loss"]``, else a leading scalar."""
    if isinstance(output, dict):
        return output.get("loss")
    if isinstance(output, (tuple, list)) and output and getattr(output[0], "ndim", None) == 0:
        return output[0]
    return None


class ConvcheckCallback(_transformers.TrainerCallback):
    """Watch a Trainer run into ``out`` (see ``convcheck.watch`` for the options)."""

    def __init__(self, out, *, snapshot_steps=(0,), snapshot_nonfinite: bool = True,
                 max_bytes: int = DEFAULT_MAX_BYTES, force: bool = False):
        self.out = out
        self.options = dict(snapshot_steps=snapshot_steps, snapshot_nonfinite=snapshot_nonfinite,
                            max_bytes=max_bytes, force=force)
        self.watch = None
        self._handle = self._model = None
        self._losses: list = []

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer
        scaler = getattr(optimizer, "scaler", None)
        w = watch(model, inner, out=self.out, scaler=scaler, **self.options)
        self.watch = w.__enter__()
        self._losses = []
        self._model = model
        self._handle = register_module_forward_hook(self._record_loss)

    def _record_loss(self, module, args, output):
        if module is self._model and module.training and self.watch is not None:
            loss = scalar(_loss_of(output))
            self._losses.append(loss)
        return None

    def on_step_end(self, args, state, control, **kwargs):
        if self.watch is None:
            return
        losses, self._losses = self._losses, []
        ok = losses and None not in losses
        self.watch.step(sum(losses) / len(losses) if ok else None)

    def on_train_end(self, args, state, control, **kwargs):
        if self._handle is not None:
            self._handle.remove()
            self._handle = self._model = None
        w, self.watch = self.watch, None
        if w is not None:
            w.__exit__(None, None, None)
