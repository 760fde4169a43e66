"""The stock remedy catalogue (issue 46): every remedy a verdict gives, declared once as an entry of
``catalogue.py`` - the watched-run rules' (``rules/watched.py``), the setup detectors' (``detectors/watched_setup.py``)
and ``compare``'s rules' (``rules/numerics.py``, ``layer.py``, ``setup.py``, ``nondeterminism.py``).

Each constant is a ``Remedy`` (its text as a ``str``, its entry's ``id``); an entry whose text has fields is kept as
the ``Entry`` and filled where it is given (``entry.remedy(layer=...)``). ``actions=`` says what ``verify`` changes to
apply it; ``formats=`` the reduced-precision formats its text names (``only_used_formats``)."""

from __future__ import annotations

from convcheck.diagnose.detectors import training as S
from convcheck.diagnose.catalogue import (CLIP, DETERMINISTIC, FLOAT32_MODULE, LOSS_FLOAT32 as LOSS_FLOAT32_CHANGE,
                                          LOWER_LR, LOWER_WEIGHT_DECAY, RAISE_EPS, TF32_OFF, Formats, declare, offered)

# --- shared with compare ----------------------------------------------------------------------------------
MASTER_WEIGHTS = declare("master-weights", "keep float32 master weights (autocast instead of casting the model to "
                         "{cast})").remedy(cast=Formats(("bfloat16", "float16")))
declare("grad-scaler", "use torch.amp.GradScaler to scale the loss")
GRAD_SCALER_UNDERFLOW = declare("grad-scaler-underflow", "use torch.amp.GradScaler to scale the loss, or bfloat16 "
                                "instead of float16", formats={"float16"}, otherwise="grad-scaler").remedy()

# --- setup: what two runs were given differently ---------------------------------------------------------
OPTIMIZER_REMEDIES = [declare("same-optimizer", "build the same optimizer on both sides (its class and its hyperparameters), then diff again").remedy()]
LR_REMEDIES = [declare("same-lr", "give both runs the same learning rate and schedule (the optimizer's lr=, the scheduler and where "
               "its step() is called), then diff again").remedy()]
INIT_REMEDIES = [declare("same-init", "seed the model's construction identically on both sides (torch.manual_seed(s) right before "
                 "building it), or load the same initial state_dict into both (model.load_state_dict(...)), "
                 "then diff again").remedy()]
BISECT_BACKENDS = (declare("bisect-backends", "bisect the compiler: convcheck diff A B --backends re-runs the recorded step under eager, aot_eager "
                   "and inductor and names the first backend whose result changes (with --out, a repro script to "
                   "attach to a PyTorch bug report)").remedy())
KERNEL_ZEROS = (declare("kernel-zeros", "compare that layer against the float64 judge (convcheck diff RUN --judge cpu:float64): a float32 "
                "kernel that returns exact zeros where another does not computes something else").remedy())
PYTHON_ORDER = (declare("python-order", "iterate in a fixed order in your own code (sorted(...) over a set's or a dict's keys, a list instead "
                "of a set), or start both runs with the same PYTHONHASHSEED (PYTHONHASHSEED=0 python train.py): "
                "torch's deterministic algorithms do not reach an order in Python").remedy())
TARGET_REMEDIES = [declare("same-targets", "give both runs the same targets: the same labels for the same inputs (a label offset, a class "
                   "mapping or a target transform applied on one side only), then diff again").remedy()]
MODEL_REMEDIES = [declare("same-model", "build the same model on both sides (each layer with the same arguments: Dropout's p, BatchNorm's "
                  "momentum and eps...), then diff again").remedy()]
GROUP_REMEDIES = [declare("same-groups", "build both optimizers with the same parameter groups: each parameter in the group with the same "
                  "settings on both sides (e.g. weight decay off for the norms and biases in both, or in neither), "
                  "then diff again").remedy()]
FREEZE_REMEDIES = [declare("same-trained", "train the same parameters on both sides: the same requires_grad for each (and unfreeze at the same "
                   "step), every trained parameter in the optimizer and reached by the loss, then diff again").remedy()]
NO_GRADIENT_REMEDIES = [declare("gradients-before-step", "compute the gradients before the optimizer steps: loss.backward(), "
                         "then optimizer.step(), then optimizer.zero_grad() (or zero_grad() before backward()) - a "
                         "zero_grad() between backward() and step() leaves every .grad None and the step does nothing"
                         ).remedy()]
ACCUMULATION_REMEDIES = [declare("accumulation", "call optimizer.zero_grad() once per optimizer step (before backward()): without it every "
                         "step's gradient is added to the ones before it").remedy()]
BACKWARD_REMEDIES = [declare("same-backward", "make both sides run the same backward: the same loss.backward() calls per step, no gradient "
                     "hook or manual change of .grad on one side only, then diff again").remedy()]
