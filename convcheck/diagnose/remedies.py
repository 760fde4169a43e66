"""Remedies as the verdicts give them, written once: the watched-run rules' (``rules/watched.py``) and the
setup detectors' (``detectors/watched_setup.py``), and those ``compare``'s rules share with them.

A remedy here is the text a user reads; ``verify/actions.py`` holds the ones convcheck can apply and re-run."""

from __future__ import annotations

# --- shared with compare ----------------------------------------------------------------------------------
MASTER_WEIGHTS = "keep float32 master weights (autocast instead of casting the model to bf16/fp16)"
GRAD_SCALER_UNDERFLOW = "use torch.amp.GradScaler to scale the loss, or bfloat16 instead of float16"

# --- setup: what two runs were given differently ---------------------------------------------------------
OPTIMIZER_REMEDIES = ["build the same optimizer on both sides (its class and its hyperparameters), then diff again"]
LR_REMEDIES = ["give both runs the same learning rate and schedule (the optimizer's lr=, the scheduler and where "
               "its step() is called), then diff again"]
INIT_REMEDIES = ["seed the model's construction identically on both sides (torch.manual_seed(s) right before "
                 "building it), or load the same initial state_dict into both (model.load_state_dict(...)), "
                 "then diff again"]
BISECT_BACKENDS = ("bisect the compiler: convcheck diff A B --backends re-runs the recorded step under eager, aot_eager "
                   "and inductor and names the first backend whose result changes (with --out, a repro script to "
                   "attach to a PyTorch bug report)")
KERNEL_ZEROS = ("compare that layer against the float64 judge (convcheck diff RUN --judge cpu:float64): a float32 "
                "kernel that returns exact zeros where another does not computes something else")
PYTHON_ORDER = ("iterate in a fixed order in your own code (sorted(...) over a set's or a dict's keys, a list instead "
                "of a set), or start both runs with the same PYTHONHASHSEED (PYTHONHASHSEED=0 python train.py): "
                "torch's deterministic algorithms do not reach an order in Python")
TARGET_REMEDIES = ["give both runs the same targets: the same labels for the same inputs (a label offset, a class "
                   "mapping or a target transform applied on one side only), then diff again"]
MODEL_REMEDIES = ["build the same model on both sides (each layer with the same arguments: Dropout's p, BatchNorm's "
                  "momentum and eps...), then diff again"]
GROUP_REMEDIES = ["build both optimizers with the same parameter groups: each parameter in the group with the same "
                  "settings on both sides (e.g. weight decay off for the norms and biases in both, or in neither), "
                  "then diff again"]
FREEZE_REMEDIES = ["train the same parameters on both sides: the same requires_grad for each (and unfreeze at the same "
                   "step), every trained parameter in the optimizer and reached by the loss, then diff again"]
ACCUMULATION_REMEDIES = ["call optimizer.zero_grad() once per optimizer step (before backward()): without it every "
                         "step's gradient is added to the ones before it"]
BACKWARD_REMEDIES = ["make both sides run the same backward: the same loss.backward() calls per step, no gradient "
                     "hook or manual change of .grad on one side only, then diff again"]
TRAIN_MODE_REMEDIES = ["call model.train() before training again after an evaluation (model.eval() switches BatchNorm "
                       "to its running statistics and Dropout off), then diff again"]
SCALER_REMEDIES = ["give both runs the same GradScaler settings (init_scale, growth_interval), then diff again: a "
                   "GradScaler skips the steps whose scaled gradients overflow while it lowers its scale"]
CLIP_REMEDIES = ["clip on both sides or neither, at the same max_norm: torch.nn.utils.clip_grad_norm_(model.parameters(), "
                 "max_norm) between backward() and optimizer.step() (after scaler.unscale_(optimizer) under a "
                 "GradScaler), then diff again"]
