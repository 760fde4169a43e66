"""Every threshold convcheck decides with, named once, each with the source it was taken from.

No other module writes a threshold as a literal: detectors, rules and training
read them from here. This module imports nothing (``convcheck --help`` stays light).
"""

# AUTOTRAINER (ICSE'21, utils/monitor.py): loss >= 1e3 is treated like NaN.
LOSS_NAN_LIKE = 1e3
# Exploding: the global gradient norm grows > 70x over the run (AUTOTRAINER's factor 70,
# which it applies to the first/last layer ratio).
EXPLODING_LAYER_RATIO = 70.0
# AUTOTRAINER: vanishing when ||g_first||/||g_last|| < 1e-3 and ||g_first|| < 1e-4.
VANISHING_LAYER_RATIO = 1e-3
VANISHING_FIRST_NORM = 1e-4
# DeepDiagnosis: dead node when >= 70% of ReLU outputs are <= 0; saturated sigmoid/tanh
# when > 50% of pre-activations lie outside +-5.
DEAD_RELU_FRACTION = 0.7
SATURATED_FRACTION = 0.5
SATURATED_ABS = 5.0
# Dead/saturated fractions are averaged over the last 3 recorded steps (convcheck's choice:
# one step is noisy, and DeepDiagnosis judges the state at the end of training).
ACTIVATION_TAIL_STEPS = 3
# DeepDiagnosis: effective learning rate lr*||dW||/||W|| outside [1e-5, 0.1].
UPDATE_RATIO_HIGH = 0.1
# Plateau: the loss stays within 10% of chance, ln(C), over the second half of the run and
# falls by less than 2% of ln(C) across it (a loss still falling steadily is not stuck).
PLATEAU_TOLERANCE = 0.10
PLATEAU_MIN_DROP = 0.02
PLATEAU_MIN_STEPS = 5  # a half-run shorter than this says nothing about a plateau
# Still falling (issue 10, convcheck's own): over the second half of the run (at least
# FALLING_MIN_POINTS losses) a least-squares line falls, by more than FALLING_SIGNIFICANCE times
# the spread of the losses around it. Such a loss is no plateau; a run that misses the
# convergence rule with it says "still falling: run more steps".
FALLING_MIN_POINTS = 6
FALLING_SIGNIFICANCE = 3.0
# AUTOTRAINER oscillation: swings of >= 3% in >= 20% of the checks.
OSCILLATION_SWING = 0.03
OSCILLATION_SHARE = 0.2
# convcheck's own additions to that rule (f10b515, no paper): it needs at least 6 finite
# losses (4 direction checks), and the loss must not be falling: the last finite loss is still
# >= 0.9x the first (the same factor as the default convergence ratio, CONVERGED_LOSS_RATIO).
OSCILLATION_MIN_STEPS = 6
OSCILLATION_NOT_FALLING = 0.9
# Learning rate too high: the last loss is above 1.5x the first ("loss rose"). convcheck's own
# factor (f10b515), next to AUTOTRAINER's gradient-growth factor below; a loss that rises by half
# its starting value is not noise.
LOSS_RISE_FACTOR = 1.5
# Un-normalised input: features far outside the usual standardised range (raw 0..255 pixels).
INPUT_ABS_MAX = 20.0
INPUT_STD_MAX = 10.0
# Underflow: a target's gradients hold this many more exact zeros than the judge's (fraction).
UNDERFLOW_EXTRA_ZEROS = 0.3
# GradScaler: skipping more than a quarter of the steps, or a scale below 1 (>= 16 net
# halvings from 2^16: the forward pass itself overflows; FACTS.md "Mixed precision").
SKIP_RATE_HIGH = 0.25
SCALE_COLLAPSED = 1.0
# Envelope: drift between the targets within ENVELOPE_BENIGN x the envelope is noise; drift
# beyond ENVELOPE_FAR x for ENVELOPE_RUN consecutive steps inside the first half of the run
# ("early and by far") is a real discrepancy. Measured on LeNet: float32 vs float64 stays
# within 2x of the float32 envelope (ARCHITECTURE.md, "The noise envelope").
ENVELOPE_BENIGN = 4.0
ENVELOPE_FAR = 10.0
ENVELOPE_RUN = 3
# An envelope spread of exactly zero (identical runs) is floored at this before dividing by it,
# so the drift ratio is huge but finite; far below any float64 spread (smallest normal 2.2e-308).
ENVELOPE_SPREAD_FLOOR = 1e-300
# Outcome: a final loss outside the envelope runs' range widened by this many spreads
# (plus 5% of their mean) is a different outcome.
OUTCOME_SPREADS = 3.0
OUTCOME_RELATIVE = 0.05
# Same-precision drift beyond this many times the envelope's spread is never a note of ``ok``: reduction
# order alone was measured at up to ~14x (docs/ARCHITECTURE.md, the per-step null model); a data-parallel
# setup that trains another model at 1e4-1e5x.
DRIFT_NOTE_MAX = 1e3
# Without an envelope, an unconverged target is only a finding when its final loss is above the
# judge's by OUTCOME_RELATIVE plus this absolute slack (1db6312): a judge that reaches a loss of
# exactly 0 does not make any positive rounding residue "worse".
OUTCOME_ABSOLUTE = 1e-12
# A target that converges but ends above this many times the judge's final loss (and above it by
# OUTCOME_RELATIVE of the loss's scale), while the other target and every envelope run end with the
# judge, ends apart from it: its precision changed the outcome (convcheck's choice, stop 33: a float16
# sum of squares overflowing inside a module's own code, zeroed after it, ended 5.2x the judge).
APART_FACTOR = 2.0

