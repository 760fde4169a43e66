"""One arm's model, optimizer and monitors; ``step`` runs one training step through its runner."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from convcheck.capture import SharedDropoutMasks, leaf_modules, named_modules
from convcheck.numerics.thresholds import SATURATED_ABS
from convcheck.measure.train.arms import STEP_PERTURB_SLOT, Arm, nudged, perturb_, step_seed
from convcheck.measure.train.nonfinite import FirstProducer, all_finite, loss_op
from convcheck.measure.train.stats import Scratch, fraction_abs_above, fraction_le_zero, norms_and_zeros, seed_generators


class ArmState:
    evidence = None  # an in-process arm gathers no evidence beyond its curves (``executors.ArmJob``)

    def __init__(self, arm: Arm, build, steps: int, recipe, masks=None, scratch: Scratch | None = None):
        self.arm = arm
        self.scratch = scratch if scratch is not None else Scratch()  # run_training shares one between arms
        # (parameter versions, ||theta||^2): the weight norm ``run_training`` measured after the last step
        self._weight_sq: tuple[tuple[int, ...], float] | None = None
        self.runner = arm.target.runner
        self.model = build(arm.target)
        if arm.perturb_seed is not None:
            perturb_(self.model, self.runner.ulp, arm.perturb_seed, self.scratch)
        self._steps_done = 0  # optimizer steps taken (an ``every_step`` envelope run's nudges are seeded by it)
        # an envelope run of a same-precision pair: nudged again at every step (an arm-like object without
        # the field is not)
        self._every_step = bool(getattr(arm, "every_step", False)) and arm.perturb_seed is not None
        self.opt = recipe.make_optimizer(self.model.parameters())
        self.schedule = recipe.make_schedule(self.opt, steps)
        self.clip = recipe.clip_grad_norm
        self.scaler = self.runner.make_grad_scaler()
        self.loss_fn = recipe.loss
        # every module holding parameters of its own: leaves, and modules with children whose own
        # code uses parameters (a layer-scale gamma, a temperature)
        self.layers = [(n, m) for n, m in named_modules(self.model)
                       if any(True for _ in m.parameters(recurse=False))]
        # their parameter objects, and the model's, listed once (the optimizer holds the same ones)
        self._layer_params = [(n, list(m.parameters(recurse=False))) for n, m in self.layers]
        self._params = list(self.model.parameters())
        self.acts: list[tuple[str, str, float, float]] = []
        # ``masks(model)``: a data-parallel rank takes its slice of the global batch's masks
        self.masks = masks(self.model) if masks is not None else SharedDropoutMasks(self.model, 0)
        self.masks.__enter__()  # registered first: the hooks below see the shared-mask output
        # Each role is watched for what the verdict reads of it: the activation statistics of the
        # judge (the training-problem detectors run on the judge's run alone), the first NaN/Inf
        # producer and the per-layer gradients of the judge and the targets; an envelope run is
        # the null model: its loss, its distances and its global gradient norm (finite or not).
        self._per_layer = arm.role != "envelope"
        self._hooks = [m.register_forward_hook(self._act_hook(n, m))
                       for n, m in leaf_modules(self.model)
                       if isinstance(m, (nn.ReLU, nn.Sigmoid, nn.Tanh))] if arm.role == "judge" else []
        self.first_producer = FirstProducer(self.model, watch=self._per_layer)
        # (lr, gradients finite) of the last optimizer step while no producer was found
        self._last_update: tuple[float, bool] | None = None
        self._recipe_facts = dict(optimizer=type(self.opt).__name__,
                                  eps=getattr(self.opt, "defaults", {}).get("eps"),
                                  loss=str(getattr(recipe, "loss_name", "") or getattr(self.loss_fn, "__name__", "loss")))

    @property
    def step_index(self) -> int:
        return self.first_producer.step_index

    @step_index.setter
    def step_index(self, index: int) -> None:
        self.first_producer.next_step(index)

    @property
    def producer_weights(self) -> bool:
        """Whether the producer's own weights were NaN/Inf when it ran (an optimizer step made them so)."""
        return self.first_producer.weights

    @property
    def producer_detail(self) -> dict:
        """What the producer is (``callable``: a module, the loss, the optimizer step, the schedule),
        the op of user code that made the first NaN/Inf and its float64 magnitude, where known."""
        detail = dict(self.first_producer.detail)
        if self.first_producer.weights and self._last_update is not None:
            # a module's own weights were NaN/Inf when it ran: the step before made them so
            lr, grads_finite = self._last_update
            detail.update(callable="schedule" if not math.isfinite(lr) else "optimizer", lr=lr,
                          gradients_finite=grads_finite)
        if self.first_producer.weights or detail.get("callable") != "module":
            detail.update(self._recipe_facts)
        return detail

    @property
    def producer(self) -> tuple[int, str] | None:
        """The first call that turned finite inputs into NaN/Inf (a leaf, or a module's own code)."""
        return self.first_producer.found

    def _act_hook(self, name: str, module: nn.Module):
        """Dead ReLU outputs, or saturated sigmoid/tanh pre-activations (outside +-SATURATED_ABS,
        DeepDiagnosis), of every call while gradients are on; the kind is read once, here."""
        acts, scratch = self.acts, self.scratch  # ``step`` clears the list in place
        if isinstance(module, nn.ReLU):
            def relu(module, inputs, output):
                if torch.is_grad_enabled():
                    acts.append((name, "relu", fraction_le_zero(output.detach(), scratch), math.nan))
            return relu
        kind = type(module).__name__.lower()

        def saturation(module, inputs, output):
            if torch.is_grad_enabled():
                acts.append((name, kind, math.nan, fraction_abs_above(inputs[0].detach(), SATURATED_ABS, scratch)))
        return saturation

    def close(self):
        for h in self._hooks:
            h.remove()
        self.first_producer.close()
        self.masks.__exit__(None, None, None)

    def step(self, x: torch.Tensor, y: torch.Tensor, seed: int, rng_seed: int) -> dict:
        runner = self.runner
        self.acts.clear()
        self.masks.seed = seed  # dropout masks: the same on every arm at this step
        self.masks._calls = 0
        with runner.applied():
            # Any other random draw differs per arm, as it would on another device;
            # parity's probe names the layers that make such draws.
            seed_generators(rng_seed)
            self.opt.zero_grad(set_to_none=True)
            if self._every_step and x.is_floating_point():
                x = nudged(x, runner.ulp, step_seed(self.arm.perturb_seed, -1 - self._steps_done))
            out, loss = runner.forward_loss(self.model, x, y, self.loss_fn)
            loss_value = float(loss.detach())
            watching = self.first_producer.watch and self.first_producer.found is None
            if (not math.isfinite(loss_value) and watching
                    and all(all_finite(t) for t in _tensors(out))):
                # every module's output is finite, the loss is not: the loss function made it
                self.first_producer.blame_callable("loss", dict(
                    callable="loss", **loss_op(self.loss_fn, out, runner.cast_input(y), runner.autocast)))
            outs = [t for t in _tensors(out) if t.requires_grad and t.is_floating_point()]
            watch_grad = (watching and self.scaler is None and math.isfinite(loss_value)
                          and len(outs) == 1)
            if watch_grad:  # the loss is finite: a NaN/Inf gradient into the model's output is its backward's
                bad: list = []
                handle = outs[0].register_hook(lambda g: bad.append(True) if not all_finite(g) else None)
            runner.train_backward(loss, self.opt, self.scaler)
            if watch_grad:
                handle.remove()
                if bad and self.first_producer.found is None:
                    self.first_producer.blame_callable("loss", dict(callable="loss", direction="backward"))
            stats = self._grad_stats()
            lr = self.opt.param_groups[0]["lr"]
            clipped = self._clip(stats["grad_norm"])
            scale, skipped = runner.optimizer_step(self.opt, self.scaler)
            if self._every_step:
                # the null model of a same-precision pair: another one-ulp nudge after every step
                perturb_(self.model, runner.ulp, step_seed(self.arm.perturb_seed, self._steps_done), self.scratch,
                         STEP_PERTURB_SLOT)
            self._steps_done += 1
            if self.first_producer.found is None:
                self._last_update = (float(lr), math.isfinite(stats["grad_norm"]))
            if self.schedule is not None:
                self.schedule.step()
        return dict(
            loss=loss_value, nonfinite_loss=not math.isfinite(loss_value),
            nonfinite_grad=not math.isfinite(stats["grad_norm"]) and self.scaler is None,
            loss_scale=scale, skipped=skipped, acts=list(self.acts), lr=lr, clipped=clipped, **stats,
        )

    def _clip(self, grad_norm: float) -> bool:
        """Clip the (unscaled) gradients to ``clip_grad_norm``; whether this step was clipped."""
        if self.clip is None:
            return False
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        return math.isfinite(grad_norm) and grad_norm > self.clip

    def remember_weight_sq(self, weight_sq: float) -> None:
        """``run_training`` measured ||theta||^2 (as ``_grad_stats`` does) after this step: the next
        step's update ratio reads it while no parameter has changed since (their versions say)."""
        self._weight_sq = (self._param_versions(), weight_sq)

    def _param_versions(self) -> tuple[int, ...]:
        return tuple(p._version for p in self._params)

    def _grad_stats(self) -> dict:
        """Global and per-layer gradient norms (float64), exact-zero fractions, lr*|g|/|W|.

        The values of ``vector_norm(g, dtype=float64)`` and ``count_nonzero`` per tensor, summed per
        layer in the same order, all tensors at once (``stats.norms_and_zeros``). An envelope run
        has the global norm alone (the same sum, in the same order), no per-layer rows."""
        layers = []
        for name, params in self._layer_params:
            grads = [p.grad.detach() for p in params if p.grad is not None]
            if grads:
                layers.append((name, grads))
        per_layer = self._per_layer
        norms, zero_counts = norms_and_zeros([g for _, grads in layers for g in grads], self.scratch,
                                             zeros=per_layer)
        layer_norms, zero_fracs = [], []
        total_sq = 0.0
        i = 0
        for name, grads in layers:
            k = len(grads)
            sq = sum(x ** 2 for x in norms[i:i + k])
            total_sq += sq
            if per_layer:
                layer_norms.append((name, math.sqrt(sq) if math.isfinite(sq) else math.inf))
                zero_fracs.append(sum(zero_counts[i:i + k]) / max(1, sum(g.numel() for g in grads)))
            i += k
        grad_norm = math.sqrt(total_sq) if math.isfinite(total_sq) else math.inf
        known = self._weight_sq
        if known is not None and known[0] == self._param_versions():
            weight_sq = known[1]
        else:
            params = [p.detach() for p in self._params]
            weight_sq = sum(x ** 2 for x in norms_and_zeros(params, self.scratch, zeros=False)[0])
        lr = self.opt.param_groups[0]["lr"]
        update_ratio = lr * grad_norm / math.sqrt(weight_sq) if weight_sq > 0 else math.nan
        return dict(grad_norm=grad_norm, update_ratio=update_ratio, layer_norms=layer_norms, zero_fracs=zero_fracs)


def _tensors(obj) -> list[torch.Tensor]:
    from convcheck.nested import tensors_in

    return [t for t in tensors_in(obj) if t.is_floating_point()]
