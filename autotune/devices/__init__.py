"""The device underneath: where training runs and how much memory it may use.

`placement` (device facts, budgets, memory readings, units) · `nvml` (what the driver reports, outside
the allocator) · `ceiling` (the simulated device on the CPU: a byte-counting memory limit) · `allocator`
(the CUDA caching allocator's expandable segments, set unless the user configured it) · `shards` (whether a
tensor is an FSDP2 shard, without importing DTensor's module) · `sampler` (a background thread that samples a
job's processes: their GPU memory in `nvml`, their host memory in the supervisor).
"""