# Convergence: every loss finite and the mean of the last three losses below this fraction of
# the first (Tolerances.converged_loss_ratio is the user's knob; this is its default).
CONVERGED_LOSS_RATIO = 0.9
CONVERGED_TAIL = 3
# Convergence is judged from this many steps on: the rule averages the last 3 losses against the
# first, so fewer steps say nothing about it (2 steps of ResNet-50 must not count as converged, nor
# as a failed setup); a shorter run's verdict says convergence was not judged.
CONVERGENCE_MIN_STEPS = 5
# A run shorter than this (compare's default length) whose float64 judge shows only a slow start - not
# converged, a loss near chance, a per-batch loss that swings - while the targets track it is no setup
# failure (issue 24 item 4): short runs are what pytest users write, and a small batch's loss swings by
# more than the oscillation rule's 3% from batch to batch. convcheck's own choice; ``ok`` notes what it saw.
SETUP_MIN_STEPS = 30
# An envelope run counts as failed when it ends this much (relative) above the run it perturbs.
FRAGILE_MARGIN = 0.10
# Below this a norm counts as zero (a relative error of a cancelled reference is meaningless;
# a first gradient norm below it is floored at it before the growth factor is taken).
TINY_NORM = 1e-30

# --- layer floors (convcheck.measure.parity.floor, Tolerances.is_flagged) ----------------------------
# A row is flagged above bound_factor x its measured floor plus this absolute term: what float32
# kernels add beyond the rounding of their operands and result. Healthy float32 rows on this CPU
# reach 10x their floor (ResNet-50 convs: 3.6e-7 against 3.6e-8) and 13x for a BatchNorm over 2
# values (5.3e-7 against 4.1e-8); the H200's float32 kernels 1.3e-7..2.0e-7 (5.6x; gpu-runs/
# h200-2026-11-30). 4e-7 keeps them all unflagged and still flags a float32 conv wrong by ~9x its
# noise (K = 9: noise 6.2e-8). For 16-bit and TF32 targets (floors 1e-4..1e-2) it is negligible.
# Measured: benchmarks/floors.py (benchmarks/results/floors-*.md).
FLOOR_ABSOLUTE = 4e-7

