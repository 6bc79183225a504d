"""A causal LM's head and loss in chunks of tokens: the logits of the whole micro-batch never exist at once.

A Hugging Face causal LM computes `logits = lm_head(hidden)` for every token, then `loss_function` upcasts
them to FP32 and takes a cross-entropy that saves its log-softmax for backward. For GPT-2 (50,257 words) that
is ~0.5 GB a sample of 1,024 tokens held at the end of forward, where every block's activations are held too:
on GPT-2 medium as much again as the blocks' own activations, so it caps the micro-batch. Chunked, each run of
tokens goes through the head, its log-sum-exp and its gradient (softmax minus one-hot) at once, in the forward,
and only the gradients stay: d(hidden) in the hidden's dtype and d(weight) in the weight's (FP32 here), about
the size of the weight's own gradient, whatever the micro-batch. Backward scales them by the incoming gradient.
Liger-Kernel's fused linear cross-entropy does the same in Triton; this is plain torch, so it runs wherever
the model does (CPU tests included).

The arithmetic is the model's own: the matmul in the autocast dtype (or the weight's, without autocast or for a
float64 head, which autocast leaves alone), the log-softmax in FP32 (float64 for a float64 head), labels
shifted by one with -100 ignored, a sum over `num_items_in_batch` when given (else a mean over the counted
tokens). What changes: `output.logits` holds the hidden states while the head is
chunked (the default loss reads `.loss` only, so a user's `loss_fn` never gets it), and the head's gradient is
summed over chunks in FP32 rather than in one 16-bit matmul.

Used by the default loss when "chunked_loss" is allowed (it is by default) and `why_not(model)` is None.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

IGNORE_INDEX = -100
CAUSAL_LOSS = "ForCausalLMLoss"  # Hugging Face's next-token cross-entropy, the one loss the chunks compute
CHUNK_BYTES = 256 << 20  # FP32 logits of one chunk; GPT-2: 1,335 tokens (transients ~2.5x this)
# In 16 bits the head's three matmuls run on the vocabulary padded with zero rows to a multiple of this (GPT-2's
# 50,257 to 50,304): 16-bit matrices whose rows are not a multiple of 16 bytes long keep cuBLAS off its fastest
# kernels, and Inductor pads a compiled matmul the same way. The weight is cast to 16 bits there anyway, so the
# padded copy costs nothing more; in a wider dtype the weight is used as it is. The padded logits are never read.
ALIGN = 64


def unwrapped(model: nn.Module) -> nn.Module:
    """The model whose own attributes are the head and the loss function: `model`, or the one inside
    torch.compile's wrapper (`_orig_mod`) or a peft wrapper (`PeftModel.get_base_model()`), which forward the
    call to it with its arguments."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        base = getattr(model, "get_base_model", None)
        if inner is None and hasattr(model, "peft_config") and callable(base):
            inner = base()
        if not isinstance(inner, nn.Module) or inner is model:
            return model
        model = inner


def why_not(model: nn.Module) -> str | None:
    """None when the head's loss can be chunked on this model, else why not (for the plan's notes).

    Yes for a Hugging Face causal LM (bare, compiled or inside a peft wrapper) whose forward computes
    `self.lm_head(hidden)` with an `nn.Linear` head and hands those logits straight to `self.loss_function`
    (GPT-2, Llama, Mistral, Qwen...), with a settable `loss_function` (transformers 4.48+) that is next-token
    prediction (`ForCausalLMLoss`; LLaVA-style models' too). No where the loss is another (a masked LM's, CTC's)
    or the user's own, where the logits are changed in between (Gemma 2's soft-capping, Cohere's scale) or recast
    as the head returns them (Mamba's `self.lm_head(...).float()`), or where an adapter wraps the head. What
    the source cannot show (a hook on the head) the check on the example batch finds (`loss_checks.py`).
    """
    model = unwrapped(model)
    head = getattr(model, "lm_head", None)
    if head is None:
        return "the model has no lm_head"
    if not isinstance(head, nn.Linear):  # an adapter's layer (peft's lora.Linear) computes more than weight and bias
        return f"the model's lm_head is a {type(head).__module__}.{type(head).__name__}, not an nn.Linear"
    prop = inspect.getattr_static(type(model), "loss_function", None)
    if not isinstance(prop, property) or prop.fset is None:
        return "the model has no settable loss_function (a Hugging Face model, transformers 4.48 or later)"
    loss = hf_loss_name(model)
    if loss != CAUSAL_LOSS:
        return (f"{type(model).__name__}'s loss_function is {loss or 'unknown'}, not next-token prediction "
                f"({CAUSAL_LOSS})")
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return "the model's forward has no source to check"
    between = re.search(r"logits = self\.lm_head\((.*?)\)\n(.*?)self\.loss_function\(\s*(logits=)?logits\s*,",
                        source, re.S)
    if between is None:
        return f"{type(model).__name__}.forward does not hand lm_head's logits straight to loss_function"
    if _recast(between.group(1)):
        return f"{type(model).__name__}.forward changes lm_head's output as it returns it (a .float() recast, a scale)"
    if re.search(r"\blogits\s*(=|\*=|/=|\+=)", between.group(2)):
        return f"{type(model).__name__}.forward changes the logits before its loss (soft-capping or scaling)"
    return None