CLOSURE_REMEDIES = [declare("zero-grad-in-closure", "call optimizer.zero_grad() at the start of the closure the optimizer "
                    "evaluates several times a step (LBFGS, a line search): without it each evaluation's gradient is "
                    "added to the ones before it within the step").remedy()]
TRAIN_MODE_REMEDIES = [declare("train-mode", "call model.train() before training again after an evaluation (model.eval() switches BatchNorm "
                       "to its running statistics and Dropout off), then diff again").remedy()]
SCALER_REMEDIES = [declare("same-scaler", "give both runs the same GradScaler settings (init_scale, growth_interval), then diff again: a "
                   "GradScaler skips the steps whose scaled gradients overflow while it lowers its scale").remedy()]
CLIP_REMEDIES = [declare("same-clipping", "clip on both sides or neither, at the same max_norm: torch.nn.utils.clip_grad_norm_(model.parameters(), "
                 "max_norm) between backward() and optimizer.step() (after scaler.unscale_(optimizer) under a "
                 "GradScaler), then diff again").remedy()]
UNSCALE_BEFORE_CLIP = [declare("unscale-before-clip", "call scaler.unscale_(optimizer) before clip_grad_norm_: scaler.scale(loss).backward(); "
                       "scaler.unscale_(optimizer); torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm); "
                       "scaler.step(optimizer); scaler.update() - clipped while scaled, the true gradients are held to "
                       "max_norm / scale").remedy()]
STEP_WITH_SCALER = [declare("step-with-scaler", "step through the scaler: scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update() "
                    "(scaler.step unscales the gradients and skips a step whose gradients hold Inf/NaN); or call "
                    "scaler.unscale_(optimizer) before optimizer.step() - not a lower learning rate: the gradients "
                    "applied were the scale (65536 at first) times too large").remedy()]
DIVERGE_REMEDIES = [declare("diverge", "lower the learning rate, or clip the gradients (torch.nn.utils.clip_grad_norm_("
                    "model.parameters(), 1.0) before optimizer.step()); check that the inputs are normalised", actions=(LOWER_LR, CLIP)).remedy()]
# two recordings of one command (bundles) that did not read the same data or build the same weights
BUNDLE_DATA_REMEDIES = [declare("bundle-data", "give both machines the same data file (compare its SHA-256) and the same --data, --batch-size "
                        "and --seed, then record again").remedy()]
BUNDLE_INIT_REMEDIES = [declare("bundle-init", "record both with the same --seed and the same model file: the initial weights are built from "
                        "them in float64 on the CPU, so they match on any machine that builds the same model").remedy()]
DATA_REMEDIES = [declare("data-1", "give the DataLoader a seeded generator (DataLoader(..., generator=torch.Generator().manual_seed(s)))"
                 " and its workers a worker_init_fn, or call convcheck.seed_everything(seed) before building it").remedy(),
                 declare("data-2", "check the sampler (shuffle=, DistributedSampler.set_epoch) and num_workers are the same on both").remedy()]
RECIPE_REMEDIES = [declare("same-loss", "make both sides compute the same loss: the loss function and its arguments (label_smoothing=, "
                   "weight=, reduction=), what is added to it (regularisers, auxiliary terms) and how it is scaled; "
                   "then diff again").remedy()]
SCALE_REMEDIES = [declare("same-loss-scale", "a gradient-accumulation loop divides each micro-batch's loss by the number of micro-batches "
                  "(loss / accumulation_steps) before backward(); a loss multiplied by a constant (a fixed loss scale, "
                  "the world size) on one side only: make both sides scale it alike, then diff again").remedy()]

# --- numerics ---------------------------------------------------------------------------------------------
LOSS_SCALE_REMEDIES = [declare("loss-scale-1", "use a dynamic torch.amp.GradScaler (scaler.scale(loss).backward(); scaler.step(optimizer); "
                       "scaler.update()): it lowers the scale when the gradients overflow and skips that step").remedy(),
                       declare("loss-scale-2", "or a smaller fixed scale: the scale times the largest gradient must stay below 65504 in float16", formats={"float16"}).remedy()]
NONFINITE_REMEDIES = [declare("nonfinite", "keep that layer's operation in float32 (autocast(enabled=False) around it), or rescale its "
                      "operands (e.g. divide the scores by sqrt(d) before the matmul)").remedy()]
KEEP_FLOAT32 = declare("keep-float32", "keep that layer's operation in float32 (autocast(enabled=False) around it)").remedy()
LOSS_FLOAT32 = (declare("loss-float32", "compute the loss in float32: outside autocast, on the model's output cast with .float() "
                "(loss_fn(out.float(), y))", actions=LOSS_FLOAT32_CHANGE).remedy())
