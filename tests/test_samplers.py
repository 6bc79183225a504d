"""The background samplers of a job's processes: a sample that fails is skipped, and sampling goes on."""

from __future__ import annotations

import os
import time

from autotune.supervisor.host_sampler import HostSampler


def test_the_host_sampler_skips_a_failed_sample_and_samples_on() -> None:
    listings: list[int] = []

    def pids() -> set[int]:
        listings.append(1)
        if len(listings) == 1:  # the first listing fails, as a process tree read mid-change may
            raise ProcessLookupError("the job's process tree changed under the listing")
        return {os.getpid()}

    sampler = HostSampler(pids, interval=0.01).start()
    deadline = time.monotonic() + 10
    while sampler.peak_rss_bytes is None and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop()
    assert len(listings) >= 2
    assert sampler.peak_rss_bytes is not None and sampler.peak_rss_bytes > 0
    assert sampler.least_available_bytes is not None and sampler.least_available_bytes > 0
