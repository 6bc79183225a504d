"""The search behind `autotune.fit`: which trial runs next, which plan wins, and why.

`tune` (the driver: setup, controller, phases, the plan and its reason) · `anchors`, `floors` (the rungs measured
first; resident floors) · `controller` over `lines` (memory and time lines), `climb` (rung by rung), `placement`
(the lattice beyond the anchors), `choice` (the pick and its reason) · `state`, `phases` (the pick refined after
the controller: offload share, partitioned state, offload overlap, reduce timing; typed findings) · `trial`
(one measured configuration) · `typical` (the pick's rate at the example's own length, under `max_length`) ·
`ground`, `snapshot` (the model moved, and put back as it came).
"""
