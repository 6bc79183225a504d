"""Step: the recheck. Decides whether a win is believable: recomputing blocks and offloading only add work, so a
configuration that does more of both and still beats one that does less by more than noise, at no larger a
micro-batch, was measured in a disturbed moment; both are measured again, longer, and the pick made again."""

from __future__ import annotations

from ..configuration import Rung
from ..evidence import Trial
from .deadline import OutOfTime
from .ledger import Ledger
from .lines import NOISE, best_so_far
from .noise import timed_with


def recheck_recompute(s: Ledger) -> Ledger:
    """Step: the pick, re-made after a win that the added work cannot explain was measured again (`rechecked`).
    Cut short by max_tune_seconds (`OutOfTime`), the pick is the best measured: a re-measurement may have taken
    a first reading's place already."""
    try:
        s.pick = rechecked(s, s.picked())
    except OutOfTime:
        s.pick = best_so_far(s) or s.pick
        raise
    return s


def rechecked(s: Ledger, best: Trial) -> Trial:
    """Re-measure a win that the work a configuration adds cannot explain, rather than believe it.

    Recomputing blocks and offloading only add work: at the same or a smaller micro-batch, with the same
    compile, a configuration that recomputes as many blocks or more and offloads the same (or, beside one
    that offloads nothing, anything) cannot beat the other by more than noise. When it seems to (a
    neighbour took the CPU during the plain trial: "4.46x faster with checkpointing" on ResNet-18 at a
    roomy budget; "offload <0.01% of the parameters, 4.90x faster" on a tiny model), both are measured
    again, longer; the re-measurements take the first ones' places in the record (their notes keep the
    first figures, their seconds and phases the first ones' too: a first reading's compile stays in the tune's
    account), and the pick is made again.
    """
    if s.remeasure is None or (best.rung.checkpointing, best.rung.offload) == ("none", "none"):
        return best
    ok = [t for t in s.trials if t.fits]
    # (more work, less work) pairs where the one with more work ran at a micro-batch no larger and still won
    pairs = [(c, p) for c in ok for p in ok if _adds_work(c.rung, p.rung)
             and c.micro_batch_size <= p.micro_batch_size
             and c.samples_per_second > p.samples_per_second * (1 + NOISE)]
    if not pairs:
        return best
    ckpt, plain = max(pairs, key=lambda cp: cp[0].samples_per_second / cp[1].samples_per_second)
    now = []
    for first in (ckpt, plain):
        again = s.remeasure(first.rung, first.micro_batch_size)
        now.append(timed_with(again, (first, again), f"re-measured; first {first.samples_per_second:,.1f} samples/s"))
        s.trials[s.trials.index(first)] = now[-1]
    # Said with the figures the pick is then made on: the first ones are in the re-measured trials' notes.
    factor = now[0].samples_per_second / now[1].samples_per_second if now[1].samples_per_second else 0.0
    what = "recompute" if ckpt.rung.offload == plain.rung.offload else "offloading"
    s.notes.append(
        f"{ckpt.rung.name} at micro-batch {ckpt.micro_batch_size} beat {plain.rung.name} at micro-batch "
        f"{plain.micro_batch_size} by more than {what} can explain: both re-measured, now {factor:.2f}x")
    return best_so_far(s) or best

_DEPTH = {"none": 0, "selective": 1, "full": 2}  # a label's order, for rungs that carry no block count


def _depth(rung: Rung) -> tuple[int, int]:
    return _DEPTH[rung.checkpointing], rung.checkpointed_blocks or 0


def _adds_work(more: Rung, less: Rung) -> bool:
    """Whether `more` does all the work `less` does and more: the same precision and compile, as many recomputed
    blocks or more, and the same offload or offload where `less` has none."""
    return (more != less and (more.precision, more.compile) == (less.precision, less.compile)
            and _depth(more) >= _depth(less)
            and (more.offload == less.offload or less.offload == "none"))
