"""`autotune cache ...`: list, show, export, import, delete and clear cached plans, and say where they live.

Each command parses its options, makes one `PlanCache` call, and maps the cache's errors to click
exceptions that name the fix. The cache is opened with `strict=True`: here a broken database is an error
to report (exit code 4, an environment error), not something to carry on without as training does.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, TextIO, TypeVar

import click

from ..cache.rows import NothingFits, printable
from ..cache.store import CacheEntry, CacheError, PlanCache, default_path
from ..plan import Plan
from ..sizes import format_bytes

T = TypeVar("T")


class CacheUnusable(click.ClickException):
    """The plan cache cannot be used; exit code 4 is autotune's environment error."""

    exit_code = 4


CACHE_HELP = "The plan cache file (default: $AUTOTUNE_CACHE, else ~/.cache/autotune/plans.db)."
CACHE_FILE = click.Path(dir_okay=False, path_type=Path)


def cache_file(command: Callable[..., None]) -> Callable[..., None]:
    """`command` given the cache file as its first argument, from `--cache FILE` before the subcommand
    (`autotune cache --cache F list`) or after it (`autotune cache list --cache F`, as `autotune plot` takes
    it); the one after wins."""
    @click.option("--cache", "cache_here", type=CACHE_FILE, default=None, help=CACHE_HELP)
    @click.pass_obj
    @functools.wraps(command)
    def with_cache(group_path: Path | None, cache_here: Path | None, **kwargs: Any) -> None:
        command(cache_here or group_path, **kwargs)
    return with_cache


@click.group()
@click.option("--cache", "cache_path", type=CACHE_FILE, default=None, help=CACHE_HELP)
@click.pass_context
def cache(ctx: click.Context, cache_path: Path | None) -> None:
    """Inspect and share cached plans: what autotune tuned before, and for what.

    \b
    Examples:
      autotune cache list                          plans cached for this user
      autotune cache list --cache gpu-box.db       plans in another cache file
      autotune cache export team/plans.jsonl       share them; teammates run `autotune cache import`
      autotune cache show 3f2a9c                   one plan in full (a key prefix is enough)
    """
    ctx.obj = cache_path


@cache.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the plans (and 'nothing fits' records) as a JSON list.")
@click.option("--team", is_flag=True, help="Also list the plans and 'nothing fits' records in $AUTOTUNE_TEAM_DIR.")
@cache_file
def list_(cache_path: Path | None, as_json: bool, team: bool) -> None:
    """List cached plans: model, GPU, budget, plan, throughput (tokens/s or samples/s), age and status; then
    the searches that found nothing fits (`fit` refuses those at once; retune=True searches again).

    \b
    Examples:
      autotune cache list
      autotune cache list --json | jq '.[].plan.config.micro_batch_size'
    """
    store = _open(cache_path)
    found, refused = _call(lambda: (store.entries(team=team), store.nothing_fits_entries(team=team)))
    if as_json:
        rows: list[CacheEntry | NothingFits] = [*found, *refused]
        click.echo(json.dumps([e.to_dict() for e in rows], indent=2))
        return
    if found:
        headers = ["KEY", "MODEL", "GPU", "BUDGET", "PLAN", "HOST", "THROUGHPUT", "MFU", "AGE", "STATUS"]
        click.echo(_table(headers, [_list_row(e) for e in found]))
    else:
        click.echo(f"no cached plans in {store.path}")
    if refused:
        click.echo("\nsearches that found nothing fits (fit refuses at once; retune=True searches again):")
        click.echo(_table(["KEY", "MODEL", "GPU", "BUDGET", "TRIALS", "AGE", "ORIGIN"],
                          [_refusal_row(r) for r in refused]))


@cache.command()
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="Print the plan, its key parts and failures as JSON.")
@cache_file
def show(cache_path: Path | None, key: str, as_json: bool) -> None:
    """Show one cached plan in full: what it was tuned for, the plan, why, its trials and failures (or a
    search that found nothing fits: its message and trials).

    KEY may be the first few characters of the key, as `autotune cache list` prints it.

    \b
    Example:
      autotune cache show 3f2a9c
    """
    entry = _one(_open(cache_path), key, team=True)
    click.echo(json.dumps(entry.to_dict(), indent=2) if as_json else _describe(entry))