# A normalization's mean and variance are sums over K values (a BatchNorm's batch and positions). A float32 kernel
# vectorised over SUM_LANES accumulators (a 512-bit register's float32 lanes), each summing K / SUM_LANES values one
# after another, errs by about u * sqrt(K / SUM_LANES) relative to the spread it divides by (times how far the values
# sit from their mean, ``floor.normalization_spread``); the part beyond FLOOR_ABSOLUTE raises a flagged row's floor.
# Measured: the CPU's channels_last BatchNorm2d in training, 0.10-0.25 u * sqrt(K) at K = 1,024..65,536 (3.9e-6 on
# 16x32x64x64, against 3.9e-8 for the contiguous kernel; tests/watch/test_watch_normalization_floor.py): within the
# bound; a BatchNorm over 288 values wrong by 10x its noise (1e-6) still flagged (tests/measure/test_floor.py).
SUM_LANES = 16
# A relative error this large means the result is mostly lost: flagged whatever the factor,
# unless the floor itself is this large (then the layer is ill-conditioned at that precision:
# a numerics finding naming it, not a layer that computes something else).
DESTROYED_ERROR = 0.5
# A parameter gradient sums K = batch x output positions terms; float32 kernels add up to
# 0.39 u sqrt(K) beyond the rounding of their operands there (the zoo on this CPU, K 4..25088;
# benchmarks/floors.py), so a gradient's floor includes GRAD_ACCUMULATION x u_accumulate x sqrt(K).
# Forward reductions (K <= 4608, blocked kernels) showed no such growth.
GRAD_ACCUMULATION = 0.25

# --- the user's recipe (convcheck.diagnose.detectors.recipe) --------------------------------------------
# A loss whose batch value is 1.6-2.4x the mean of its halves' values is summed, not averaged
# (exactly 2 for a sum; 1 for a mean; the band allows for the halves' different contents).
SUMMED_LOSS_LOW = 1.6
SUMMED_LOSS_HIGH = 2.4
# A learning rate rising by more than this factor from one step to the next is a jump of the schedule.
LR_JUMP_FACTOR = 1.5
# A divergence within this many steps after a warm-up end or a jump is blamed on the schedule.
SCHEDULE_WINDOW = 2
# Clipping that acts on at least this share of the steps is too tight (it rescales every update).
CLIPPED_SHARE = 0.9
# Weight decay too strong for training to undo: each step multiplies the weights by (1 - lr x weight_decay)
# (SGD's coupled decay; AdamW's decoupled one, Loshchilov & Hutter 2019, is lr x wd too), so they lose a
# fraction lr x wd per step and an e-fold in 1/(lr x wd) steps. Common recipes sit at 1e-6..1e-4 (ResNet-50:
# SGD lr 0.1 x wd 1e-4 = 1e-5, Goyal et al. 2017; GPT-3: AdamW lr 6e-4 x wd 0.1 = 6e-5, Brown et al. 2020;
# torch's AdamW defaults 1e-3 x 1e-2 = 1e-5), while the gradient moves the weights by ~1e-3 of their norm a
# step (the update/weight ratio rule of thumb, CS231n's
# "Neural Networks Part 3"). At 1e-2 the decay outruns that 10x and is 100x past the common
# recipes: an e-fold every 100 steps (a quarter of the weights gone in a 30-step run). Read only when the
# float64 judge fails too.
DECAY_PER_STEP_HIGH = 1e-2

