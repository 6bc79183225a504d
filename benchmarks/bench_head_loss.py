"""The chunked head and loss (`autotune/workload/chunked_loss.py`) at a language model's head, its vocabulary
padded to a multiple of `ALIGN` (the default) against unpadded, beside Hugging Face's unchunked loss.

Times forward and backward of the loss on random hidden states under bf16 autocast, the GPU synchronized around
each repeat; prints one JSON line per variant (median milliseconds and the peak memory of the call).

    python benchmarks/bench_head_loss.py                                  # GPT-2 large's head, 13 x 1024 tokens
    python benchmarks/bench_head_loss.py --vocab 32000 --hidden 2048 --tokens 8192
    python benchmarks/bench_head_loss.py --device cpu --tokens 512 --repeats 3      # a CPU dry run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from autotune.workload import chunked_loss


def unchunked(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """What the model's own loss does: the whole (tokens, vocabulary) logits, upcast, then cross-entropy."""
    return F.cross_entropy((hidden @ weight.T).float(), targets)


def chunked(align: int):
    def call(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return chunked_loss.linear_cross_entropy(hidden, weight, None, targets, align=align)
    return call


def timed(loss_fn, args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g).to(device).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * 0.02).to(device).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    seconds = []
    for _ in range(args.repeats + 1):
        hidden.grad = weight.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(hidden, weight, targets)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return {"ms": round(1e3 * statistics.median(seconds[1:]), 2), "loss": float(loss.detach()), "peak_bytes": peak}


def main(argv: list[str] | None = None) -> list[dict]:
    """`argv`: the arguments after the script's name (default: the command line's); the rows printed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--hidden", type=int, default=1280)
    parser.add_argument("--tokens", type=int, default=13 * 1024)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    variants = {f"chunked, vocabulary padded to {chunked_loss.ALIGN}": chunked(chunked_loss.ALIGN),
                "chunked, unpadded": chunked(1), "unchunked (the model's own)": unchunked}
    rows = []
    for name, fn in variants.items():
        rows.append({"variant": name, "vocab": args.vocab, "hidden": args.hidden, "tokens": args.tokens,
                     "device": args.device, **timed(fn, args)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main()