@cache.command("export")
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True, path_type=Path))
@cache_file
def export_(cache_path: Path | None, file: Path) -> None:
    """Write every cached plan, with its key parts and failures, to FILE as JSON lines (`-`: standard output),
    and every "nothing fits" record (a search that found no configuration), so teammates skip that search.

    \b
    Examples:
      autotune cache export /shared/team/plans-$(whoami).jsonl
      autotune cache export - | ssh gpu-box autotune cache import -
    """
    store = _open(cache_path)
    to_stdout = str(file) == "-"
    # sys.stdout at call time, as click's get_text_stream gave (deprecated in click 8.5, typed `object` there)
    target: TextIO | Path = sys.stdout if to_stdout else file
    try:
        count = _call(lambda: store.export(target))
    except OSError as exc:
        raise click.ClickException(f"cannot write {file}: {exc.strerror}; choose a writable path") from exc
    if to_stdout:  # the rows are the output; the count goes to stderr
        click.echo(f"exported {count} row(s) to standard output", err=True)
        return
    click.echo(f"exported {count} row(s) (plans and 'nothing fits' records) to {file}; teammates can "
               f"`autotune cache import {file}`, or keep it in the directory $AUTOTUNE_TEAM_DIR names")


@cache.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, allow_dash=True, path_type=Path))
@cache_file
def import_(cache_path: Path | None, file: Path) -> None:
    """Validate every row of an export FILE (`-`: standard input) and store the valid ones; rejected rows are
    listed with the reason.

    A plan already cached here and newer than the imported one is kept. A "nothing fits" record is stored
    unless a plan, or a newer record, is cached here for its key.

    \b
    Examples:
      autotune cache import /shared/team/plans-alice.jsonl
      ssh gpu-box autotune cache export - | autotune cache import -
    """
    store = _open(cache_path)
    source: BinaryIO | Path = sys.stdin.buffer if str(file) == "-" else file  # as export's stdout
    try:
        report = _call(lambda: store.import_(source))
    except OSError as exc:
        raise click.ClickException(f"cannot read {file}: {exc.strerror}; check the path and its permissions") from exc
    for line, why in report.rejected:
        click.echo(f"rejected line {line}: {why}", err=True)
    refusals = f" and {len(report.nothing_fits)} 'nothing fits' record(s)" if report.nothing_fits else ""
    click.echo(f"imported {len(report.accepted)} plan(s){refusals} from {file} into {store.path}")
    if report.rejected:
        raise click.ClickException(f"{len(report.rejected)} row(s) of {file} were rejected (listed above) and the "
                                   "valid rows imported; ask for a fresh `autotune cache export` to replace the file")


@cache.command()
@click.argument("key")
@cache_file
def delete(cache_path: Path | None, key: str) -> None:
    """Forget one cached plan (and the failures recorded against it), or a 'nothing fits' record; KEY may be
    a prefix.

    \b
    Example:
      autotune cache delete 3f2a9c
    """
    if not key.strip():  # a blank prefix matches every key: it would delete whatever plan happens to be alone
        raise click.UsageError(f"KEY {key!r} is blank, and a blank prefix matches every cached plan; give the first "
                               "characters of one key, as `autotune cache list` prints them (`autotune cache clear` "
                               "forgets them all)")
    store = _open(cache_path)
    entry = _one(store, key, team=False)
    _call(lambda: store.delete(entry.key))
    click.echo(f"deleted {entry.key[:12]} ({_model(entry.parts)} on {_gpu(entry.parts)})")


@cache.command()
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@cache_file
def clear(cache_path: Path | None, yes: bool) -> None:
    """Forget every cached plan and failure (asks first, unless --yes).

    \b
    Example:
      autotune cache clear --yes
    """
    store = _open(cache_path)
    count = len(_call(store.entries))
    if count == 0:
        click.echo(f"no cached plans in {store.path}; nothing to clear")
        return
    if not yes:
        click.confirm(f"Delete all {count} cached plan(s) in {store.path}?", abort=True)
    _call(store.clear)
    click.echo(f"deleted {count} plan(s) from {store.path}")


