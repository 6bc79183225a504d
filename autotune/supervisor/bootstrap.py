"""`python -m autotune.supervisor.bootstrap SCRIPT [ARGS...]`: how `autotune run` starts every job (see `agent.main`).

A module of its own because `python -m autotune.supervisor.agent` would run a second copy of `autotune.supervisor.agent`
(the package already imports it), which Python warns about.
"""

import sys

from autotune.supervisor.agent import main

if __name__ == "__main__":
    main(sys.argv[1:])
