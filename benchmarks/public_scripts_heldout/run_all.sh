#!/usr/bin/env bash
# A held-out set of five public training scripts from pytorch/examples (commit 77f55b9) under convcheck.watch,
# none of them used by benchmarks/public_scripts.sh: time_sequence_prediction (LSTMCell + LBFGS, float64),
# mnist_rnn (LSTM + BatchNorm1d + Dropout2d, Adadelta), siamese_network (ResNet twin + BCELoss, Adadelta + StepLR),
# gcn (sparse GraphConv, Adam), gat (dense multi-head graph attention, Adam).
# Each is changed only by the watch's lines and two switches (PRECISION=fp32|bf16: bf16 autocast on the CPU around
# the forward and the loss; FAULT=none|<one planted fault>): see watch_edits.patch (the diff against orig/).
# Runs per script: A = fp32/none, B = bf16/none, A2 = A again, C = fp32/<fault>; diffs A-B, A-A2 (truth ok), A-C
# (truth setup). siamese also U = A without seeding Python's `random` (the script seeds only torch): A-U, truth setup.
# usage: run_all.sh [SCRIPT ...]     env: DIFF_ONLY=1 keeps the recorded runs and only diffs again
#        PYTHON (default python), CONVCHECK (default convcheck): the venv of /work/main
#        PS_DIR   where the scripts, the synthetic data and the runs go (default ${TMPDIR:-/tmp}/convcheck-public-scripts-
#                 heldout; keep it outside the repository: the tests never depend on it or on the network); this
#                 folder's patch, shims and tools are copied there once
#        EXAMPLES_GIT  a git dir of pytorch/examples holding the commit (default: a bare clone of EXAMPLES_SRC,
#                 https://github.com/pytorch/examples.git, made once in $PS_DIR)
set -u -o pipefail
HARNESS=$(cd "$(dirname "$0")" && pwd)
PS_DIR=${PS_DIR:-${TMPDIR:-/tmp}/convcheck-public-scripts-heldout}
mkdir -p "$PS_DIR"
for f in watch_edits.patch tools shim shim-seed; do [ -e "$PS_DIR/$f" ] || cp -r "$HARNESS/$f" "$PS_DIR/"; done
PYTHON=${PYTHON:-python}
CONVCHECK=${CONVCHECK:-convcheck}
RUNS=$PS_DIR/runs
SCRIPTS=("$@")
[ ${#SCRIPTS[@]} -gt 0 ] || SCRIPTS=(time_sequence_prediction mnist_rnn siamese_network gcn gat)
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

setup() {  # the scripts at the commit, patched; the synthetic data
  local C=77f55b912142e11fcfdf5b530231fb9c52f181e8 G=${EXAMPLES_GIT:-$PS_DIR/examples.git} f
  if ! git --git-dir="$G" rev-parse -q --verify "$C^{commit}" >/dev/null 2>&1; then
    git clone -q --bare --filter=blob:none "${EXAMPLES_SRC:-https://github.com/pytorch/examples.git}" "$G" \
      || { echo "cannot read pytorch/examples: set EXAMPLES_GIT to a clone holding $C" >&2; exit 2; }
  fi
  local files="time_sequence_prediction/train.py mnist_rnn/main.py siamese_network/main.py gcn/main.py gat/main.py"
  for f in $files; do
    if [ ! -f "$PS_DIR/orig/$f" ]; then
      mkdir -p "$PS_DIR/orig/$(dirname $f)"
      git --git-dir="$G" show "$C:$f" > "$PS_DIR/orig/$f" || exit 2
    fi
  done
  for f in $files; do
    if [ ! -f "$PS_DIR/examples/$f" ]; then
      rm -rf "$PS_DIR/examples" && cp -r "$PS_DIR/orig" "$PS_DIR/examples"
      (cd "$PS_DIR/examples" && patch -s -p1 < "$PS_DIR/watch_edits.patch") || { echo "patch failed" >&2; exit 2; }
      break
    fi
  done
  mkdir -p "$PS_DIR/data" "$RUNS"
  # time_sequence_prediction's generate_sine_wave.py, same formula and seed, 13 sequences of length 100 (not 100 x 1000)
  [ -f "$PS_DIR/data/traindata.pt" ] || "$PYTHON" "$PS_DIR/tools/make_sine.py" "$PS_DIR/data/traindata.pt" 13 100
  # a synthetic Cora (1800 nodes: the scripts' splits need > 1600), served by the requests shim
  [ -f "$PS_DIR/data/cora.tgz" ] || "$PYTHON" "$PS_DIR/tools/make_cora.py" "$PS_DIR/data/cora.tgz" 1800 200
}

declare -A FILE ARGS ENVS FAULT TRUTH
FILE[time_sequence_prediction]=time_sequence_prediction/train.py
ARGS[time_sequence_prediction]="--steps 12"
# the script saves/loads a numpy array with torch.load (weights_only=True by default since torch 2.6 refuses it)
ENVS[time_sequence_prediction]="TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1"
FAULT[time_sequence_prediction]=no_zero_grad_closure
TRUTH[time_sequence_prediction]="setup: optimizer.zero_grad() removed from C's LBFGS closure: gradients accumulate over the closure's evaluations and steps"
FILE[mnist_rnn]=mnist_rnn/main.py
ARGS[mnist_rnn]="--epochs 2 --batch-size 16 --log-interval 10 --lr 1.0"  # the default lr 0.1 does not learn in 40 steps
ENVS[mnist_rnn]="PS_MNIST_N=480"
FAULT[mnist_rnn]=no_train_mode
TRUTH[mnist_rnn]="setup: model.train() removed from C's train(): epoch 2 (from step 30) trains in eval mode after test()"
FILE[siamese_network]=siamese_network/main.py
ARGS[siamese_network]="--epochs 1 --batch-size 16 --test-batch-size 64 --log-interval 10"
ENVS[siamese_network]="PS_MNIST_N=480 PS_SEED_PYRANDOM=0"
FAULT[siamese_network]=sched_per_batch
TRUTH[siamese_network]="setup: C steps the StepLR (gamma 0.7) every batch, not every epoch: lr 1.0 x 0.7^k from step 1"
FILE[gcn]=gcn/main.py
ARGS[gcn]="--epochs 40 --val-every 10"
ENVS[gcn]=""
FAULT[gcn]=loss_all_nodes
TRUTH[gcn]="setup: C's loss on every node (the training mask left out): other outputs and targets given to the loss from step 0"
FILE[gat]=gat/main.py
ARGS[gat]="--epochs 30 --hidden-dim 16 --num-heads 4 --val-every 10"
ENVS[gat]=""
FAULT[gat]=zero_grad_after_backward
TRUTH[gat]="setup: C calls optimizer.zero_grad() between backward() and step(): every .grad is None (set_to_none) at optimizer.step(): C never updates"

run() {  # script tag precision fault [extra env]
  local s=$1 tag=$2 out=$RUNS/$1/$2
  if [ "${DIFF_ONLY:-0}" = 1 ] && [ -f "$out/manifest.json" ]; then return; fi
  rm -rf "$out.cwd"; mkdir -p "$out.cwd"
  cp "$PS_DIR/data/traindata.pt" "$out.cwd/"   # time_sequence_prediction reads ./traindata.pt
  local t0=$SECONDS
  (cd "$out.cwd" && env ${ENVS[$s]} ${5:-} PYTHONPATH="$PS_DIR/shim:$PS_DIR/shim-seed" PS_CORA_TGZ="$PS_DIR/data/cora.tgz" \
     WATCH_OUT="$out" PRECISION=$3 FAULT=$4 "$PYTHON" "$PS_DIR/examples/${FILE[$s]}" ${ARGS[$s]}) > "$RUNS/$s/$tag.log" 2>&1
  local rc=$?
  echo "  $s/$tag (PRECISION=$3 FAULT=$4 ${5:-}): rc=$rc, $((SECONDS - t0)) s" >&2
  [ $rc -eq 0 ] || tail -5 "$RUNS/$s/$tag.log" >&2
}

pair() {  # script name A B truth
  local s=$1 name=$2
  # run from the script's folder so that diff can import the script's module for the float64 replay where it can
  (cd "$PS_DIR/examples/$(dirname ${FILE[$s]})" && PYTHONPATH="$PS_DIR/shim" "$CONVCHECK" diff "$RUNS/$s/$3" "$RUNS/$s/$4" \
     --json --no-save > "$RUNS/$s/$name.json" 2> "$RUNS/$s/$name.err")
  local rc=$?
  (cd "$PS_DIR/examples/$(dirname ${FILE[$s]})" && PYTHONPATH="$PS_DIR/shim" "$CONVCHECK" diff "$RUNS/$s/$3" "$RUNS/$s/$4" \
     --no-save > "$RUNS/$s/$name.txt" 2>&1)
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$s" "$name" "$3" "$4" "$rc" "$5" >> "$RUNS/pairs.tsv"
}

setup
touch "$RUNS/pairs.tsv"
for s in "${SCRIPTS[@]}"; do
  [ -n "${FILE[$s]:-}" ] || { echo "unknown script $s" >&2; exit 2; }
  echo "== $s" >&2
  mkdir -p "$RUNS/$s"
  # drop this script's earlier rows
  grep -v -P "^$s\t" "$RUNS/pairs.tsv" > "$RUNS/pairs.tsv.tmp"; mv "$RUNS/pairs.tsv.tmp" "$RUNS/pairs.tsv"
  run "$s" A fp32 none
  run "$s" B bf16 none
  run "$s" A2 fp32 none
  run "$s" C fp32 "${FAULT[$s]}"
  pair "$s" A-B A B "ok: fp32 against bf16 autocast, nothing else differs"
  pair "$s" A-A2 A A2 "ok: the same settings twice"
  pair "$s" A-C A C "${TRUTH[$s]}"
  if [ "$s" = siamese_network ]; then
    run "$s" U fp32 none PS_SEED_PYRANDOM=
    pair "$s" A-U A U "setup: U leaves Python's random unseeded (as the script does): its dataset draws other image pairs"
  fi
done
"$PYTHON" "$PS_DIR/tools/report.py" "$RUNS"
