"""Sleeps until interrupted (a SIGINT raises KeyboardInterrupt); writes its pid to argv[1] when ready."""

import os
import sys
import time

tmp = sys.argv[1] + ".tmp"
with open(tmp, "w") as f:
    f.write(str(os.getpid()))
os.replace(tmp, sys.argv[1])
while True:
    time.sleep(1)