@cache.command()
@cache_file
def path(cache_path: Path | None) -> None:
    """Print where the plan cache lives: --cache, else $AUTOTUNE_CACHE, else the user cache directory.

    \b
    Example:
      ls -l "$(autotune cache path)"
    """
    click.echo(str(cache_path or default_path()))


# -- one library call each, with the cache's errors mapped -----------------------------------------------------

def _open(cache_path: Path | None) -> PlanCache:
    return _call(lambda: PlanCache(cache_path, strict=True))


def _call(action: Callable[[], T]) -> T:
    try:
        return action()
    except CacheError as exc:
        raise CacheUnusable(str(exc)) from exc


def _one(store: PlanCache, key: str, *, team: bool) -> CacheEntry | NothingFits:
    matches: list[CacheEntry | NothingFits] = _call(
        lambda: [*store.entries(key, team=team), *store.nothing_fits_entries(key, team=team)])
    if not matches:
        raise click.ClickException(f"no cached plan or 'nothing fits' record has a key starting with {key!r}; run "
                                   "`autotune cache list` to see the keys")
    if len(matches) > 1:
        keys = ", ".join(e.key[:12] for e in matches[:5])
        raise click.ClickException(f"{len(matches)} cached rows have keys starting with {key!r} ({keys}...); give "
                                   "more of the key")
    return matches[0]


# -- formatting -------------------------------------------------------------------------------------------------

def _list_row(entry: CacheEntry) -> list[str]:
    plan = entry.plan
    return [entry.key[:12], _model(entry.parts), _gpu(entry.parts), format_bytes(entry.parts.get("budget_bytes", 0)),
            _plan_cell(plan) if plan else "-", _host(plan), _rate(plan) if plan else "-",
            _mfu(plan.mfu if plan else None),
            _age(entry.updated), _status(entry)]


def _host(plan: Plan | None) -> str:
    """The host memory the plan allocates (offload's buffers); "-" where it keeps nothing there."""
    return format_bytes(plan.host_peak_bytes) if plan is not None and plan.host_peak_bytes else "-"


def _refusal_row(record: NothingFits) -> list[str]:
    return [record.key[:12], _model(record.parts), _gpu(record.parts),
            format_bytes(record.parts.get("budget_bytes", 0)), str(len(record.trials)), _age(record.time),
            record.origin]


def _describe(entry: CacheEntry | NothingFits) -> str:
    # Every field may come from a teammate's file: each line is printed with control characters escaped.
    if isinstance(entry, NothingFits):
        return _describe_refusal(entry)
    lines = [f"key       {entry.key}", f"status    {_status(entry)}",
             f"origin    {entry.origin}, updated {_age(entry.updated)} ago", *_describe_parts(entry.parts)]
    if entry.stale:
        lines.append("plan      written by another plan format: the next fit of this workload tunes it again")
    elif entry.plan is None:
        lines.append("plan      unreadable (it does not validate); re-tune with retune=True")
    else:
        lines += _describe_plan(entry.plan)
    if entry.failures:
        lines += ["", "OOMs seen in real training:"]
        lines += [f"  micro-batch {f.micro_batch_size}, {_age(f.time)} ago"
                  + (f", shapes {json.dumps(f.shapes)}" if f.shapes else "") + (f": {f.note}" if f.note else "")
                  for f in entry.failures]
    return "\n".join(printable(line) for line in lines)


def _describe_refusal(record: NothingFits) -> str:
    trials = [[t.rung.name, str(t.micro_batch_size), t.outcome, format_bytes(t.peak_bytes) if t.peak_bytes else "-",
               t.note] for t in record.trials]
    lines = [f"key       {record.key}", "status    nothing fits: fit refuses at once; retune=True searches again",
             f"origin    {record.origin}, found {_age(record.time)} ago", *_describe_parts(record.parts),
             f"why       {record.message}", "", "trials:",
             *_indent(_table(["RUNG", "MICRO", "OUTCOME", "PEAK", "NOTE"], trials)).split("\n")]
    return "\n".join(printable(line) for line in lines)


