"""`autotune doctor`: GPUs, driver, torch/CUDA, bf16, host memory and the plan cache, in one report."""

from __future__ import annotations

import json
import sys

import click

from ..sizes import format_bytes
from ..supervisor.environment import Environment, inspect_environment


@click.command()
@click.option("--json", "json_output", is_flag=True, help="Print the report as JSON.")
def doctor(json_output: bool) -> None:
    """Report what this machine offers autotune: GPUs (name, memory, driver, processes), host memory,
    torch/CUDA versions, bf16 support, and the plan cache's path and health.

    Works without a GPU or an NVIDIA driver, and says so: autotune then runs on the CPU under a simulated
    memory ceiling. Exits 4 when a GPU is there but unusable (broken driver, CPU-only torch), else 0.

    \b
    Examples:
      autotune doctor
      autotune doctor --json | jq .driver.gpus
    """
    env = inspect_environment()
    if json_output:
        click.echo(json.dumps(env.to_dict(), indent=2, default=str))
    else:
        click.echo(format_report(env))
    sys.exit(4 if env.problems else 0)


def format_report(env: Environment) -> str:
    v = env.versions
    lines = [f"autotune {v['autotune']} · Python {v['python']} · {v['platform']}",
             f"torch      {v['torch']} (CUDA build: {v['torch_cuda_build']}; cuDNN: {v['cudnn']})"]
    lines += _gpu_lines(env)
    lines.append(f"host       {format_bytes(env.host_total_bytes)} memory, "
                 f"{format_bytes(env.host_available_bytes)} available; {env.cpus} CPUs")
    lines += _cache_lines(env)
    lines += [f"problem    {p}" for p in env.problems]
    lines += [f"warning    {w}" for w in env.warnings]
    lines.append(_verdict(env))
    return "\n".join(lines)


def _gpu_lines(env: Environment) -> list[str]:
    d = env.driver
    if not d.ok:
        if d.no_driver:
            return [f"GPUs       none: no NVIDIA driver found ({d.problem})",
                    "bf16       no GPU: CPU autocast can run bf16, though slowly on most CPUs"]
        return [f"GPUs       unknown: the NVIDIA driver does not answer ({d.problem})"]
    lines = [f"driver     NVIDIA {d.driver_version} (supports CUDA up to {d.cuda_driver_version or '?'})"]
    if not d.gpus:
        lines.append("GPUs       none: the driver answers but lists no GPU")
    for g in d.gpus:
        cc = ".".join(map(str, g.compute_capability)) if g.compute_capability else "?"
        bf16 = {True: "yes", False: "no (fp16 with loss scaling instead)", None: "unknown"}[g.bf16]
        lines.append(f"GPU {g.index:<6} {g.name}: {format_bytes(g.total_bytes)} total, "
                     f"{format_bytes(g.free_bytes)} free; compute capability {cc}; bf16 {bf16}")
        procs = ", ".join(f"{p.pid} {p.name or '?'} ({format_bytes(p.used_bytes) if p.used_bytes is not None else '?'})"
                          for p in g.processes)
        lines.append(f"           processes: {procs or 'none'}")
    lines.append(f"torch sees {env.torch_gpu_count} GPU(s)")
    return lines


def _cache_lines(env: Environment) -> list[str]:
    c = env.cache
    if c.state == "off":
        return [f"cache      off ({c.detail})"]
    where = f"{c.path}" + (f" on {c.filesystem}" if c.filesystem else "")
    size = f", {format_bytes(c.size_bytes)}" if c.size_bytes else ""
    return [f"cache      {where}", f"           {c.state}{size}: {c.detail}"]


def _verdict(env: Environment) -> str:
    if env.problems:
        return "verdict    NOT READY: fix the problem(s) above (exit 4)"
    if env.device == "cuda":
        return f"verdict    ready: {env.torch_gpu_count} GPU(s)"
    return ("verdict    ready, on the CPU: no usable GPU, so autotune runs the same search under a simulated "
            "memory ceiling (device='cpu'); memory figures are real, speed figures are the CPU's")