UNSCALE_BEFORE_CLIP = ["call scaler.unscale_(optimizer) before clip_grad_norm_: scaler.scale(loss).backward(); "
                       "scaler.unscale_(optimizer); torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm); "
                       "scaler.step(optimizer); scaler.update() - clipped while scaled, the true gradients are held to "
                       "max_norm / scale"]
STEP_WITH_SCALER = ["step through the scaler: scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update() "
                    "(scaler.step unscales the gradients and skips a step whose gradients hold Inf/NaN); or call "
                    "scaler.unscale_(optimizer) before optimizer.step() - not a lower learning rate: the gradients "
                    "applied were the scale (65536 at first) times too large"]
DIVERGE_REMEDIES = ["lower the learning rate, or clip the gradients (torch.nn.utils.clip_grad_norm_("
                    "model.parameters(), 1.0) before optimizer.step()); check that the inputs are normalised"]
# two recordings of one command (bundles) that did not read the same data or build the same weights
BUNDLE_DATA_REMEDIES = ["give both machines the same data file (compare its SHA-256) and the same --data, --batch-size "
                        "and --seed, then record again"]
BUNDLE_INIT_REMEDIES = ["record both with the same --seed and the same model file: the initial weights are built from "
                        "them in float64 on the CPU, so they match on any machine that builds the same model"]
DATA_REMEDIES = ["give the DataLoader a seeded generator (DataLoader(..., generator=torch.Generator().manual_seed(s)))"
                 " and its workers a worker_init_fn, or call convcheck.seed_everything(seed) before building it",
                 "check the sampler (shuffle=, DistributedSampler.set_epoch) and num_workers are the same on both"]
RECIPE_REMEDIES = ["make both sides compute the same loss: the loss function and its arguments (label_smoothing=, "
                   "weight=, reduction=), what is added to it (regularisers, auxiliary terms) and how it is scaled; "
                   "then diff again"]
SCALE_REMEDIES = ["a gradient-accumulation loop divides each micro-batch's loss by the number of micro-batches "
                  "(loss / accumulation_steps) before backward(); a loss multiplied by a constant (a fixed loss scale, "
                  "the world size) on one side only: make both sides scale it alike, then diff again"]

# --- numerics ---------------------------------------------------------------------------------------------
LOSS_SCALE_REMEDIES = ["use a dynamic torch.amp.GradScaler (scaler.scale(loss).backward(); scaler.step(optimizer); "
                       "scaler.update()): it lowers the scale when the gradients overflow and skips that step",
                       "or a smaller fixed scale: the scale times the largest gradient must stay below 65504 in float16"]
NONFINITE_REMEDIES = ["keep that layer's operation in float32 (autocast(enabled=False) around it), or rescale its "
                      "operands (e.g. divide the scores by sqrt(d) before the matmul)"]
KEEP_FLOAT32 = "keep that layer's operation in float32 (autocast(enabled=False) around it)"
LOSS_FLOAT32 = ("compute the loss in float32: outside autocast, on the model's output cast with .float() "
                "(loss_fn(out.float(), y))")
LAYER_REMEDIES = ["that layer computes less accurately than its precision allows on its own input (the float64 "
                  "judge replayed it from the snapshot): check its implementation (a one-pass variance, a sum in "
                  "a 16-bit type, a cast inside it), or run it in float32"]
BF16_ZEROS = ("bfloat16 keeps float32's range: these zeros are lost digits; compute the layer before it in "
              "float32")
PRECISION_PARTING = ["run that layer in float32 on the lower-precision side, or check it against the float64 judge "
                     "with convcheck compare"]

# --- data-parallel runs: ranks DDP should keep equal ------------------------------------------------------
UNSYNCED_REMEDIES = ["wrap the model in DistributedDataParallel on every rank and step through the wrapper; use "
                     "no_sync() only on the micro-batches before the last of an accumulated step",
                     "a parameter the forward does not use on some step: DistributedDataParallel(..., "
                     "find_unused_parameters=True)"]