def hf_loss_name(model: nn.Module, *, fallback: bool = True) -> str | None:
    """The name of the function a Hugging Face model's `loss_function` is (`ForCausalLMLoss`, `ForMaskedLMLoss`,
    `ForCTCLoss`...), read without calling the property (which warns once for a loss_type it does not know);
    None for a model without one. A `loss_type` Hugging Face does not map falls back to the causal LM's loss, as
    the property does (`fallback`), or gives None."""
    if not isinstance(inspect.getattr_static(type(model), "loss_function", None), property):
        return None
    own = vars(model).get("_loss_function")
    if own is not None:  # set on the model (by the user, or by a library such as Liger)
        return str(getattr(own, "__name__", type(own).__name__))
    mapping = getattr(sys.modules.get("transformers.loss.loss_utils"), "LOSS_MAPPING", None)
    if not isinstance(mapping, Mapping):
        return None
    loss_type = getattr(model, "loss_type", None)
    if loss_type not in mapping:
        if not fallback:
            return None
        loss_type = "ForCausalLM"
    name = getattr(mapping.get(loss_type), "__name__", None)
    return name if isinstance(name, str) else None


def _recast(call: str) -> bool:
    """Whether `call`, what follows `self.lm_head(` up to its line's last `)`, goes on past the head's own
    closing parenthesis (`self.lm_head(h).float()`): the logits are recast, and the rounding the model
    chose happens elsewhere in the chunks."""
    depth = 0
    for k, char in enumerate(call):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0:  # the head's own closing parenthesis: anything after it acts on the logits
            return bool(call[k + 1:].strip())
    return False


@contextlib.contextmanager
def chunked(model: nn.Module) -> Iterator[None]:
    """While inside, `model(**batch, labels=...)` returns the chunked loss (and its hidden states as logits)."""
    inner: Any = unwrapped(model)  # a transformers model: lm_head and loss_function are its own attributes
    head = inner.lm_head
    had_loss = "_loss_function" in vars(inner)
    saved_loss = vars(inner).get("_loss_function")
    head.forward = _passthrough  # an instance attribute: parameter names and hooks stay as they are
    inner.loss_function = _HeadLoss(head)
    try:
        yield
    finally:
        del head.forward
        if had_loss:
            inner.loss_function = saved_loss
        else:
            del inner._loss_function


