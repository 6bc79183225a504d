"""Ignores SIGTERM, and so does the grandchild it starts; writes both pids to argv[1] once both exist.

Only SIGKILL stops them: `autotune run` must send it to the whole group after the grace period.
"""

import os
import signal
import subprocess
import sys
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = subprocess.Popen([sys.executable, "-c", "import signal, time\n"
                               "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                               "print('ready', flush=True)\n"
                               "time.sleep(3600)"], stdout=subprocess.PIPE)
grandchild.stdout.readline()  # its handler is installed
tmp = sys.argv[1] + ".tmp"
with open(tmp, "w") as f:
    f.write(f"{os.getpid()} {grandchild.pid}")
os.replace(tmp, sys.argv[1])
while True:
    time.sleep(1)
