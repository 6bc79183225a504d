"""The technique names fit accepts, and reading a `techniques` setting."""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import InvalidSetting

TECHNIQUES = ("bf16", "checkpointing", "offload", "compile", "optimizer_8bit", "chunked_loss", "fp8",
              "saved_activations", "selective_recompute")
# 8-bit state and float8 matmuls change the numerics: opt-in. Saved-activation offload moves every large tensor a
# block saves over the host link, which hides behind compute only on models with much compute per saved byte:
# opt-in, so the default search does not spend trials on it. Recompute at operator level (`recompute_policy`) runs
# eager only and measured slower than whole blocks on a GPU there: opt-in too.
DEFAULT_TECHNIQUES = ("bf16", "checkpointing", "offload", "compile", "chunked_loss")


def parse_techniques(techniques: Iterable[str] | str | None) -> frozenset[str]:
    """The allowed techniques; None means the default ones (all but the opt-in 'optimizer_8bit', 'fp8',
    'saved_activations' and 'selective_recompute')."""
    if techniques is None:
        return frozenset(DEFAULT_TECHNIQUES)
    if isinstance(techniques, str):
        techniques = [t.strip() for t in techniques.split(",") if t.strip()]
    chosen = frozenset(techniques)
    unknown = sorted(chosen - set(TECHNIQUES))
    if unknown:
        raise InvalidSetting(f"techniques: unknown {', '.join(map(repr, unknown))}; allowed are "
                             f"{', '.join(TECHNIQUES)} (e.g. techniques=('bf16', 'checkpointing'))")
    return chosen