def _passthrough(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


class _HeadLoss:
    """Stands in for Hugging Face's `ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ...)`,
    given the hidden states as `logits`."""

    def __init__(self, head: nn.Linear) -> None:
        self.head = head

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None,
                 num_items_in_batch: Any = None, ignore_index: int = IGNORE_INDEX,
                 shift_labels: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        if shift_labels is None:  # token t predicts label t+1; the last has none
            labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:]
        return linear_cross_entropy(logits, self.head.weight, self.head.bias, shift_labels.to(logits.device),
                                    num_items_in_batch=num_items_in_batch, ignore_index=ignore_index)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         targets: torch.Tensor, *, num_items_in_batch: Any = None,
                         ignore_index: int = IGNORE_INDEX, chunk_bytes: int = CHUNK_BYTES,
                         align: int = ALIGN) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T + bias, targets): summed over `num_items_in_batch` when given, else the
    mean over targets that are not `ignore_index`; the (tokens, vocabulary) logits only a chunk at a time, the
    vocabulary padded to a multiple of `align` where the matmuls run in 16 bits (see `ALIGN`).

    hidden: (..., d); weight: (V, d); targets: (...) integer, the shape of hidden without its last dim.
    """
    device_type = hidden.device.type
    # The head's own dtype: autocast's where it would cast the head (never a float64 one, which it leaves alone)
    autocast = torch.is_autocast_enabled(device_type) and weight.dtype != torch.float64
    compute = torch.get_autocast_dtype(device_type) if autocast else weight.dtype
    rows = max(1, chunk_bytes // (4 * weight.shape[0]))
    vocab = weight.shape[0]
    padded = -(-vocab // align) * align if compute.itemsize == 2 else vocab
    denominator = _denominator(num_items_in_batch, targets, ignore_index, hidden.device)
    track = torch.is_grad_enabled()  # forward runs without grad mode: say whether gradients are wanted
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets, denominator, compute, rows, padded,
                                     ignore_index, track)


def _padded_rows(weight: torch.Tensor, dtype: torch.dtype, rows: int) -> torch.Tensor:
    """`weight` in `dtype` with zero rows appended up to `rows` (the weight itself where nothing is added and the
    dtype is its own)."""
    if rows == weight.shape[0]:
        return weight.to(dtype)
    out = weight.new_zeros((rows, weight.shape[1]), dtype=dtype)
    out[:weight.shape[0]].copy_(weight)
    return out


def _denominator(num_items: Any, targets: torch.Tensor, ignore_index: int, device: torch.device) -> torch.Tensor:
    if num_items is None:
        return (targets != ignore_index).sum().to(torch.float32)  # a mean over counted tokens (0/0 is NaN, as HF)
    if isinstance(num_items, torch.Tensor):
        return num_items.detach().to(device=device, dtype=torch.float32)
    return torch.tensor(float(num_items), device=device)


class _LinearCrossEntropy(torch.autograd.Function):
    """Loss and both gradients in forward, chunk by chunk; backward scales the saved gradients."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, denominator: torch.Tensor, compute: torch.dtype, rows: int, padded: int,
                ignore_index: int, track: bool) -> torch.Tensor:
        wanted = ctx.needs_input_grad if track else (False,) * 3
        h = hidden.reshape(-1, hidden.shape[-1])
        t = targets.reshape(-1)
        wide = torch.promote_types(compute, torch.float32)  # softmax and sums: FP32, or FP64 for a float64 model
        vocab = weight.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):
            w = _padded_rows(weight, compute, padded)
            b = None if bias is None else bias.to(wide)
            total = torch.zeros((), device=h.device, dtype=wide)
            grad_h = torch.empty_like(h) if wanted[0] else None
            grad_w = torch.zeros((padded, weight.shape[1]), device=weight.device, dtype=wide) if wanted[1] else None
            grad_b = torch.zeros_like(bias, dtype=wide) if bias is not None and wanted[2] else None
            for start in range(0, h.shape[0], rows):
                hc, tc = h[start:start + rows].to(compute), t[start:start + rows]
                zp = hc @ w.T  # (n, padded): the only logits alive; the padding's columns are 0
                z = zp[:, :vocab].to(wide)  # a view of zp where the compute dtype is already wide
                if b is not None:
                    z += b
                counted = tc != ignore_index
                picked = tc.clamp(min=0).unsqueeze(1)
                lse = torch.logsumexp(z, dim=1)
                total += ((lse - z.gather(1, picked).squeeze(1)) * counted).sum()
                if not any(wanted[:3]):
                    continue
                g = z.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place of the logits
                g.scatter_add_(1, picked, torch.full_like(lse, -1.0).unsqueeze(1))
                g *= counted.unsqueeze(1)  # d(sum of losses)/d(logits); ignored rows give nothing
                if grad_b is not None:
                    grad_b += g.sum(0)
                if compute != wide:
                    zp[:, :vocab].copy_(g)  # back into the aligned buffer, its padding still 0
                if grad_h is not None:
                    grad_h[start:start + rows] = zp @ w
                if grad_w is not None:
                    grad_w += zp.T @ hc
            if grad_w is not None:
                grad_w = grad_w[:vocab]
        ctx.save_for_backward(grad_h, grad_w, grad_b, denominator)
        ctx.hidden_shape = hidden.shape
        ctx.weight_dtype, ctx.bias_dtype = weight.dtype, None if bias is None else bias.dtype
        return total / denominator.to(wide)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        grad_h, grad_w, grad_b, denominator = ctx.saved_tensors
        scale = grad_out / denominator
        dh = None if grad_h is None else (grad_h * scale.to(grad_h.dtype)).reshape(ctx.hidden_shape)
        dw = None if grad_w is None else (grad_w * scale).to(ctx.weight_dtype)
        db = None if grad_b is None else (grad_b * scale).to(ctx.bias_dtype)
        return dh, dw, db, None, None, None, None, None, None, None
