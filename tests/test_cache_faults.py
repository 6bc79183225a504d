"""Plan-cache faults a user meets: a blank key to `cache delete`, a retune after the clock stepped back, a cache
path that is a dangling symlink, and a teammate's row whose precision or throughput is not what this device gives.

Real SQLite files, the real CLI through click's runner, and the real `autotune.fit` on a tiny GPT on the CPU.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from cache_samples import clean_environment, fit, sample, tiny_workload  # noqa: F401
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


# -- a retune after the clock stepped back --------------------------------------------------------------------------

def dated(path: Path, seconds: float) -> None:
    """Date every stored plan of the cache file at `path` `seconds` from now, as a clock later stepped back left it."""
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("UPDATE plans SET updated = ?", (time.time() + seconds,))


def test_a_new_plan_replaces_a_stored_one_dated_a_little_in_the_future(tmp_path: Path) -> None:
    path = tmp_path / "plans.db"
    first, parts = sample(0, micro=4)
    second, _ = sample(0, micro=2)
    with PlanCache(path) as store:
        store.put(first, parts)
    dated(path, 30.0)
    with PlanCache(path) as store:
        store.put(second, parts)
        hit = store.get(second.key)
    assert hit is not None and hit.micro_batch_size == 2, "the new plan was stored"


def test_retune_stores_its_plan_over_a_row_dated_a_little_in_the_future(tmp_path: Path) -> None:
    path = tmp_path / "plans.db"
    model, batch = tiny_workload()
    plan = fit(model, batch, path, max_trials=2)
    dated(path, 30.0)
    retuned = fit(model, batch, path, max_trials=2, retune=True)
    assert retuned.source == "tuned"
    (entry,) = PlanCache(path).entries()
    assert entry.key == plan.key and entry.updated <= time.time(), "the retuned plan replaced the stored one"


# -- a cache path that is a dangling symlink ------------------------------------------------------------------------

@pytest.fixture
def umask_022() -> Iterator[None]:
    """The usual umask, under which a file made with default modes is 0644."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.usefixtures("umask_022")
@pytest.mark.parametrize("where", ["plans.db", "made/for/it/plans.db"])
def test_a_cache_path_that_is_a_dangling_symlink_gets_a_private_file(tmp_path: Path, where: str) -> None:
    target = tmp_path / "real" / where
    (tmp_path / "real").mkdir()
    link = tmp_path / "link.db"
    link.symlink_to(target)
    with PlanCache(link, strict=True) as store:
        store.put(*sample(0))
    assert link.is_symlink() and target.is_file(), "the file is made where the link points"
    assert mode(target) == 0o600
    made = [p for p in target.parents if tmp_path / "real" in p.parents]
    assert [mode(d) for d in made] == [0o700] * len(made)  # the directories made for it (none for plans.db)
    assert mode(tmp_path / "real") == 0o755, "an existing directory keeps its owner's mode"
    assert PlanCache(link).get(sample(0)[0].key) is not None
