"""The search behind `autotune.fit`: which trial runs next, which plan wins, and why.

`tune` (the driver: setup, controller, the plan and its reason) · `anchors`, `floors` (the rungs measured first;
resident floors) · `controller` (the steps in order over one `ledger`, from the first anchor to the plan):
`climb`, `compile_beside`, `blocks`, `compiled_recompute`, `choice`, `recheck`, `runoff`, then after the pick
`offload_share`, `partitioned_state`, `offload_overlap`, `reduce_timing`, each one step, over `lines` (memory and
time lines), `measure` (one trial), `explore` (one rung), `placement` (the lattice predicted) · `plan_reason`
(the plan's reason, composed once from the ledger) · `trial` (one measured configuration) · `typical` (the
pick's rate at the example's own length, under `max_length`) · `ground`, `snapshot` (the model moved, and put
back as it came).
"""
