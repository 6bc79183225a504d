"""Train a GPT-2 from scratch with the Hugging Face `Trainer`: an ordinary HF script, unaware of autotune.

All of TrainingArguments' flags work (--per_device_train_batch_size, --gradient_accumulation_steps,
--gradient_checkpointing, --bf16, --max_steps...), so `autotune run` can tune it in zero-change mode:

    autotune run --global-batch-size 64 --budget 24GiB \\
        --map micro_batch=--per_device_train_batch_size --map accumulation=--gradient_accumulation_steps \\
        --map checkpointing=--gradient_checkpointing --map bf16=--bf16 \\
        examples/train_hf_trainer.py --model_size gpt2-large --seq_len 1024 --max_steps 50

The model is built from a config (no download) and trained on synthetic token sequences, so the script
runs offline. Needs `transformers` (and `accelerate`, which the Trainer uses).
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass, field

import torch

try:
    from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments
except ImportError as exc:  # the examples must not break a machine without transformers
    print(f"examples/train_hf_trainer.py needs transformers (and accelerate): pip install transformers accelerate "
          f"({exc})", file=sys.stderr)
    raise SystemExit(4) from None

# (layers, width, heads) of the GPT-2 family.
SIZES = {"gpt2": (12, 768, 12), "gpt2-medium": (24, 1024, 16), "gpt2-large": (36, 1280, 20),
         "gpt2-xl": (48, 1600, 25), "tiny": (2, 128, 4)}

# TrainingArguments defaults that suit a benchmark: no checkpoints written, no experiment tracker.
DEFAULTS = {"--report_to": "none", "--save_strategy": "no", "--logging_steps": "10", "--max_steps": "50"}


@dataclass
class ModelArguments:
    model_size: str = field(default="gpt2", metadata={"help": f"one of {', '.join(SIZES)}"})
    seq_len: int = field(default=1024, metadata={"help": "tokens per sample"})
    vocab_size: int = field(default=50257, metadata={"help": "GPT-2's by default; e.g. 512 for a quick CPU run"})
    num_samples: int = field(default=1_000_000, metadata={"help": "size of the synthetic dataset"})


class SyntheticTokens(torch.utils.data.Dataset):
    """Sequences counting up from a random start by a random stride (learnable), the same for each index."""

    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        self.n, self.seq_len, self.vocab = n, seq_len, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        start = int(torch.randint(0, self.vocab, (1,), generator=g))
        stride = int(torch.randint(1, 4, (1,), generator=g))
        ids = (start + stride * torch.arange(self.seq_len)) % self.vocab
        return {"input_ids": ids, "labels": ids.clone()}


def with_defaults(argv: list[str]) -> list[str]:
    """`argv` plus each default flag it does not set itself (and an output directory when none is given)."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    extra = [x for flag, value in DEFAULTS.items() if flag not in given for x in (flag, value)]
    if "--output_dir" not in given:
        extra += ["--output_dir", os.path.join(tempfile.gettempdir(), "autotune-hf-example")]
    return argv + extra


def main() -> int:
    parser = HfArgumentParser((ModelArguments, TrainingArguments))
    model_args, training_args = parser.parse_args_into_dataclasses(args=with_defaults(sys.argv[1:]))
    if model_args.model_size not in SIZES:
        parser.error(f"--model_size must be one of {', '.join(SIZES)}")
    layers, width, heads = SIZES[model_args.model_size]
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=model_args.seq_len,
                        vocab_size=model_args.vocab_size, bos_token_id=model_args.vocab_size - 1,
                        eos_token_id=model_args.vocab_size - 1, use_cache=False)
    model = GPT2LMHeadModel(config)
    data = SyntheticTokens(model_args.num_samples, model_args.seq_len, config.vocab_size)
    trainer = Trainer(model=model, args=training_args, train_dataset=data)
    result = trainer.train()
    # With --auto_find_batch_size the Trainer shrinks its batch below the flag's value; this is the one it used.
    batch = getattr(trainer, "_train_batch_size", training_args.train_batch_size)
    samples = batch * training_args.gradient_accumulation_steps * max(1, training_args.world_size)
    runtime = result.metrics["train_runtime"]
    print(f"trained {result.global_step} steps in {runtime:.1f} s: {samples} samples/step (batch {batch} x "
          f"{training_args.gradient_accumulation_steps} accumulation), "
          f"{result.global_step * samples * model_args.seq_len / runtime:,.0f} tokens/s (wall clock)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
