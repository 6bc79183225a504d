"""Peak FLOP/s of known GPUs: the denominator of model FLOPs utilization (MFU).

Dense (no 2:4 sparsity) tensor-core figures from NVIDIA's datasheets and architecture whitepapers, per
GPU: the 16-bit column is BF16 (FP16 where the GPU has no BF16) with FP32 accumulation, which is what
autocast runs; the FP32 column is plain FP32 without TF32, PyTorch's default for matmuls. A GPU that is
not in the table, or the CPU (the simulated ceiling models a GPU's memory, not its speed), has no peak and
its plans no MFU; `$AUTOTUNE_PEAK_TFLOPS` names the peak where the table does not know it (or to override it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import InvalidSetting

PEAK_ENV = "AUTOTUNE_PEAK_TFLOPS"  # read by autotune.settings, the one reader of autotune's variables

# (pattern searched in torch.cuda.get_device_name(), dense 16-bit TFLOP/s, FP32 TFLOP/s or None).
# First match wins, so the variants (PCIe, NVL) come before the family.
PEAKS: tuple[tuple[str, float, float | None], ...] = (
    (r"H100.*PCIe", 756.0, 51.0),
    (r"H[12]00 NVL", 835.0, 60.0),
    (r"GH200|H200|H100|H800", 989.0, 67.0),  # SXM; H800 computes like the H100 SXM
    (r"B200", 2250.0, None),
    (r"A100|A800", 312.0, 19.5),  # SXM and PCIe alike
    (r"L40S", 362.0, 91.6),
    (r"L40\b", 181.0, 90.5),
    (r"\bL4\b", 121.0, 30.3),
    (r"RTX 4090", 165.2, 82.6),  # GeForce: BF16 at half rate with FP32 accumulation
    (r"RTX 3090", 71.0, 35.6),
    (r"RTX A6000", 154.8, 38.7),
    (r"\bA10\b", 125.0, 31.2),
    (r"V100.*PCIE", 112.0, 14.0),  # no BF16: FP16
    (r"V100", 125.0, 15.7),
    (r"\bT4\b", 65.0, 8.1),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class DevicePeak:
    """What one GPU can compute at most, in FLOP/s, and where the figure came from."""

    half: float | None  # dense BF16/FP16 tensor-core FLOP/s
    fp32: float | None
    source: str  # "AUTOTUNE_PEAK_TFLOPS", the table's pattern, or why there is none

    def flops(self, precision: str) -> float | None:
        """Peak FLOP/s for a plan computing in `precision` ("bf16", "fp16" or "fp32")."""
        return self.fp32 if precision == "fp32" else self.half


def device_peak(device_name: str, kind: str = "cuda", override: str = "") -> DevicePeak:
    """The peak of the device named `device_name`; `kind` "cpu" (the simulated ceiling) has none. `override` is
    $AUTOTUNE_PEAK_TFLOPS's text (`settings.read(PEAK_ENV)`): a peak in TFLOP/s that wins over the table.

    Raises:
        InvalidSetting: `override` is given but not a positive number.
    """
    peak = _override(override)
    if kind != "cuda":
        return DevicePeak(half=None, fp32=None, source="no GPU: the CPU simulates memory, not speed")
    if peak is not None:
        return DevicePeak(half=peak, fp32=peak, source=PEAK_ENV)
    for pattern, half, fp32 in PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return DevicePeak(half=half * 1e12, fp32=fp32 * 1e12 if fp32 else None, source=pattern)
    return DevicePeak(half=None, fp32=None, source=f"{device_name!r} is not in the table; set {PEAK_ENV}")


def _override(text: str) -> float | None:
    text = text.strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise InvalidSetting(f"{PEAK_ENV} must be the GPU's peak in TFLOP/s, a positive number (e.g. 989 for an "
                             f"H100 SXM in BF16); got {text!r}. Unset it to use autotune's table.")
    return value * 1e12
