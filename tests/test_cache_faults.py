"""Plan-cache faults a user meets: a blank key to `cache delete`, a retune after the clock stepped back, a cache
path that is a dangling symlink, and a teammate's row whose precision or throughput is not what this device gives.

Real SQLite files, the real CLI through click's runner, and the real `autotune.fit` on a tiny GPT on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from cache_samples import sample
from click.testing import CliRunner

from autotune.cache.store import PlanCache
from autotune.cli.main import main


def cli(*args: str) -> click.testing.Result:
    return CliRunner().invoke(main, ["cache", *args], catch_exceptions=False)


# -- `autotune cache delete` with a blank key ---------------------------------------------------------------------

@pytest.mark.parametrize("plans", [1, 2])
@pytest.mark.parametrize("key", ["", "   "])
def test_delete_refuses_a_blank_key_whatever_the_cache_holds(tmp_path: Path, plans: int, key: str) -> None:
    path = tmp_path / "plans.db"
    with PlanCache(path) as store:
        for i in range(plans):
            store.put(*sample(i))
    result = cli("--cache", str(path), "delete", key)
    assert result.exit_code == 2, result.output  # a usage error, before the cache is touched
    assert "is blank" in result.output and "autotune cache list" in result.output
    assert "autotune cache clear" in result.output
    assert len(PlanCache(path).entries()) == plans, "nothing was deleted"
    assert cli("--cache", str(path), "delete", sample(0)[0].key[:10]).exit_code == 0  # a real prefix still works
