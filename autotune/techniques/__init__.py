"""The knobs, each independent of the others (a lattice, not a line), and applying them to a model.

    precision       bf16 autocast (weights stay FP32), fp16 with a GradScaler, or fp32
    checkpointing   how many of the N repeated blocks are recomputed in backward, 0..N
    offload         none; activations (block inputs parked in pinned host memory, with checkpointing);
                    saved_activations (what autograd saves in the blocks not recomputed, streamed to the host
                    and back on a side stream, behind compute);
                    optimizer (FP32 masters and optimizer state on the host, with or without checkpointing)
    compile         torch.compile on the whole model, or per block (a recomputed block inside its checkpoint)
    chunked_loss    a Hugging Face causal LM's head and loss a chunk of tokens at a time (no knob to search:
                    on whenever allowed and the model takes it; `workload/chunked_loss.py`)
    fp8             torchao's float8 matmuls in the linear layers whose shapes they serve (opt-in; CUDA 8.9+)

`names` (the technique names and the `techniques` setting) · `ladder` (the line recovery climbs, block counts,
dtype conflicts) · `apply` (`apply_rung`: a rung in force on a model) · `blocks`, `checkpointing`, `compile`,
`precision`, `sharding`, `offload*`, `optimizer_8bit`, `fp8` (one technique each).
"""

from .apply import AppliedRung, apply_rung
from .blocks import BlockGroup, find_blocks, profile_blocks
from .compile import static_at
from .ladder import FLOAT64_KEPT, block_count, dtype_conflict, is_float64, ladder, serve_dtypes
from .names import DEFAULT_TECHNIQUES, TECHNIQUES, parse_techniques

__all__ = ["TECHNIQUES", "DEFAULT_TECHNIQUES", "FLOAT64_KEPT", "AppliedRung", "apply_rung", "block_count",
           "dtype_conflict", "is_float64", "ladder", "parse_techniques", "serve_dtypes", "find_blocks",
           "profile_blocks", "BlockGroup", "static_at"]