def _describe_parts(parts: dict[str, Any]) -> list[str]:
    """What the plan was tuned for: the key's parts, one line per topic."""
    batch = "; ".join(f"{p or 'batch'} {tuple(shape)} {dtype}" for p, shape, dtype in parts.get("batch", []))
    runtime, device = parts.get("runtime", {}), parts.get("device", {})
    return [
        f"model     {_model(parts, ' parameters')}, structure {parts.get('model', {}).get('digest', '')[:12]}",
        (f"batch     {batch + ' per sample; ' if batch else ''}global batch {parts.get('global_batch_size')} over "
         f"{parts.get('world_size')} rank(s)"),
        f"device    {_gpu(parts)}, {format_bytes(device.get('total_bytes', 0))}",
        (f"budget    {format_bytes(parts.get('budget_bytes', 0))}, margin {parts.get('margin', 0):.0%}; allowed: "
         f"{', '.join(parts.get('techniques', []))}"),
        (f"runtime   torch {runtime.get('torch')}, CUDA {runtime.get('cuda') or 'none'}; optimizer "
         f"{parts.get('optimizer', {}).get('class')}; loss {parts.get('loss')}"),
    ]


def _describe_plan(plan: Plan) -> list[str]:
    trials = [[t.rung.name, str(t.micro_batch_size), t.outcome, format_bytes(t.peak_bytes),
               format_bytes(t.host_peak_bytes) if t.host_peak_bytes else "-",
               f"{t.samples_per_second:,.1f}" if t.fits else t.note, _mfu(plan.trial_mfu(t))] for t in plan.trials]
    flops = f"{plan.flops_per_sample / 1e9:,.1f} GFLOPs" if plan.flops_per_sample is not None else "not counted"
    host = (f"{format_bytes(plan.host_peak_bytes)} for its offload's buffers" if plan.host_peak_bytes
            else "nothing beyond the model's own copy")
    return [f"plan      {plan.summary()}", f"why       {plan.reason}", f"host      {host}",
            f"compute   {flops} per sample (forward+backward); MFU {_mfu(plan.mfu)}", "", "trials:",
            *_indent(_table(["RUNG", "MICRO", "OUTCOME", "PEAK", "HOST RISE", "SAMPLES/S", "MFU"],
                            trials)).split("\n")]


def _table(headers: list[str], rows: list[list[str]]) -> str:
    rows = [[printable(cell) for cell in row] for row in rows]  # cells may come from a teammate's file
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [headers, *rows])


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def _model(parts: dict[str, Any], unit: str = "") -> str:
    """The model's class and parameter count; a script's plan (zero-change) has no count, and shows none."""
    model = parts.get("model", {})
    count = model.get("parameters", 0)
    return f"{model.get('class', '?')} ({_count(count)}{unit})" if count else str(model.get("class", "?"))


def _gpu(parts: dict[str, Any]) -> str:
    world = parts.get("world_size", 1)
    name = parts.get("device", {}).get("name", "?")
    return f"{world}x {name}" if world != 1 else name


def _plan_cell(plan: Plan) -> str:
    return f"{plan.rung.name}, {plan.micro_batch_size}x{plan.accumulation_steps}"


def _rate(plan: Plan) -> str:
    if plan.tokens_per_second:
        return f"{_count(plan.tokens_per_second)} tokens/s"
    return f"{plan.samples_per_second:,.1f} samples/s"


def _mfu(value: float | None) -> str:
    return f"{value:.1%}" if value is not None else "-"


def _status(entry: CacheEntry) -> str:
    if entry.status == "unsafe":
        return f"unsafe: OOM at micro-batch {entry.smallest_failure}"
    if entry.status == "stale":
        return "stale: another plan format, tuned again"
    return entry.status


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def _age(when: float) -> str:
    seconds = max(0.0, time.time() - when)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"