LAYER_REMEDIES = [declare("layer", "that layer computes less accurately than its precision allows on its own input (the float64 "
                  "judge replayed it from the snapshot): check its implementation (a one-pass variance, a sum in "
                  "a 16-bit type, a cast inside it), or run it in float32").remedy()]
BF16_ZEROS = (declare("bf16-zeros", "bfloat16 keeps float32's range: these zeros are lost digits; compute the layer before it in "
              "float32", formats={"bfloat16"}).remedy())
OUTCOME_STEPS = declare("outcome-steps", "record at least {steps} steps in each run (convcheck.watch around more of the "
                        "loop), so that whether the precisions change how the runs end can be judged against their noise",
                        answers=("precision unjudged",))

PRECISION_PARTING = [declare("precision-parting", "run that layer in float32 on the lower-precision side, or check it against the float64 judge "
                     "with convcheck compare").remedy()]

# --- data-parallel runs: ranks DDP should keep equal ------------------------------------------------------
UNSYNCED_REMEDIES = [declare("unsynced-1", "wrap the model in DistributedDataParallel on every rank and step through the wrapper; use "
                     "no_sync() only on the micro-batches before the last of an accumulated step").remedy(),
                     declare("unsynced-2", "a parameter the forward does not use on some step: DistributedDataParallel(..., "
                     "find_unused_parameters=True)").remedy()]
SET_EPOCH_REMEDIES = [declare("set-epoch", "call sampler.set_epoch(epoch) at the start of every epoch: a DistributedSampler(shuffle=True) "
                      "draws its order from the seed and the epoch, so without it every epoch repeats the first one's "
                      "order (the model sees the same sequence of batches again and again)").remedy()]
UNSHARDED_REMEDIES = [declare("unsharded", "give the DataLoader a DistributedSampler(dataset) (and call sampler.set_epoch(epoch)) so "
                      "that each rank trains on its own share of the data").remedy()]

# --- nondeterminism, version ------------------------------------------------------------------------------
SEED_RANDOM_LAYERS = declare("seed-random-layers", "{layers} draw random numbers: seed both runs identically right before training "
                      "(torch.manual_seed(s), or convcheck.seed_everything(s)) so that their masks match - "
                      "deterministic algorithms do not make two seeds' masks match")
COMPILED_RANDOM = [declare("compiled-random-1", "compare the two with the compiled run's random layers drawing eager's numbers: set "
                   "torch._inductor.config.fallback_random = True before it compiles (or diff with the random layers "
                   "off, p=0); a difference that stays is the compiled kernels' own").remedy(),
                   declare("compiled-random-2", "a compiled model's Dropout masks differ from eager's by design: that alone changes the loss curve, "
                   "not whether the model converges").remedy()]
DETERMINISM_REMEDIES = [declare("determinism", "torch.use_deterministic_algorithms(True) and torch.backends.cudnn.benchmark = False "
                        "on both sides (set CUBLAS_WORKSPACE_CONFIG=:4096:8 on CUDA)", actions=DETERMINISTIC).remedy()]
VERSION_REMEDIES = [declare("version", "run both sides with the same torch / CUDA / cuDNN build, then diff again").remedy()]

# --- a run that stopped -----------------------------------------------------------------------------------
STOPPED_REMEDIES = [declare("stopped", "pass the loss to w.step(loss) before the loop's own NaN check (or let the step end at the "
                    "optimizer's step), then run again and diff: the watch then names the first NaN/Inf producer").remedy()]


# --- compare's remedies that verify can apply (rules/numerics.py, layer.py, setup.py, nondeterminism.py) -----------
# the loss or a layer kept in float32, as the target's kind of precision needs it (``numerics._keep_float32``)
AUTOCAST_OFF_LOSS = declare("autocast-off-loss", "run the loss function '{loss}' in float32: torch.autocast(device_type, "
                            "enabled=False) around it and .float() on its input", answers=(S.NONFINITE_USER_CODE,),
                            actions=LOSS_FLOAT32_CHANGE)
CAST_LOSS_FLOAT32 = declare("cast-loss-float32", "compute the loss function '{loss}' in float32: cast its input with "
                            ".float() (and its result back if needed)", answers=(S.NONFINITE_USER_CODE,),
                            actions=LOSS_FLOAT32_CHANGE)
AUTOCAST_OFF_LAYER = declare("autocast-off-layer", "run '{layer}' in float32: torch.autocast(device_type, enabled=False) "
                             "around it and .float() on its input", actions=FLOAT32_MODULE)
CAST_LAYER_FLOAT32 = declare("cast-layer-float32", "compute '{layer}' in float32: cast its input with .float() (and its "
                             "result back if needed)", actions=FLOAT32_MODULE)
OP_OVERFLOW = declare("op-overflow", "{op} in '{layer}' overflows {narrow}: scale its operands down before it (attention "
                      "energies by 1/sqrt(d)), or run '{layer}' in float32 or bfloat16{autocast}", actions=FLOAT32_MODULE)
