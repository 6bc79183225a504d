"""The search behind `autotune.fit`: which trial runs next, which plan wins, and why.

`tune` (the driver: setup, controller, phases, the plan and its reason) · `anchors`, `floors` (the rungs measured
first; resident floors) · `controller` (the steps in order over one `ledger`): `climb`, `compile_beside`,
`blocks`, `compiled_recompute`, `choice`, `recheck`, `runoff`, each one step, over `lines` (memory and time
lines), `measure` (one trial), `explore` (one rung), `placement` (the lattice predicted) · `state`, `phases`
(the pick refined after the controller: offload share, partitioned state, offload overlap, reduce timing; typed
findings) · `trial` (one measured configuration) · `typical` (the pick's rate at the example's own length, under
`max_length`) · `ground`, `snapshot` (the model moved, and put back as it came).
"""
