"""`autotune plot [KEY] --output FILE.png`: draw a search, from the plan cache or from a file holding a plan."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ..cache.store import CacheError, PlanCache
from ..plan import Plan
from ..plotting import PlotUnavailable, draw_search, require_matplotlib

EXAMPLES = """\b
Examples:
  autotune plot --output search.png                 the newest plan in the cache
  autotune plot 3f2a9c --output search.png          one plan, by key prefix (autotune cache list)
  autotune plot --cache gpu-box.db -o search.png    a cache file brought from another machine
  autotune plot --plan plan.json -o search.png      autotune run --json output, a cache export, a benchmark log
"""


class EnvironmentUnfit(click.ClickException):
    """Exit code 4, autotune's environment error: an optional dependency or the cache is unusable."""

    exit_code = 4


@click.command(epilog=EXAMPLES)
@click.argument("key", required=False, default="")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Image to write; the suffix picks the format (.png, .svg, .pdf).")
@click.option("--cache", "cache_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Plan cache file to read (default: $AUTOTUNE_CACHE, else the user cache).")
@click.option("--plan", "plan_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Read the plan from this JSON or JSON-lines file instead of the cache: the last plan in it, "
              "or the one whose key starts with KEY.")
@click.option("--title", default=None, help="What was tuned, for the picture's title (default: the model's class "
              "from the cache).")
def plot(key: str, output: Path, cache_path: Path | None, plan_file: Path | None, title: str | None) -> None:
    """Draw what a search tried: throughput and peak memory against micro-batch, per configuration.

    The chosen plan is a star, out-of-memory trials are crosses, and the memory side shows the budget and
    the limit (budget less margin). Needs matplotlib: pip install matplotlib.
    """
    try:
        require_matplotlib()
    except PlotUnavailable as exc:
        raise EnvironmentUnfit(str(exc)) from exc
    plan, found_title = _from_file(plan_file, key) if plan_file else _from_cache(cache_path, key)
    try:
        written = draw_search(plan, output, title=title if title is not None else found_title)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    except OSError as exc:
        raise click.ClickException(f"cannot write {output}: {exc.strerror or exc}; choose a writable path") from exc
    click.echo(f"wrote {written}: {len(plan.trials)} trials, chosen {plan.summary()}")


def _from_cache(cache_path: Path | None, key: str) -> tuple[Plan, str]:
    try:
        store = PlanCache(cache_path, strict=True)
        entries = store.entries(key, team=True)
    except CacheError as exc:
        raise EnvironmentUnfit(str(exc)) from exc
    entries = [e for e in entries if e.plan is not None]
    if not entries:
        what = f"with a key starting with {key!r}" if key else "at all"
        raise click.ClickException(f"no readable cached plan {what} in {store.path}; run `autotune cache list`, or "
                                   "pass --cache FILE or --plan FILE")
    if key and len(entries) > 1:
        raise click.ClickException(f"{len(entries)} plans have keys starting with {key!r}; give more of the key")
    entry = entries[0]  # newest first
    model = entry.parts.get("model", {})
    return entry.plan, str(model.get("class", "")) if isinstance(model, dict) else ""  # type: ignore[return-value]


def _from_file(path: Path, key: str) -> tuple[Plan, str]:
    plans = [p for p in _plan_dicts(_read_json(path)) if str(p.get("provenance", p).get("key", "")).startswith(key)]
    if not plans:
        raise click.ClickException(f"no plan{' with key ' + repr(key) if key else ''} in {path}; give the output of "
                                   "`autotune run --json`, `autotune cache export` or a benchmark's JSON lines")
    try:
        read = Plan.from_dict if "config" in plans[-1] else Plan.from_flat_dict  # a record of plan format 2
        return read(plans[-1]), ""
    except (TypeError, ValueError) as exc:
        raise click.ClickException(f"the last plan in {path} is not readable: {exc}") from exc


def _read_json(path: Path) -> list[Any]:
    """The file as one JSON document, else as JSON lines (blank lines skipped)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise click.ClickException(f"cannot read {path}: {exc}") from exc
    try:
        return [json.loads(text)]
    except ValueError:
        pass
    try:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except ValueError as exc:
        raise click.ClickException(f"{path} is neither JSON nor JSON lines: {exc}") from exc


def _plan_dicts(value: Any, depth: int = 0) -> list[dict[str, Any]]:
    """Every plan in `value`, in document order, however deep it sits (a cache entry's "plan", a benchmark
    record's "run" -> "plan"): a dict with a config, evidence and provenance, or a flat one of plan format 2."""
    if depth > 8:
        return []
    if isinstance(value, dict):
        if all(isinstance(value.get(part), dict) for part in ("config", "evidence", "provenance")) or (
                "trials" in value and "micro_batch_size" in value and "precision" in value):  # plan format 2
            return [value]
        return [p for v in value.values() for p in _plan_dicts(v, depth + 1)]
    if isinstance(value, list):
        return [p for v in value for p in _plan_dicts(v, depth + 1)]
    return []
