#!/usr/bin/env bash
# convcheck issue 42: public training scripts from pytorch/examples (commit 77f55b9), each changed only by the
# watch's lines and two switches (PRECISION=fp32|bf16, FAULT=none|<one planted fault>), run three times on the CPU:
#   A = fp32/none, B = bf16 autocast/none (a healthy precision pair: truth `ok`), C = fp32/<fault> (truth `setup`),
# then `convcheck diff A B --json` and `convcheck diff A C --json`; prints per pair the truth, the verdict's
# category and headline, and writes $PS_DIR/runs/results.md.
#
# usage: public_scripts.sh [SCRIPT ...]      SCRIPT: mnist vae word_language_model dcgan imagenet (default: all)
# env:   PS_DIR        where the scripts, the torchvision shim, the corpus and the runs live: this file's folder when
#                      it holds examples/ (the harness itself), else ${TMPDIR:-/tmp}/convcheck-public-scripts.
#                      Keep it outside the repository (the tests never depend on it or on the network).
#        EXAMPLES_SRC  a pytorch/examples clone URL or git dir, read once to set up $PS_DIR/examples
#                      (default https://github.com/pytorch/examples.git)
#        PYTHON        the interpreter with torch and convcheck (default: python); CONVCHECK (default: convcheck)
#        REPEAT=1      also run A a second time and diff A A2 (each script repeats itself bitwise: truth `ok`)
#        EXTRA=1       imagenet: a second planted fault, D = fp32/bn_wd, diffed A D
#        DIFF_ONLY=1   keep the recorded runs, only diff them again (after a change to the diff, not to the watch)
# What it changes in the scripts: the patch below (watch_edits.patch). torchvision does not import beside the CPU
# torch, so a local shim stands in (synthetic MNIST-shaped digits, FakeData, a small ResNet as `resnet18`,
# ToTensor/Normalize, a no-op save_image); word_language_model reads a generated toy-grammar corpus.
set -u -o pipefail
COMMIT=77f55b912142e11fcfdf5b530231fb9c52f181e8
here=$(cd "$(dirname "$0")" && pwd)
if [ -z "${PS_DIR:-}" ]; then
  if [ -d "$here/examples" ]; then PS_DIR=$here; else PS_DIR=${TMPDIR:-/tmp}/convcheck-public-scripts; fi
