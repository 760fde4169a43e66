"""A Hugging Face ``Trainer`` run diagnosed with ``convcheck.watch`` (issue 25): run it twice, then diff.

    pip install 'convcheck[hf]'
    CONVCHECK_PRECISION=fp32 python -m examples.watch_hf runs/hf_fp32
    CONVCHECK_PRECISION=bf16 python -m examples.watch_hf runs/hf_bf16
    convcheck diff runs/hf_fp32 runs/hf_bf16

(``python -m`` from the repository's root: the model's class is then importable where ``diff`` runs, and
its float64 replay of the snapshot layers runs too; ``python examples/watch_hf.py`` diffs without it.)

The only convcheck line is the callback in ``Trainer(callbacks=[...])``. The model is a tiny
``PreTrainedModel`` defined here (no download): a token embedding, one hand-written self-attention and a
classifier head, trained on random token sequences. ``CONVCHECK_PRECISION`` picks float32 or bfloat16
autocast (``TrainingArguments(bf16=True)``) on the CPU.
"""

import os
import sys
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset
from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainingArguments

from convcheck.integrations.hf import ConvcheckCallback


class TinyConfig(PretrainedConfig):
    model_type = "convcheck-tiny"

    def __init__(self, vocab=50, d=16, classes=3, **kwargs):
        super().__init__(**kwargs)
        self.vocab, self.d, self.classes = vocab, d, classes


class TinyClassifier(PreTrainedModel):
    config_class = TinyConfig

    def __init__(self, config=None):  # buildable without arguments: diff's float64 replay builds it
        config = config if config is not None else TinyConfig()
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab, config.d)
        self.q, self.k, self.v = (nn.Linear(config.d, config.d) for _ in range(3))
        self.head = nn.Linear(config.d, config.classes)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.2)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=1.0)

    def forward(self, input_ids, labels=None):
        h = self.embed(input_ids)
        s = self.q(h) @ self.k(h).transpose(1, 2) / h.shape[-1] ** 0.5
        logits = self.head((torch.softmax(s, -1) @ self.v(h)).mean(1))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


class RandomTokens(Dataset):
    def __init__(self, n=128, length=6, vocab=50, classes=3):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)
        self.labels = torch.randint(0, classes, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def main(out: str, steps: int = 4, accumulate: int = 1):
    bf16 = os.environ.get("CONVCHECK_PRECISION", "fp32") == "bf16"
    torch.manual_seed(0)
    model = TinyClassifier()
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, max_steps=steps, per_device_train_batch_size=16, learning_rate=0.05,
                                 bf16=bf16, use_cpu=True, gradient_accumulation_steps=accumulate, seed=0, report_to="none", save_strategy="no",
                                 logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
                                 remove_unused_columns=False)
        trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(),
                          callbacks=[ConvcheckCallback(out=out, force=True)])                # the convcheck line
        return trainer.train()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/hf")