# --- watched runs (convcheck.watch + diff; the pair rules of diagnose/rules/watched.py) ---------------------
# Two watched runs' values differ beyond rounding past this many unit roundoffs of the coarser dtype (relative
# norm, element by element at a snapshot step; relative to the layer's std for its output statistics).
PART_FACTOR = 16
# The smallest relative loss difference that parts two runs (a float32 pair's reductions in another order).
LOSS_RTOL = 1e-3
# A learning rate or setting given as a float32 tensor (lr=torch.tensor(1e-3)) is the same as the float.
LR_RTOL = 1e-6
# One watched run alone, without a judge: a finite loss above this many times its first value diverged; so
# did a loss that never falls below its first value and ends at RISE_FACTOR times it, over at least
# RISE_MIN_STEPS steps (a 3-step run rising from a noisy first loss says little). Stricter than compare's
# LOSS_RISE_FACTOR (1.5, read on a float64 judge's smooth curve): a user's loop logs per-batch losses,
# which swing by more than half from one batch to the next.
EXPLODE_FACTOR = 10.0
RISE_FACTOR = 2.0
RISE_MIN_STEPS = 4
# Two runs at different precisions whose losses wander apart step by step still "end alike" when, with no
# step's gap above LOSS_SPIKE of the first loss, their final losses (the means of the last tenth of the
# steps) are within ENDS_ALIKE_RATIO of each other, or within the precision's tolerance of the final loss,
# or within ENDS_ALIKE_FALL of how far the loss fell (two runs converging near 0 from 2.4, at 0.0013 and
# 0.0047). A bf16 run ending at 0.197 beside float32's 0.18 ends alike; one ending at 0.15 beside 0.04
# (both from 2.3), or spiking to 5.0 mid-run, parts.
ENDS_ALIKE_RATIO = 1.25
ENDS_ALIKE_FALL = 0.01
LOSS_SPIKE = 0.5
# A gradient-norm ratio between two runs is one loss scale when every parameter's ratio (at step 0, same
# weights and batch) lies within this (relative) of their median, or within PART_FACTOR roundoffs of the
# coarser dtype, whichever is larger: accumulation over 4 micro-batches not divided by 4 gives 4.000x for
# every parameter; a changed loss (label smoothing, class weights) moves each parameter's gradient differently.
SCALE_RATIO_SPREAD = 1e-3
# Gradient clipping seen in a watched run: its global gradient norm at the optimizer's step pinned at its maximum
# (clip_grad_norm_ scales every larger gradient to max_norm x (1 - 1e-6 / norm)) within this (relative), at this
# many steps or more; a norm that happens to peak once is no clipping.
CLIP_PINNED_RTOL = 1e-4
CLIP_PINNED_MIN = 3

# --- data-parallel targets (convcheck/ddp/: diagnostics.py, parity.py) -------------------------------------
# A rank's BatchNorm statistics differ from the global batch's when some channel's mean is more than
# BN_MEAN_SHIFT global standard deviations away, or its standard deviation off by more than BN_STD_CHANGE
# (relative). Batch statistics of n samples scatter by ~1/sqrt(n) std: per-rank batch 2 gives ~0.7, a
# per-rank batch of 256 ~0.06; float32 reduction order changes them by ~1e-7. 0.05 separates a per-rank
# normalisation from reduction-order noise by five orders of magnitude.
BN_MEAN_SHIFT = 0.05
BN_STD_CHANGE = 0.05
# The DDP/single-device ratio of the first step's gradient norm within this (relative) of world or 1/world.
LOSS_SCALE_TOLERANCE = 0.05
# A DDP parity row (the averaged gradient after the all-reduce, against the judge's) this many times beyond
# its bound (itself DDP_GRAD_FACTOR times the single-device error: reduction order only) is a data-parallel
# setup that computes another gradient than one device at step 0, before any drift. Measured on the trial
# models: healthy setups (an MLP, SyncBatchNorm at 2 per rank) stay below 0.2x their bound; a per-rank
# BatchNorm at 2 per rank reaches 1.5e4x, a user's running mean of the rank's slice 6.5e3x.
GRAD_FAR = 100.0
# ... unless only a per-rank BatchNorm explains it and the gradient's relative error stays within this: the
# approximation plain BatchNorm under DDP makes at a larger per-rank batch (a user's BatchNorm CNN at 16 per
# rank: 0.107, ending alike, a note by the outcome rule); at 2 per rank it was 0.47-0.87, at 1 per rank more.
BN_GRAD_TOLERATED = 0.2
# ... or whatever the gradient's error, when each rank normalises at least this many samples: per-rank BatchNorm
# is then the standard recipe (torchvision's references; ResNet-50 with plain DDP at 32 per GPU), judged by its
# outcome. Below it the statistics of a slice scatter enough to change training: ImageNet ResNet-50's error with
# BatchNorm grows from 23.6% at 32 per GPU to 24.8% at 8, 27.3% at 4, 34.7% at 2 (Wu & He, Group Normalization,
# ECCV 2018, Fig. 1); cifar_cnn at 16 per rank: 0.44 relative gradient error at step 0, ending alike.
BN_RANK_BATCH_OK = 8
# A DDP gradient may differ from the judge's by this many times the single-device error (reduction
# order only) before the row is flagged; and by at least DDP_GRAD_MIN_U units of roundoff.
DDP_GRAD_FACTOR = 10.0
DDP_GRAD_MIN_U = 100.0