SET_EPOCH_REMEDIES = ["call sampler.set_epoch(epoch) at the start of every epoch: a DistributedSampler(shuffle=True) "
                      "draws its order from the seed and the epoch, so without it every epoch repeats the first one's "
                      "order (the model sees the same sequence of batches again and again)"]
UNSHARDED_REMEDIES = ["give the DataLoader a DistributedSampler(dataset) (and call sampler.set_epoch(epoch)) so "
                      "that each rank trains on its own share of the data"]

# --- nondeterminism, version ------------------------------------------------------------------------------
SEED_RANDOM_LAYERS = ("{layers} draw random numbers: seed both runs identically right before training "
                      "(torch.manual_seed(s), or convcheck.seed_everything(s)) so that their masks match - "
                      "deterministic algorithms do not make two seeds' masks match")
COMPILED_RANDOM = ["compare the two with the compiled run's random layers drawing eager's numbers: set "
                   "torch._inductor.config.fallback_random = True before it compiles (or diff with the random layers "
                   "off, p=0); a difference that stays is the compiled kernels' own",
                   "a compiled model's Dropout masks differ from eager's by design: that alone changes the loss curve, "
                   "not whether the model converges"]
DETERMINISM_REMEDIES = ["torch.use_deterministic_algorithms(True) and torch.backends.cudnn.benchmark = False "
                        "on both sides (set CUBLAS_WORKSPACE_CONFIG=:4096:8 on CUDA)"]
VERSION_REMEDIES = ["run both sides with the same torch / CUDA / cuDNN build, then diff again"]

# --- a run that stopped -----------------------------------------------------------------------------------
STOPPED_REMEDIES = ["pass the loss to w.step(loss) before the loop's own NaN check (or let the step end at the "
                    "optimizer's step), then run again and diff: the watch then names the first NaN/Inf producer"]


# --- remedies name only the formats the runs used (issue 43) ----------------------------------------------
import re as _re  # noqa: E402 - the one place this module needs it

_FORMAT_NAMES = {"float16": r"float16|fp16", "bfloat16": r"bfloat16|bf16", "tf32": r"tf32",
                 "fp8": r"fp8|float8\w*|e4m3\w*|e5m2\w*"}
_FORMAT_RE = {f: _re.compile(rf"(?<![\w.]){p}(?![\w])", _re.IGNORECASE) for f, p in _FORMAT_NAMES.items()}
_SLASHED = _re.compile(r"\b([\w.]+(?:/[\w.]+)+)\b")
_SWITCH = _re.compile(r",? or (\w+) instead of (\w+)", _re.IGNORECASE)


def formats_named(text: str) -> set[str]:
    """The reduced-precision formats (float16, bfloat16, TF32, FP8) ``text`` names; float32/float64 are the general
    fix and never counted."""
    return {f for f, rx in _FORMAT_RE.items() if rx.search(text)}


def only_used_formats(remedies, used: set[str]) -> list[str]:
    """``remedies`` naming only the reduced-precision formats in ``used`` (the one rule, applied by the watched
    verdicts' builder ``analysis/verdict.py``): an alternation (``bf16/fp16``) keeps the formats used; a switch offered
    from an unused format (``, or bfloat16 instead of float16`` to a bfloat16 run) is cut; a remedy still naming a
    format no run used is dropped, and when none is left, the general fix (float32) is given."""
    out = []
    for r in remedies:
        def trim(m):
            parts = m.group(1).split("/")
            kept = [p for p in parts if not formats_named(p) or formats_named(p) <= used]
            return "/".join(kept) if kept else m.group(1)

        text = _SLASHED.sub(trim, r)
        text = _SWITCH.sub(lambda m: m.group(0) if formats_named(m.group(2)) <= used else "", text)
        if formats_named(_SWITCH.sub("", text)) - used:  # a switch kept names its target, offered from a used one
            continue
        out.append(text)
    if remedies and not out:
        out.append(KEEP_FLOAT32)
    return out
