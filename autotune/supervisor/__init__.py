"""The supervisor behind `autotune run`: it launches a training script, watches it, and restarts it with a
safer plan after an out-of-memory death.

`runner` (the supervisor loop) · `process` (the child process group, signals) · `verdict` (why a child
ended) · `zero_change` (trials of an unmodified script through mapped flags) · `agent` (what runs inside
the job) · `bootstrap` (how every job starts) · `environment` (the facts `autotune doctor` prints).
"""
