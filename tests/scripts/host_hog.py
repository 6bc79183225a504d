"""Grows its resident memory to the MiB given, holds it a moment, then dies as the kernel's OOM killer kills:
by SIGKILL, with no result written. Prints the host budget it was given, for the test to read."""

import os
import signal
import sys
import time

print(f"host budget given: {os.environ.get('AUTOTUNE_HOST_BUDGET')}", flush=True)
held = bytearray(int(sys.argv[1]) * 2**20)
for i in range(0, len(held), 4096):
    held[i] = 1  # touch every page: resident, not only reserved
time.sleep(1.5)  # the supervisor samples the job's memory every 0.2 s
os.kill(os.getpid(), signal.SIGKILL)