# --- the watched diff's causal walk and outcome (issue 42; diagnose/detectors/watched_causal.py) ------------------
# One run's step-k gradient is its step-(k-1) one plus the other run's step-k one when that sum fits its entries
# to within ACCUMULATION_FIT of the plain difference (accumulation explains at least 90% of it).
ACCUMULATION_FIT = 0.1
# Two runs end alike when their final losses (the means of the last OUTCOME_TAIL share of the aligned steps, at
# least 3) are within NOISE_FACTOR x the quieter run's batch-to-batch spread around its trend there (a seed
# change's estimate: a seed moves a final loss by about its per-batch spread) plus the precision's loss
# tolerance; fewer than OUTCOME_MIN_STEPS aligned steps are too few to judge convergence.
OUTCOME_TAIL = 0.2
NOISE_FACTOR = 3.0
OUTCOME_MIN_STEPS = 10
# A finite loss that rises (RISE_FACTOR) but not far (EXPLODE_FACTOR) diverges only with the parameters blowing up:
# the weights' global norm at WEIGHT_BLOWUP x its first, or a gradient norm that is not finite (a GAN's generator
# loss rises by design while its weights grow 1.2x over 60 steps; least squares past its stable lr: 1.9x in 4).
WEIGHT_BLOWUP = 1.5
# Gradients that part before the data, the layers' outputs and the loss (a loss term's sign or weight, a second
# backward) are held to BACKWARD_RTOL at least (relative norm): above the run-to-run noise of nondeterministic
# GPU reductions (~1e-6), far below a flipped term's effect.
BACKWARD_RTOL = 1e-4
# A parameter whose gradient norm is below GRAD_SHARE of the step's global gradient norm is held to that share, not
# to itself: a bias feeding a BatchNorm has a gradient that is zero but for rounding (6e-8 against 8e-8, a 35% gap
# between eager and inductor) and says nothing of the backward.
GRAD_SHARE = 1e-3

# A compiled run's backends re-run on its recorded step (``analysis/backends.py``, issue 43): a backend whose output or
# parameter gradients differ from eager's by more than this (relative L2), or are exactly zero where eager's are
# not, is where the compiled result changes. Fused kernels reorder float32 sums: ~1e-6 relative; 1e-3 leaves that
# a thousandfold margin while a real difference (a gradient of 0 against 0.05) is a relative 1.
BACKEND_RTOL = 1e-3

# What verify changes to apply a remedy (``diagnose/catalogue.py``'s stock changes, ``verify/actions.py``): Adam/AdamW's
# eps raised to one float16 represents (its default 1e-8 is 0 there); "lower the learning rate (try 10x smaller)";
# gradients clipped as torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); "lower the weight decay" to the low end
# of the usual 1e-4..1e-2, safe at any lr.
RAISED_EPS = 1e-4
LR_FACTOR = 0.1
CLIP_NORM = 1.0
LOWERED_WEIGHT_DECAY = 1e-4
