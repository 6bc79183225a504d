"""Writes the CUDA allocator configuration its environment gives it to the file named first, and exits 0
without calling fit (`autotune run` then says nothing was tuned)."""

import os
import sys

with open(sys.argv[1], "w") as out:
    out.write(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "unset"))