AUTOCAST_LAYER_FLOAT32 = declare("autocast-layer-float32", "keep '{layer}' in float32 under autocast (torch.autocast("
                                 "device_type, enabled=False) around it), or use bfloat16 autocast, which has float32's "
                                 "range", actions=FLOAT32_MODULE)
LAYER_BELOW_RANGE = declare("layer-below-range", "keep '{layer}' in float32, or normalise its input so values stay "
                            "below {largest}", actions=FLOAT32_MODULE)
FEEDING_FLOAT32 = declare("feeding-float32", "keep '{layer}' and the tensors feeding it in float32 (its input cannot be "
                          "represented precisely enough at this precision)", actions=FLOAT32_MODULE)
UPDATE_OUT_OF_RANGE = declare("update-out-of-range", "the {opt} update of '{layer}' leaves the range of its {fmt}' "
                              "format: lower the learning rate, clip gradients (--clip-grad-norm), or keep float32 master "
                              "weights (autocast instead of casting the model)", actions=(LOWER_LR, CLIP))
FLOAT16_EPS = declare("float16-eps", "the optimizer computes in the weights' float16: {opt}'s eps ({eps}) is 0 in float16, "
                      "so every zero gradient entry divides 0 by 0; {how}, or keep float32 weights and compute in float16 "
                      "under autocast (amp-fp16) with a GradScaler", actions=RAISE_EPS)
FIND_UPDATE = declare("find-update", "find what makes the update of '{layer}' NaN/Inf: the learning rate, the optimizer's "
                      "eps at this precision, or a division in a custom optimizer; clip gradients (--clip-grad-norm)",
                      actions=CLIP)
DISABLE_TF32 = declare("disable-tf32", "disable TF32: torch.backends.cuda.matmul.allow_tf32 = False; "
                       "torch.backends.cudnn.allow_tf32 = False", actions=TF32_OFF)
LAYER_AUTOCAST_OFF = declare("layer-autocast-off", "run '{layer}' in float32: disable autocast around it (torch.autocast("
                             "device_type, enabled=False)) and cast its input with .float()", actions=FLOAT32_MODULE)
LAYER_IN_CAST_MODEL = declare("layer-in-cast-model", "keep '{layer}' in float32 in the {fmt} model: call .float() on it "
                              "after casting the model, cast its input with .float() and its output back to {fmt}",
                              actions=FLOAT32_MODULE)
DISABLE_TF32_MODEL = declare("disable-tf32-model", "disable TF32 for this model: torch.backends.cuda.matmul.allow_tf32 = "
                             "False; torch.backends.cudnn.allow_tf32 = False", actions=TF32_OFF)
LOWER_LR_10X = declare("lower-lr-10x", "lower the learning rate (try 10x smaller)", actions=LOWER_LR).remedy()
CLIP_GRADIENTS = declare("clip-gradients", "clip gradients: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
                         actions=CLIP).remedy()
LOWER_LR_PLAIN = declare("lower-lr", "lower the learning rate", actions=LOWER_LR).remedy()
LOWER_LR_DEAD = declare("lower-lr-dead-relus", "lower the learning rate (a too-large step can push them there)",
                        actions=LOWER_LR).remedy()
LOWER_LR_WARMUP = declare("lower-lr-warm-up", "lower the learning rate or add warm-up", actions=LOWER_LR)
DETERMINISTIC_KERNELS = declare("deterministic-kernels", "torch.use_deterministic_algorithms(True) and "
                                "torch.backends.cudnn.benchmark = False", actions=DETERMINISTIC)
CUBLAS_WORKSPACE = declare("cublas-workspace", "set CUBLAS_WORKSPACE_CONFIG=:4096:8 before CUDA starts")
LOWER_DECAY = declare("lower-weight-decay", "lower the weight decay until lr x weight_decay, the fraction of the weights "
                      "it removes every step, is 1e-4 or less (e.g. 5e-4 at lr 0.1, 1e-2 at lr 0.01)",
                      actions=LOWER_WEIGHT_DECAY).remedy()


# --- remedies name only the formats the runs used (issue 43) ----------------------------------------------
def only_used_formats(remedies, used: set[str]) -> list:
    """``remedies`` naming only the reduced-precision formats in ``used`` (the one rule, applied by the watched
    verdicts' builder ``analysis/verdict.py``; ``catalogue.offered``: each entry's declared ``formats``): an
    alternation (``bf16/fp16``) keeps the formats used; a switch offered from an unused format (``, or bfloat16
    instead of float16`` to a bfloat16 run) is its entry's ``otherwise``; a remedy still naming a format no run
    used is dropped, and when none is left, the general fix (float32) is given."""
    return offered(remedies, used, KEEP_FLOAT32)
