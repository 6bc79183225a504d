"""`python -m autotune.bootstrap SCRIPT [ARGS...]`: how `autotune run` starts every job (see `agent.main`).

A module of its own because `python -m autotune.agent` would run a second copy of `autotune.agent`
(the package already imports it), which Python warns about.
"""

import sys

from autotune.agent import main

if __name__ == "__main__":
    main(sys.argv[1:])
