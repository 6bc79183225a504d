"""The Python heap during a tune: what was alive before it is set aside from the garbage collector, so the
`gc.collect()` each trial's clean-up runs walks only what the trials made.

A trial's clean-up collects garbage so that cycles holding device tensors (autograd graphs caught in
exceptions, hooks) free their memory before the next trial measures its peak. With a framework such as
transformers imported and a large model built, one full collection walks hundreds of thousands of objects
(0.15 s on a 2-core machine, 0.3 s a trial on a GPU host: seconds over a tune) to find none of them garbage.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def set_aside() -> Iterator[None]:
    """Freeze the objects alive now (`gc.freeze`) for the body and unfreeze them after, so collections inside
    walk only the objects made since. Left alone where the process froze objects itself: `gc.unfreeze` would
    hand back its frozen objects too."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()  # what is garbage now is collected, not kept frozen for the whole tune
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