fi
EXAMPLES_SRC=${EXAMPLES_SRC:-https://github.com/pytorch/examples.git}
PYTHON=${PYTHON:-python}
CONVCHECK=${CONVCHECK:-convcheck}
RUNS=$PS_DIR/runs
SCRIPTS=("$@")
[ ${#SCRIPTS[@]} -gt 0 ] || SCRIPTS=(mnist vae word_language_model dcgan imagenet)
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

setup() {
  mkdir -p "$PS_DIR/shim/torchvision" "$PS_DIR/tools" "$RUNS"
  if [ ! -f "$PS_DIR/examples/imagenet/main.py" ]; then
    local gitdir=$EXAMPLES_SRC tmp
    if ! git --git-dir="$gitdir" rev-parse -q --verify "$COMMIT^{commit}" >/dev/null 2>&1; then
      tmp=$(mktemp -d); gitdir=$tmp/examples.git
      git clone -q --bare --filter=blob:none "$EXAMPLES_SRC" "$gitdir" || { echo "cannot clone $EXAMPLES_SRC" >&2; exit 2; }
    fi
    for f in mnist/main.py vae/main.py word_language_model/main.py word_language_model/model.py \
             word_language_model/data.py dcgan/main.py imagenet/main.py; do
      mkdir -p "$PS_DIR/examples/$(dirname $f)"
      git --git-dir="$gitdir" show "$COMMIT:$f" > "$PS_DIR/examples/$f" || exit 2
    done
    (cd "$PS_DIR/examples" && git apply --whitespace=nowarn "$PS_DIR/watch_edits.patch") || { echo "patch failed" >&2; exit 2; }
  fi
  [ -f "$PS_DIR/data/synth/train.txt" ] || "$PYTHON" "$PS_DIR/tools/make_corpus.py" "$PS_DIR/data/synth" 6400
}

# the embedded files (written only when missing: the harness folder keeps its own)
put() { [ -f "$PS_DIR/$1" ] || { mkdir -p "$(dirname "$PS_DIR/$1")"; cat > "$PS_DIR/$1"; }; }
mkdir -p "$PS_DIR"
put watch_edits.patch <<'@@END_OF_FILE@@'
diff --git a/dcgan/main.py b/dcgan/main.py
index b150174..910c1bb 100644
--- a/dcgan/main.py
+++ b/dcgan/main.py
@@ -11,6 +11,11 @@ import torch.utils.data
 import torchvision.datasets as dset
 import torchvision.transforms as transforms
 import torchvision.utils as vutils
+import contextlib
+import convcheck  # watch
+torch.set_num_threads(1)
+FAULT = os.environ.get('FAULT', 'none')  # none | label_flip: one planted fault
+amp = (lambda: torch.autocast('cpu', dtype=torch.bfloat16)) if os.environ.get('PRECISION', 'fp32') == 'bf16' else contextlib.nullcontext
 
 
 parser = argparse.ArgumentParser()
@@ -219,7 +224,8 @@ optimizerG = optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
 if opt.dry_run:
     opt.niter = 1
 
-for epoch in range(opt.niter):
+with convcheck.watch(netD, optimizerD, out=os.environ['WATCH_OUT'], force=True) as w:
+  for epoch in range(opt.niter):
     for i, data in enumerate(dataloader, 0):
         ############################
         # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
@@ -228,32 +234,37 @@ for epoch in range(opt.niter):
         netD.zero_grad()
         real_cpu = data[0].to(device)
         batch_size = real_cpu.size(0)
-        label = torch.full((batch_size,), real_label,
+        label = torch.full((batch_size,), fake_label if FAULT == 'label_flip' else real_label,
                            dtype=real_cpu.dtype, device=device)
 
-        output = netD(real_cpu)
-        errD_real = criterion(output, label)
+        with amp():
+            output = netD(real_cpu)
+            errD_real = criterion(output, label)
         errD_real.backward()
         D_x = output.mean().item()
 
         # train with fake
         noise = torch.randn(batch_size, nz, 1, 1, device=device)
-        fake = netG(noise)
+        with amp():
+            fake = netG(noise)
         label.fill_(fake_label)
-        output = netD(fake.detach())
-        errD_fake = criterion(output, label)
+        with amp():
+            output = netD(fake.detach())
+            errD_fake = criterion(output, label)
         errD_fake.backward()
         D_G_z1 = output.mean().item()
         errD = errD_real + errD_fake
         optimizerD.step()
+        w.step(errD)
 
         ############################
         # (2) Update G network: maximize log(D(G(z)))
         ###########################
         netG.zero_grad()
         label.fill_(real_label)  # fake labels are real for generator cost
-        output = netD(fake)
-        errG = criterion(output, label)
+        with amp():
+            output = netD(fake)
+            errG = criterion(output, label)
         errG.backward()
         D_G_z2 = output.mean().item()
         optimizerG.step()
diff --git a/imagenet/main.py b/imagenet/main.py
index 42e5e9f..88f32c1 100644
--- a/imagenet/main.py
+++ b/imagenet/main.py
@@ -20,6 +20,11 @@ import torchvision.models as models
 import torchvision.transforms as transforms
 from torch.optim.lr_scheduler import StepLR
 from torch.utils.data import Subset
+import contextlib
+import convcheck  # watch
+torch.set_num_threads(1)
+FAULT = os.environ.get('FAULT', 'none')  # none | frozen | bn_wd: one planted fault
+amp = (lambda: torch.autocast('cpu', dtype=torch.bfloat16)) if os.environ.get('PRECISION', 'fp32') == 'bf16' else contextlib.nullcontext
 
 model_names = sorted(name for name in models.__dict__
     if name.islower() and not name.startswith("__")
@@ -199,7 +204,15 @@ def main_worker(gpu, ngpus_per_node, args):
     # define loss function (criterion), optimizer, and learning rate scheduler
     criterion = nn.CrossEntropyLoss().to(device)
 
-    optimizer = torch.optim.SGD(model.parameters(), args.lr,
+    if FAULT == 'frozen':  # a fine-tuning run that never unfreezes its backbone
+        for n, p in model.named_parameters():
+            p.requires_grad_(n.startswith('fc.'))
+    params = model.parameters()
+    if FAULT == 'bn_wd':  # the BatchNorm parameters in their own group, weight decay x100
+        bn = [p for m in model.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters()]
+        params = [{'params': [p for p in model.parameters() if all(p is not q for q in bn)]},
+                  {'params': bn, 'weight_decay': args.weight_decay * 100}]
+    optimizer = torch.optim.SGD(params, args.lr,
                                 momentum=args.momentum,
                                 weight_decay=args.weight_decay)
     
@@ -278,12 +291,13 @@ def main_worker(gpu, ngpus_per_node, args):
         validate(val_loader, model, criterion, args)
         return
 
-    for epoch in range(args.start_epoch, args.epochs):
+    with convcheck.watch(model, optimizer, out=os.environ['WATCH_OUT'], force=True) as w:
+      for epoch in range(args.start_epoch, args.epochs):
         if args.distributed:
             train_sampler.set_epoch(epoch)
 
         # train for one epoch
-        train(train_loader, model, criterion, optimizer, epoch, device, args)
+        train(train_loader, model, criterion, optimizer, epoch, device, args, w)
 
         # evaluate on validation set
         acc1 = validate(val_loader, model, criterion, args)
@@ -306,7 +320,7 @@ def main_worker(gpu, ngpus_per_node, args):
             }, is_best)
 
 
-def train(train_loader, model, criterion, optimizer, epoch, device, args):
+def train(train_loader, model, criterion, optimizer, epoch, device, args, w):
     
     use_accel = not args.no_accel and torch.accelerator.is_available()
 
@@ -333,8 +347,9 @@ def train(train_loader, model, criterion, optimizer, epoch, device, args):
         target = target.to(device, non_blocking=True)
 
         # compute output
-        output = model(images)
-        loss = criterion(output, target)
+        with amp():
+            output = model(images)
+            loss = criterion(output, target)
 
         # measure accuracy and record loss
         acc1, acc5 = accuracy(output, target, topk=(1, 5))
@@ -346,6 +361,7 @@ def train(train_loader, model, criterion, optimizer, epoch, device, args):
         optimizer.zero_grad()
         loss.backward()
         optimizer.step()
+        w.step(loss)
 
         # measure elapsed time
         batch_time.update(time.time() - end)
diff --git a/mnist/main.py b/mnist/main.py
index dee5a38..0dbdd79 100644
--- a/mnist/main.py
+++ b/mnist/main.py
@@ -5,6 +5,11 @@ import torch.nn.functional as F
 import torch.optim as optim
 from torchvision import datasets, transforms
 from torch.optim.lr_scheduler import StepLR
+import os, contextlib
+import convcheck  # watch
+torch.set_num_threads(1)
+FAULT = os.environ.get('FAULT', 'none')  # none | no_zero_grad: one planted fault
+amp = (lambda: torch.autocast('cpu', dtype=torch.bfloat16)) if os.environ.get('PRECISION', 'fp32') == 'bf16' else contextlib.nullcontext
 
 
 class Net(nn.Module):
@@ -33,15 +38,18 @@ class Net(nn.Module):
         return output
 
 
-def train(args, model, device, train_loader, optimizer, epoch):
+def train(args, model, device, train_loader, optimizer, epoch, w):
     model.train()
     for batch_idx, (data, target) in enumerate(train_loader):
         data, target = data.to(device), target.to(device)
-        optimizer.zero_grad()
-        output = model(data)
-        loss = F.nll_loss(output, target)
+        if FAULT != 'no_zero_grad':
+            optimizer.zero_grad()
+        with amp():
+            output = model(data)
+            loss = F.nll_loss(output, target)
         loss.backward()
         optimizer.step()
+        w.step(loss)
         if batch_idx % args.log_interval == 0:
             print('Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}'.format(
                 epoch, batch_idx * len(data), len(train_loader.dataset),
@@ -128,8 +136,9 @@ def main():
     optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
 
     scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
-    for epoch in range(1, args.epochs + 1):
-        train(args, model, device, train_loader, optimizer, epoch)
+    with convcheck.watch(model, optimizer, out=os.environ['WATCH_OUT'], force=True) as w:
+      for epoch in range(1, args.epochs + 1):
+        train(args, model, device, train_loader, optimizer, epoch, w)
         test(model, device, test_loader)
         scheduler.step()
 
diff --git a/vae/main.py b/vae/main.py
index 6390965..f473d00 100644
--- a/vae/main.py
+++ b/vae/main.py
@@ -6,6 +6,11 @@ from torch import nn, optim
 from torch.nn import functional as F
 from torchvision import datasets, transforms
 from torchvision.utils import save_image
+import os, contextlib
+import convcheck  # watch
+torch.set_num_threads(1)
+FAULT = os.environ.get('FAULT', 'none')  # none | kl_sign: one planted fault
+amp = (lambda: torch.autocast('cpu', dtype=torch.bfloat16)) if os.environ.get('PRECISION', 'fp32') == 'bf16' else contextlib.nullcontext
 
 
 parser = argparse.ArgumentParser(description='VAE MNIST Example')
@@ -86,6 +91,8 @@ def loss_function(recon_x, x, mu, logvar):
     # 0.5 * sum(1 + log(sigma^2) - mu^2 - sigma^2)
     KLD = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
 
+    if FAULT == 'kl_sign':
+        KLD = -KLD
     return BCE + KLD
 
 
@@ -95,11 +102,13 @@ def train(epoch):
     for batch_idx, (data, _) in enumerate(train_loader):
         data = data.to(device)
         optimizer.zero_grad()
-        recon_batch, mu, logvar = model(data)
-        loss = loss_function(recon_batch, data, mu, logvar)
+        with amp():
+            recon_batch, mu, logvar = model(data)
+            loss = loss_function(recon_batch, data, mu, logvar)
         loss.backward()
         train_loss += loss.item()
         optimizer.step()
+        w.step(loss)
         if batch_idx % args.log_interval == 0:
             print('Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}'.format(
                 epoch, batch_idx * len(data), len(train_loader.dataset),
@@ -129,6 +138,7 @@ def test(epoch):
     print('====> Test set loss: {:.4f}'.format(test_loss))
 
 if __name__ == "__main__":
+  with convcheck.watch(model, optimizer, out=os.environ['WATCH_OUT'], force=True) as w:
     for epoch in range(1, args.epochs + 1):
         train(epoch)
         test(epoch)
diff --git a/word_language_model/main.py b/word_language_model/main.py
index 581b17c..4dd4bca 100644
--- a/word_language_model/main.py
+++ b/word_language_model/main.py
@@ -9,6 +9,11 @@ import torch.onnx
 
 import data
 from model import PositionalEncoding, RNNModel, TransformerModel
+import contextlib
+import convcheck  # watch
+torch.set_num_threads(1)
+FAULT = os.environ.get('FAULT', 'none')  # none | lr100: one planted fault
+amp = (lambda: torch.autocast('cpu', dtype=torch.bfloat16)) if os.environ.get('PRECISION', 'fp32') == 'bf16' else contextlib.nullcontext
 
 parser = argparse.ArgumentParser(description='PyTorch Wikitext-2 RNN/LSTM/GRU/Transformer Language Model')
 parser.add_argument('--data', type=str, default='./data/wikitext-2',
@@ -108,7 +113,7 @@ else:
 
 criterion = nn.NLLLoss()
 if args.use_optimizer:
-    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
+    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * (100 if FAULT == 'lr100' else 1))
 
 ###############################################################################
 # Training code
@@ -176,13 +181,14 @@ def train():
             optimizer.zero_grad()
         else:
             model.zero_grad()
-        if args.model == 'Transformer':
+        with amp():
+          if args.model == 'Transformer':
             output = model(data)
             output = output.view(-1, ntokens)
-        else:
+          else:
             hidden = repackage_hidden(hidden)
             output, hidden = model(data, hidden)
-        loss = criterion(output, targets)
+          loss = criterion(output, targets)
         loss.backward()
 
         # `clip_grad_norm` helps prevent the exploding gradient problem in RNNs / LSTMs.
@@ -192,6 +198,7 @@ def train():
         else:
             for p in model.parameters():
                 p.data.add_(p.grad, alpha=-lr)
+        w.step(loss)
 
         total_loss += loss.item()
 
@@ -222,6 +229,7 @@ best_val_loss = None
 
 # At any point you can hit Ctrl + C to break out of training early.
 try:
+  with convcheck.watch(model, optimizer if args.use_optimizer else None, out=os.environ['WATCH_OUT'], force=True) as w:
     for epoch in range(1, args.epochs+1):
         epoch_start_time = time.time()
         train()
@@END_OF_FILE@@
put tools/make_corpus.py <<'@@END_OF_FILE@@'
"""A small synthetic corpus for word_language_model: sentences from a toy grammar (determiner, adjective, noun,
verb, object, optional prepositional phrase), ~40 words, seeded: learnable structure, no download.
Usage: python make_corpus.py DIR [TRAIN_TOKENS]"""
import os
import random
import sys

out = sys.argv[1]
n_train = int(sys.argv[2]) if len(sys.argv) > 2 else 6400
rng = random.Random(0)
det = ["the", "a", "every", "some"]
adj = ["red", "small", "old", "quick", "quiet", "bright"]
noun = ["cat", "dog", "bird", "child", "farmer", "robot", "river", "tree"]
verb = {"sees": noun, "eats": ["apple", "bread", "fish"], "follows": noun, "crosses": ["river", "road", "bridge"]}
prep = ["near", "under", "behind"]


def sentence():
    w = [rng.choice(det)] + ([rng.choice(adj)] if rng.random() < 0.5 else []) + [rng.choice(noun)]
    v = rng.choice(sorted(verb))
    w += [v, "the", rng.choice(verb[v])]
    if rng.random() < 0.3:
        w += [rng.choice(prep), "the", rng.choice(noun)]
    return w + ["."]


os.makedirs(out, exist_ok=True)
for name, n in (("train", n_train), ("valid", n_train // 8), ("test", n_train // 8)):
    lines, count = [], 0
    while count < n:
        s = sentence()
        lines.append(" ".join(s))
        count += len(s) + 1  # + <eos>
    with open(os.path.join(out, f"{name}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
@@END_OF_FILE@@
put tools/report.py <<'@@END_OF_FILE@@'
"""The table of run_all.sh / benchmarks/public_scripts.sh: one row per diffed pair (truth, verdict, headline), each
run's loss at the start and end (mean of its first / last 5 recorded steps). Usage: report.py RUNS_DIR"""
import json
import math
import os
import sys

runs = sys.argv[1]


def losses(path):
    try:
        ls = [json.loads(line).get("loss") for line in open(os.path.join(path, "steps.jsonl"))]
    except OSError:
        return "no run"
    ls = [x for x in ls if isinstance(x, (int, float))]
    if not ls:
        return "no loss"
    fin = [x for x in ls if math.isfinite(x)]
    head, tail = sum(ls[:5]) / len(ls[:5]), sum(ls[-5:]) / len(ls[-5:])
    return f"{len(ls)} steps, loss {head:.4g} -> {tail:.4g}" + ("" if len(fin) == len(ls) else " (non-finite)")


rows = []
for line in open(os.path.join(runs, "pairs.tsv")):
    s, name, a, b, rc, truth = line.rstrip("\n").split("\t")
    try:
        v = json.load(open(os.path.join(runs, s, f"{name}.json")))["verdict"]
        cat, head = v["category"], " ".join(v["headline"].split())
    except (OSError, ValueError, KeyError, TypeError):
        err = open(os.path.join(runs, s, f"{name}.err")).read().strip().splitlines()
        cat, head = "(error)", (err[-1] if err else f"exit {rc}")
    want = truth.split(":")[0]
    rows.append((s, name, truth, cat, "yes" if cat == want else "NO", head,
                 f"{a}: {losses(os.path.join(runs, s, a))}; {b}: {losses(os.path.join(runs, s, b))}"))

md = ["| script | pair | truth | verdict | right category | headline | runs |", "|---|---|---|---|---|---|---|"]
md += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
right = sum(r[4] == "yes" for r in rows)
md.append(f"\n{right} of {len(rows)} pairs in the right category.")
open(os.path.join(runs, "results.md"), "w").write("\n".join(md) + "\n")
for r in rows:
    print(f"{r[0]:<20} {r[1]:<5} truth={r[2].split(':')[0]:<6} verdict={r[3]:<15} right={r[4]:<3} {r[5]}")
    print(f"{'':<26}{r[6]}")
print(f"{right} of {len(rows)} pairs in the right category; table: {os.path.join(runs, 'results.md')}")
@@END_OF_FILE@@
put shim/torchvision/__init__.py <<'@@END_OF_FILE@@'
"""A minimal local stand-in for torchvision (it does not import beside this CPU torch): only what the
pytorch/examples scripts run here use. Data are synthetic and deterministic (seeded per index, the global
RNG untouched); sizes are capped by PS_MNIST_N / PS_FAKE_N / PS_FAKE_SIZE so the runs stay tiny."""
from . import datasets, models, transforms, utils  # noqa: F401
__version__ = "0.0-shim"
@@END_OF_FILE@@
put shim/torchvision/datasets.py <<'@@END_OF_FILE@@'
import os

import torch


def _n(default, env):
    return min(default, int(os.environ.get(env, default)))


class MNIST(torch.utils.data.Dataset):
    """MNIST-shaped synthetic digits: 10 fixed smooth class templates plus per-sample noise and shift, uint8 28x28,
    so a classifier/VAE has something to learn. PS_MNIST_N train samples (default 640), a quarter of that for test."""

    def __init__(self, root, train=True, download=False, transform=None):
        n = int(os.environ.get("PS_MNIST_N", 640))
        self.n = n if train else max(n // 4, 64)
        self.offset = 0 if train else 10 ** 6
        self.transform = transform
        g = torch.Generator().manual_seed(1234)
        coarse = torch.rand(10, 1, 7, 7, generator=g)
        self.templates = torch.nn.functional.interpolate(coarse, size=(28, 28), mode="bilinear",
                                                         align_corners=False)[:, 0]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.offset + i)
        y = int(torch.randint(0, 10, (1,), generator=g))
        dx, dy = (int(v) for v in torch.randint(-2, 3, (2,), generator=g))
        img = torch.roll(self.templates[y], shifts=(dx, dy), dims=(0, 1))
        img = (img + 0.15 * torch.randn(28, 28, generator=g)).clamp(0, 1)
        img = (img * 255).round().to(torch.uint8)
        return (self.transform(img) if self.transform else img), y


class FakeData(torch.utils.data.Dataset):
    """torchvision.datasets.FakeData: random images and labels, each index seeded on its own. Its length is capped
    at PS_FAKE_N (default 320) and the image side replaced by PS_FAKE_SIZE when set."""

    def __init__(self, size=1000, image_size=(3, 224, 224), num_classes=10, transform=None, target_transform=None,
                 random_offset=0):
        self.size = _n(size, "PS_FAKE_N") if "PS_FAKE_N" in os.environ else min(size, 320)
        side = os.environ.get("PS_FAKE_SIZE")
        self.image_size = (image_size[0], int(side), int(side)) if side else tuple(image_size)
        self.num_classes, self.transform, self.offset = num_classes, transform, random_offset

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.offset + i)
        img = torch.randint(0, 256, self.image_size, generator=g, dtype=torch.uint8)
        y = int(torch.randint(0, self.num_classes, (1,), generator=g))
        return (self.transform(img) if self.transform else img), y


def _unavailable(*a, **k):
    raise RuntimeError("not in the torchvision shim: use MNIST or FakeData")


ImageFolder = LSUN = CIFAR10 = _unavailable
@@END_OF_FILE@@
put shim/torchvision/models.py <<'@@END_OF_FILE@@'
"""A small ResNet in torchvision's layout (conv1, bn1, relu, maxpool, layer1-4 of BasicBlocks, avgpool, fc), widths
16-128, one block a stage: ``resnet18`` here is that (torchvision's is not importable)."""
import torch.nn as nn


class BasicBlock(nn.Module):
    def __init__(self, inp, out, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(inp, out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.downsample = None
        if stride != 1 or inp != out:
            self.downsample = nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x):
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + idt)


class ResNet(nn.Module):
    def __init__(self, widths=(16, 32, 64, 128), num_classes=1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        inp = widths[0]
        for k, w in enumerate(widths):
            setattr(self, f"layer{k + 1}", nn.Sequential(BasicBlock(inp, w, 1 if k == 0 else 2)))
            inp = w
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inp, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


def resnet18(pretrained=False, **kw):
    if pretrained:
        raise RuntimeError("no pretrained weights in the shim")
    return ResNet(**kw)
@@END_OF_FILE@@
put shim/torchvision/transforms.py <<'@@END_OF_FILE@@'
import torch


class Compose:
    def __init__(self, ts):
        self.ts = list(ts)

    def __call__(self, x):
        for t in self.ts:
            x = t(x)
        return x


class ToTensor:
    """uint8 HxW or CxHxW tensor -> float CxHxW in [0, 1] (what torchvision's ToTensor does to a PIL image)."""
    def __call__(self, x):
        if x.dim() == 2:
            x = x.unsqueeze(0)
        return x.to(torch.float32).div(255) if x.dtype == torch.uint8 else x.to(torch.float32)


class Normalize:
    def __init__(self, mean, std):
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x):
        return (x - self.mean) / self.std


def _identity(*a, **k):
    return lambda x: x


Resize = CenterCrop = RandomResizedCrop = RandomHorizontalFlip = _identity
@@END_OF_FILE@@
put shim/torchvision/utils.py <<'@@END_OF_FILE@@'
def save_image(*args, **kwargs):
    """No image files from these runs."""
@@END_OF_FILE@@

# script -> file, arguments, environment, planted fault, what the fault is (the truth)
declare -A FILE ARGS ENVS FAULT TRUTH
FILE[mnist]=mnist/main.py
ARGS[mnist]="--epochs 1 --batch-size 16 --log-interval 10"
ENVS[mnist]="PS_MNIST_N=640"
FAULT[mnist]=no_zero_grad
TRUTH[mnist]="setup: optimizer.zero_grad() removed in C, its gradients accumulate from step 1"
FILE[vae]=vae/main.py
ARGS[vae]="--epochs 1 --batch-size 16 --log-interval 10"
ENVS[vae]="PS_MNIST_N=640"
FAULT[vae]=kl_sign
TRUTH[vae]="setup: the KL term's sign flipped in C's loss (the loss differs at step 0, same weights and batch)"
FILE[word_language_model]=word_language_model/main.py
ARGS[word_language_model]="--data $PS_DIR/data/synth --use-optimizer --lr 0.005 --emsize 32 --nhid 32 --nlayers 2 --batch_size 8 --bptt 20 --epochs 1 --log-interval 10 --save model.pt"
ENVS[word_language_model]=""
FAULT[word_language_model]=lr100
TRUTH[word_language_model]="setup: AdamW lr 0.5 in C against 0.005 in A (x100)"
FILE[dcgan]=dcgan/main.py
ARGS[dcgan]="--dataset fake --workers 0 --batchSize 8 --ngf 8 --ndf 8 --niter 1 --manualSeed 1 --outf ."
ENVS[dcgan]="PS_FAKE_N=240"
FAULT[dcgan]=label_flip
TRUTH[dcgan]="setup: D's real batch labelled fake (0) in C (D's loss differs at step 0)"
FILE[imagenet]=imagenet/main.py
ARGS[imagenet]="--dummy -a resnet18 -b 8 -j 0 --epochs 1 --seed 1 -p 10"
ENVS[imagenet]="PS_FAKE_N=320 PS_FAKE_SIZE=64"
FAULT[imagenet]=frozen
TRUTH[imagenet]="setup: all but fc.* frozen in C (requires_grad False: they never get a gradient)"
TRUTH_bn_wd="setup: BatchNorm params in a second param group with weight decay 1e-2 in D (A: one group, 1e-4)"

run() {  # script tag precision fault
  local s=$1 tag=$2 out=$RUNS/$1/$2
  if [ "${DIFF_ONLY:-0}" = 1 ] && [ -f "$out/manifest.json" ]; then return; fi
  mkdir -p "$out.cwd"
  local t0=$SECONDS
  (cd "$out.cwd" && env ${ENVS[$s]} PYTHONPATH="$PS_DIR/shim" WATCH_OUT="$out" PRECISION=$3 FAULT=$4 \
     "$PYTHON" "$PS_DIR/examples/${FILE[$s]}" ${ARGS[$s]}) > "$RUNS/$s/$tag.log" 2>&1
  local rc=$?
  echo "  $s/$tag (PRECISION=$3 FAULT=$4): rc=$rc, $((SECONDS - t0)) s" >&2
  [ $rc -eq 0 ] || tail -5 "$RUNS/$s/$tag.log" >&2
}

pair() {  # script name A B truth
  local s=$1 name=$2
  # the shim importable as torchvision (as the real one is for its users): the judge can rebuild a torchvision model
  PYTHONPATH="$PS_DIR/shim" "$CONVCHECK" diff "$RUNS/$s/$3" "$RUNS/$s/$4" --json --no-save > "$RUNS/$s/$name.json" 2> "$RUNS/$s/$name.err"
  local rc=$?
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$s" "$name" "$3" "$4" "$rc" "$5" >> "$RUNS/pairs.tsv"
}

setup
: > "$RUNS/pairs.tsv"
for s in "${SCRIPTS[@]}"; do
  [ -n "${FILE[$s]:-}" ] || { echo "unknown script $s" >&2; exit 2; }
  echo "== $s" >&2
  mkdir -p "$RUNS/$s"
  run "$s" A fp32 none
  run "$s" B bf16 none
  run "$s" C fp32 "${FAULT[$s]}"
  pair "$s" "A-B" A B "ok: fp32 against bf16 autocast, nothing else differs"
  pair "$s" "A-C" A C "${TRUTH[$s]}"
  if [ "${REPEAT:-0}" = 1 ]; then run "$s" A2 fp32 none; pair "$s" "A-A2" A A2 "ok: the same settings twice"; fi
  if [ "${EXTRA:-0}" = 1 ] && [ "$s" = imagenet ]; then run "$s" D fp32 bn_wd; pair "$s" "A-D" A D "$TRUTH_bn_wd"; fi
done
"$PYTHON" "$PS_DIR/tools/report.py" "$RUNS"
