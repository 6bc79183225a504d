"""Tiny, randomly initialised Hugging Face models of the families people train, each with an example batch.

Nothing is downloaded: every model is built from a config a few units wide, float64, seeded, with every dropout,
drop-path, layer-drop and SpecAugment probability at 0, so that a forward in train mode is a function of the
weights and the batch alone (a step and its reference compute the same thing, whatever the plan recomputes).
Batches are 8 samples whose losses count different numbers of items (padding, masked positions, ignored pixels),
so a mis-weighted micro-batch shows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from torch import nn

N = 8  # samples in every example batch: the global batch
VOCAB = 64
QUIET = ("dropout", "pdrop", "drop_path", "layerdrop", "mask_time_prob", "mask_feature_prob")


@dataclass(frozen=True, kw_only=True, slots=True)
class Family:
    """One model family: `build()` gives a float64 model in train mode and its example batch."""

    name: str
    task: str  # "masked-lm", "causal-lm", "seq2seq", "ctc", "audio-cls", "image-cls", "segmentation", ...
    build: Callable[[], tuple[nn.Module, dict[str, torch.Tensor]]]


def quiet(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """`config` with every dropout-like probability at 0, in its sub-configs too (a vision-language model's)."""
    for name, value in list(vars(config).items()):
        if isinstance(value, transformers.PretrainedConfig):
            quiet(value)
        elif isinstance(value, float) and any(word in name for word in QUIET):
            setattr(config, name, 0.0)
    return config


def made(model_class: type, config: transformers.PretrainedConfig, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return model_class(quiet(config)).double().train()


def lengths(low: int, high: int, seed: int) -> list[int]:
    """N lengths in [low, high], the longest first (so the batch is as long as its longest sample)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.randint(low, high + 1, (N,), generator=g).tolist()
    out[0] = high
    return out


def text(t: int = 12, seed: int = 0, *, low: int = 4, pad: int = 0, first: int = 4) -> dict[str, torch.Tensor]:
    """Right-padded token ids (pad id `pad`) of N random lengths in [low, t], and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(first, VOCAB - 1, (N, t), generator=g)  # VOCAB - 1 is kept for LLaVA's image token
    mask = torch.zeros(N, t, dtype=torch.long)
    for i, length in enumerate(lengths(low, t, seed)):
        mask[i, :length] = 1
    ids[mask == 0] = pad
    return {"input_ids": ids, "attention_mask": mask}


def causal(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Labels are the ids, -100 on padding."""
    return {**batch, "labels": batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)}


def masked(batch: dict[str, torch.Tensor], mask_id: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """MLM: about a quarter of the real tokens (at least one a sample) replaced by `mask_id`; labels -100 elsewhere."""
    g = torch.Generator().manual_seed(seed + 1)
    chosen = (torch.rand(batch["input_ids"].shape, generator=g) < 0.25) & (batch["attention_mask"] == 1)
    chosen[:, 1] = True
    labels = batch["input_ids"].masked_fill(~chosen, -100)
    return {**batch, "input_ids": batch["input_ids"].masked_fill(chosen, mask_id), "labels": labels}


def classes(k: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, k, (N,), generator=torch.Generator().manual_seed(seed + 2))


def images(size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(N, 3, size, size, generator=torch.Generator().manual_seed(seed + 3), dtype=torch.float64)


def audio(samples: int = 400, seed: int = 0) -> dict[str, torch.Tensor]:
    """Raw waveforms of N random lengths (zero-padded) and their attention mask."""
    g = torch.Generator().manual_seed(seed + 4)
    values = torch.randn(N, samples, generator=g, dtype=torch.float64)
    mask = torch.zeros(N, samples, dtype=torch.long)
    for i, length in enumerate(lengths(samples // 2, samples, seed)):
        mask[i, :length] = 1
    return {"input_values": values * mask, "attention_mask": mask}


# -- configs ------------------------------------------------------------------------------------------------

BERTLIKE = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                max_position_embeddings=32)
DECODER = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=2, max_position_embeddings=32)
WAV2VEC2 = dict(vocab_size=12, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                conv_dim=(8, 8), conv_kernel=(10, 3), conv_stride=(5, 2), num_conv_pos_embeddings=8,
                num_conv_pos_embedding_groups=2, pad_token_id=0)


def bert_mlm():
    return made(transformers.BertForMaskedLM, transformers.BertConfig(**BERTLIKE)), masked(text(), mask_id=3)


def roberta_mlm():
    config = transformers.RobertaConfig(**{**BERTLIKE, "max_position_embeddings": 40}, pad_token_id=1)
    return made(transformers.RobertaForMaskedLM, config), masked(text(pad=1), mask_id=3)


def modernbert_mlm():
    config = transformers.ModernBertConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                           num_attention_heads=2, max_position_embeddings=32, local_attention=8,
                                           pad_token_id=0, bos_token_id=1, eos_token_id=2, sep_token_id=2,
                                           cls_token_id=1, mask_token_id=3)
    return made(transformers.ModernBertForMaskedLM, config), masked(text(), mask_id=3)


def eurobert_mlm():
    config = transformers.EuroBertConfig(**DECODER, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                         mask_token_id=3)
    return made(transformers.EuroBertForMaskedLM, config), masked(text(), mask_id=3)


def distilbert_mlm():
    config = transformers.DistilBertConfig(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, hidden_dim=32,
                                           max_position_embeddings=32)
    return made(transformers.DistilBertForMaskedLM, config), masked(text(), mask_id=3)


def gpt2_lm():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_layer=2, n_embd=16, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    return made(transformers.GPT2LMHeadModel, config), causal(text())


def llama_lm():
    return made(transformers.LlamaForCausalLM, transformers.LlamaConfig(**DECODER)), causal(text())


def qwen2_lm():
    return made(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**DECODER)), causal(text())


def gpt_neox_lm():
    # Its head is `embed_out`, not `lm_head`: the chunked loss does not apply, the model's own loss is kept.
    config = transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=32, max_position_embeddings=32)
    return made(transformers.GPTNeoXForCausalLM, config), causal(text())


def t5_seq2seq():
    config = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    labels = causal(text(t=8, seed=2))["labels"]
    return made(transformers.T5ForConditionalGeneration, config), {**text(seed=1), "labels": labels}


def bart_seq2seq():
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                     decoder_ffn_dim=32, max_position_embeddings=32, pad_token_id=1,
                                     bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    batch = text(pad=1, seed=1)
    labels = text(t=8, seed=2, pad=1)
    return made(transformers.BartForConditionalGeneration, config), {
        **batch, "labels": labels["input_ids"].masked_fill(labels["attention_mask"] == 0, -100)}


def ctc_labels(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 5)
    labels = torch.randint(1, 12, (N, 6), generator=g)
    for i, length in enumerate(lengths(2, 6, seed)):
        labels[i, length:] = -100
    return labels


def wav2vec2_ctc():  # ctc_loss_reduction "sum", the config's default
    config = transformers.Wav2Vec2Config(**WAV2VEC2)
    return made(transformers.Wav2Vec2ForCTC, config), {**audio(), "labels": ctc_labels()}


def hubert_ctc():  # ctc_loss_reduction "mean", as many fine-tuned checkpoints set it
    config = transformers.HubertConfig(**WAV2VEC2, ctc_loss_reduction="mean", feat_extract_norm="layer")
    return made(transformers.HubertForCTC, config), {**audio(), "labels": ctc_labels()}


def wav2vec2_audio_cls():
    config = transformers.Wav2Vec2Config(**WAV2VEC2, num_labels=3, classifier_proj_size=8)
    return made(transformers.Wav2Vec2ForSequenceClassification, config), {**audio(), "labels": classes(3)}


def vit_image_cls():
    config = transformers.ViTConfig(image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=32, num_labels=5)
    return made(transformers.ViTForImageClassification, config), {"pixel_values": images(16), "labels": classes(5)}


def convnext_image_cls():
    config = transformers.ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=5, patch_size=2)
    return made(transformers.ConvNextForImageClassification, config), {"pixel_values": images(16), "labels": classes(5)}


def resnet_image_cls():  # BatchNorm: its running statistics update in every forward
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                                       num_labels=5)
    return made(transformers.ResNetForImageClassification, config), {"pixel_values": images(16), "labels": classes(5)}


def segformer_segmentation():
    """Ignored pixels carry 255, Segformer's `semantic_loss_ignore_index`; a different share in every image."""
    config = transformers.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
                                          num_attention_heads=[1, 2], patch_sizes=[3, 3], strides=[2, 2],
                                          mlp_ratios=[2, 2], decoder_hidden_size=16, num_labels=4)
    g = torch.Generator().manual_seed(6)
    labels = torch.randint(0, 4, (N, 16, 16), generator=g)
    for i, rows in enumerate(lengths(2, 14, 0)):
        labels[i, rows:] = 255
    return made(transformers.SegformerForSemanticSegmentation, config), {"pixel_values": images(16), "labels": labels}


def llava_vision_language():
    """A CLIP vision tower (4 patches of a 8x8 image) before a Llama; labels -100 on the image tokens and padding."""
    vision = transformers.CLIPVisionConfig(image_size=8, patch_size=4, hidden_size=16, intermediate_size=32,
                                           num_hidden_layers=2, num_attention_heads=2, projection_dim=16)
    text_config = transformers.LlamaConfig(**DECODER)
    image_token = VOCAB - 1
    config = transformers.LlavaConfig(vision_config=vision, text_config=text_config, image_token_index=image_token,
                                      image_seq_length=4)
    batch = text(t=14, low=8)
    batch["input_ids"][:, 1:5] = image_token  # after a first text token, as chat templates put it
    batch["input_ids"][:, 0] = 4
    labels = batch["input_ids"].masked_fill((batch["attention_mask"] == 0) | (batch["input_ids"] == image_token), -100)
    model = made(transformers.LlavaForConditionalGeneration, config)
    # Frozen, as LLaVA's recipes train it: the tower's last layer feeds nothing (features come from layer -2)
    model.model.vision_tower.requires_grad_(False)
    return model, {**batch, "pixel_values": images(8), "labels": labels}


MOE_COEF = 0.5  # the router loss's weight: large, so a mis-weighted router loss shows


def mixtral_moe():
    config = transformers.MixtralConfig(**DECODER, num_local_experts=4, num_experts_per_tok=2,
                                        output_router_logits=True, router_aux_loss_coef=MOE_COEF,
                                        experts_implementation="eager")
    return made(transformers.MixtralForCausalLM, config), causal(text())


def qwen2_moe():
    config = transformers.Qwen2MoeConfig(**DECODER, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                         num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                                         output_router_logits=True, router_aux_loss_coef=MOE_COEF,
                                         experts_implementation="eager")
    return made(transformers.Qwen2MoeForCausalLM, config), causal(text())


def bert_sequence_cls():
    config = transformers.BertConfig(**BERTLIKE, num_labels=3)
    return made(transformers.BertForSequenceClassification, config), {**text(), "labels": classes(3)}


def roberta_regression():  # num_labels 1: a mean squared error over samples
    config = transformers.RobertaConfig(**{**BERTLIKE, "max_position_embeddings": 40}, pad_token_id=1, num_labels=1)
    targets = torch.randn(N, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    return made(transformers.RobertaForSequenceClassification, config), {**text(pad=1), "labels": targets}


def gpt_neox_sequence_cls():
    config = transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=32, max_position_embeddings=32, num_labels=3, pad_token_id=0)
    return made(transformers.GPTNeoXForSequenceClassification, config), {**text(), "labels": classes(3)}


def bert_token_cls():
    config = transformers.BertConfig(**BERTLIKE, num_labels=4)
    batch = text()
    labels = torch.randint(0, 4, batch["input_ids"].shape, generator=torch.Generator().manual_seed(8))
    return made(transformers.BertForTokenClassification, config), {
        **batch, "labels": labels.masked_fill(batch["attention_mask"] == 0, -100)}


FAMILIES = [Family(name=f.__name__, task=task, build=f) for task, f in [
    ("masked-lm", bert_mlm), ("masked-lm", roberta_mlm), ("masked-lm", modernbert_mlm), ("masked-lm", eurobert_mlm),
    ("masked-lm", distilbert_mlm),
    ("causal-lm", gpt2_lm), ("causal-lm", llama_lm), ("causal-lm", qwen2_lm), ("causal-lm", gpt_neox_lm),
    ("seq2seq", t5_seq2seq), ("seq2seq", bart_seq2seq),
    ("ctc", wav2vec2_ctc), ("ctc", hubert_ctc),
    ("audio-cls", wav2vec2_audio_cls),
    ("image-cls", vit_image_cls), ("image-cls", convnext_image_cls), ("image-cls", resnet_image_cls),
    ("segmentation", segformer_segmentation),
    ("vision-language", llava_vision_language),
    ("moe", mixtral_moe), ("moe", qwen2_moe),
    ("sequence-cls", bert_sequence_cls), ("sequence-cls", roberta_regression),
    ("sequence-cls", gpt_neox_sequence_cls), ("token-cls", bert_token_cls),
]]
