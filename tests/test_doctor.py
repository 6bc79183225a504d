"""`autotune doctor`: says clearly what it finds, with or without a GPU, and never writes the cache."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

from autotune.cli.main import main
from autotune.devices import nvml

GiB = 2**30
NO_DRIVER = nvml.DriverFacts(ok=False, problem="NVMLError_LibraryNotFound: NVML Shared Library Not Found")
TWO_GPUS = nvml.DriverFacts(ok=True, driver_version="570.86", cuda_driver_version="12.8", gpus=(
    nvml.Gpu(index=0, name="NVIDIA H200", total_bytes=141 * GiB, free_bytes=100 * GiB, used_bytes=41 * GiB,
             compute_capability=(9, 0),
             processes=(nvml.GpuProcess(pid=4242, used_bytes=40 * GiB, name="python"),)),
    nvml.Gpu(index=1, name="Tesla V100", total_bytes=32 * GiB, free_bytes=32 * GiB, used_bytes=0,
             compute_capability=(7, 0)),
))


def doctor(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, facts: nvml.DriverFacts, *, torch_gpus: int,
           args: tuple[str, ...] = ()) -> Result:
    monkeypatch.setattr(nvml, "driver_facts", lambda with_processes=True: facts)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: torch_gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: torch_gpus)
    monkeypatch.setenv("AUTOTUNE_CACHE", str(tmp_path / "plans.db"))
    return CliRunner().invoke(main, ["doctor", *args])


def test_without_a_driver_it_says_so_and_that_the_cpu_simulation_works(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    result = doctor(monkeypatch, tmp_path, NO_DRIVER, torch_gpus=0)
    assert result.exit_code == 0, result.output
    assert "no NVIDIA driver found" in result.output
    assert "ready, on the CPU" in result.output and "simulated memory ceiling" in result.output
    assert "host " in result.output and "torch " in result.output


def test_gpus_are_listed_with_memory_bf16_and_processes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    result = doctor(monkeypatch, tmp_path, TWO_GPUS, torch_gpus=2)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "NVIDIA 570.86" in out and "CUDA up to 12.8" in out
    assert "NVIDIA H200: 141.00 GiB total, 100.00 GiB free" in out and "bf16 yes" in out
    assert "4242 python (40.00 GiB)" in out
    assert "Tesla V100" in out and "bf16 no" in out
    assert "verdict    ready: 2 GPU(s)" in out
    assert "without bf16 support" in out  # the V100: a warning, not a failure


def test_gpus_that_torch_cannot_use_are_a_problem_exit_4(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    result = doctor(monkeypatch, tmp_path, TWO_GPUS, torch_gpus=0)
    assert result.exit_code == 4, result.output
    assert "CPU-only build" in result.output and "NOT READY" in result.output


def test_a_failing_driver_is_a_problem_but_an_unloaded_one_is_not(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    broken = nvml.DriverFacts(ok=False, problem="NVMLError_LibRmVersionMismatch: RM has detected an NVML/RM "
                                                "version mismatch.")
    result = doctor(monkeypatch, tmp_path, broken, torch_gpus=0)
    assert result.exit_code == 4 and "nvidia-smi" in result.output
    unloaded = nvml.DriverFacts(ok=False, problem="NVMLError_DriverNotLoaded: Driver Not Loaded")
    assert doctor(monkeypatch, tmp_path, unloaded, torch_gpus=0).exit_code == 0


def test_cache_health_is_read_without_writing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    result = doctor(monkeypatch, tmp_path, NO_DRIVER, torch_gpus=0)
    assert "not created yet" in result.output
    assert not (tmp_path / "plans.db").exists()

    with sqlite3.connect(tmp_path / "plans.db") as con:
        con.execute("CREATE TABLE plans (key TEXT)")
        con.execute("INSERT INTO plans VALUES ('abc')")
    result = doctor(monkeypatch, tmp_path, NO_DRIVER, torch_gpus=0)
    assert "ok" in result.output and "plans: 1 rows" in result.output

    (tmp_path / "plans.db").write_bytes(b"not a database at all" * 100)
    result = doctor(monkeypatch, tmp_path, NO_DRIVER, torch_gpus=0)
    assert result.exit_code == 0  # training works without a cache: a warning, not a failure
    assert "unusable" in result.output and "warning" in result.output


def test_json_report(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    result = doctor(monkeypatch, tmp_path, TWO_GPUS, torch_gpus=2, args=("--json",))
    report = json.loads(result.output)
    assert report["device"] == "cuda"
    assert [g["bf16"] for g in report["driver"]["gpus"]] == [True, False]
    assert report["cache"]["state"] == "missing" and report["problems"] == []


def test_on_this_machine_as_it_is() -> None:
    """No fakes: whatever this machine has, doctor reports it and ends with a verdict."""
    result = CliRunner().invoke(main, ["doctor"])
    assert result.exit_code in (0, 4), result.output
    assert "verdict" in result.output
