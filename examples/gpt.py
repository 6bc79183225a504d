"""A small GPT (decoder-only transformer) for the examples and tests: plain PyTorch, no downloads."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 512
    seq_len: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd))
        self.drop = nn.Dropout(cfg.dropout)
        self.n_head = cfg.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        # (B, nh, T, hs)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.shape[-1])  # explicit attention: memory grows with T^2
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        y = (self.drop(att.softmax(dim=-1)) @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """`model(input_ids, labels)` returns the mean next-token cross-entropy."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        x = self.tok(input_ids) + self.pos(torch.arange(t, device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def random_batch(cfg: GPTConfig, n: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, cfg.vocab_size, (n, cfg.seq_len + 1), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


class CountingSequences(torch.utils.data.Dataset):
    """(input ids, labels) counting up from a random start by a random stride: learnable, so the loss falls.
    Index i is always the same sequence; nothing is downloaded."""

    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        self.n, self.seq_len, self.vocab = n, seq_len, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        start = int(torch.randint(0, self.vocab, (1,), generator=g))
        stride = int(torch.randint(1, 4, (1,), generator=g))
        ids = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab
        return ids[:-1], ids[1:]
