"""The fork server: zero-change trials forked from a process that imported torch and the script's packages once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from subprocess_env import with_path

from autotune.supervisor.forkserver import ForkedProcess, ForkServer, ForkServerError, script_imports

pytestmark = pytest.mark.skipif(not ForkServer.supported(), reason="the fork server needs Linux")

REPO = Path(__file__).resolve().parent.parent


def _env(*folders: object, **extra: str) -> dict[str, str]:
    return with_path(*folders, REPO, **extra)


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _run(server: ForkServer, args: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str]:
    proc = server.spawn(args, env, str(cwd))
    assert proc.stdout is not None
    output = proc.stdout.read().decode()
    return proc.wait(30), output


def test_a_forked_trial_gets_its_arguments_environment_folder_and_exit_code(tmp_path: Path) -> None:
    script = _write(tmp_path / "job.py", (
        "import json, os, sys\n"
        "import torch\n"
        "print(json.dumps({'argv': sys.argv, 'seen': os.environ.get('TRIAL_MARK'), 'cwd': os.getcwd(),\n"
        "                  'session': os.getsid(0) == os.getpid()}))\n"
        "sys.exit(int(sys.argv[1]))\n"))
    server = ForkServer(script, _env())
    server.start()
    try:
        for number, folder in ((3, tmp_path), (0, REPO)):
            code, output = _run(server, [script, str(number), "x"], _env(TRIAL_MARK=f"m{number}"), folder)
            said = json.loads(output.strip().splitlines()[-1])
            assert code == number
            assert said == {"argv": [script, str(number), "x"], "seen": f"m{number}", "cwd": str(folder),
                            "session": True}
    finally:
        server.close()
    assert server.proc is None


def _sleeping_trial(server: ForkServer, tmp_path: Path) -> ForkedProcess:
    """A trial forked by the started `server` that has said it is up and now sleeps for a minute."""
    proc = server.spawn([server.script], _env(), str(tmp_path))
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    return proc


def _sleeper_server(tmp_path: Path) -> ForkServer:
    sleeper = _write(tmp_path / "sleep.py", "import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    server = ForkServer(sleeper, _env())
    server.start()
    return server


def test_a_trial_killed_by_a_signal_ends_as_popen_says_and_an_error_shows_its_traceback(tmp_path: Path) -> None:
    server = _sleeper_server(tmp_path)
    try:
        proc = _sleeping_trial(server, tmp_path)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.1)
        os.killpg(proc.pid, signal.SIGKILL)  # its own process group, as Popen(start_new_session=True) gives
        assert proc.wait(30) == -signal.SIGKILL
        failing = _write(tmp_path / "fail.py", "raise ValueError('bad schedule')\n")
        code, output = _run(server, [failing], _env(), tmp_path)
        assert code == 1 and "ValueError: bad schedule" in output
    finally:
        server.close()


def test_a_trial_outliving_its_server_is_still_watched_and_its_end_seen(tmp_path: Path) -> None:
    server = _sleeper_server(tmp_path)
    try:
        proc = _sleeping_trial(server, tmp_path)
        assert server.proc is not None
        server.proc.kill()  # the server dies; its trial runs on
        server.proc.wait()
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.2)
        os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.returncode == -signal.SIGKILL  # ended; its own status went with the server
        with pytest.raises(ForkServerError):
            server.spawn([server.script], _env(), str(tmp_path))
    finally:
        server.close()


def test_a_package_that_starts_a_thread_at_import_keeps_trials_fresh(tmp_path: Path) -> None:
    (tmp_path / "pkgs" / "spinner").mkdir(parents=True)
    _write(tmp_path / "pkgs" / "spinner" / "__init__.py",
           "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    (tmp_path / "job").mkdir()
    script = _write(tmp_path / "job" / "train.py", "import spinner\n")
    env = _env(tmp_path / "pkgs")
    server = ForkServer(script, env)
    with pytest.raises(ForkServerError, match="started threads"):
        server.start()
    assert server.proc is None and server.sock is None


def test_the_packages_preloaded_are_the_scripts_top_level_imports_but_not_its_own_modules(tmp_path: Path) -> None:
    _write(tmp_path / "helpers.py", "X = 1\n")
    script = _write(tmp_path / "train.py", (
        "from __future__ import annotations\n"
        "import json\n"
        "try:\n    import psutil\nexcept ImportError:\n    psutil = None\n"
        "from helpers import X\n"
        "def main():\n    import click\n"))
    assert script_imports(script) == ["json", "psutil"]


@pytest.mark.slow  # fresh and forked torch processes, timed
def test_a_forked_trial_starts_in_under_half_the_time_of_a_fresh_process(tmp_path: Path) -> None:
    """The same script, run whole each way; the fresh one pays for the interpreter and `import torch` again."""
    script = _write(tmp_path / "job.py", "import torch\nprint(torch.ones(2).sum().item())\n")
    started = time.perf_counter()
    fresh = subprocess.run([sys.executable, "-m", "autotune.supervisor.bootstrap", script], env=_env(),
                           capture_output=True, text=True, timeout=120, check=False)
    fresh_s = time.perf_counter() - started
    assert fresh.returncode == 0 and fresh.stdout.strip() == "2.0", fresh.stderr
    server = ForkServer(script, _env())
    server.start()
    try:
        forked = []
        for _ in range(2):
            started = time.perf_counter()
            code, output = _run(server, [script], _env(), tmp_path)
            forked.append(time.perf_counter() - started)
            assert code == 0 and output.strip() == "2.0"
    finally:
        server.close()
    assert min(forked) < 0.5 * fresh_s, (forked, fresh_s)


def test_a_child_whose_spawn_gives_nothing_starts_itself_fresh(tmp_path: Path) -> None:
    """The launcher's spawn returns None where the fork server will not fork: the trial is then launched as
    any job is, with its output captured all the same."""
    from autotune.supervisor.process import Child

    asked: list[dict[str, str]] = []

    def refuse(env: dict[str, str]) -> None:
        asked.append(env)

    script = _write(tmp_path / "hello.py", "import os, sys\nprint('fresh', os.getpid(), flush=True)\nsys.exit(3)\n")
    child = Child([sys.executable, script], env=_env(MARK="1"), echo=False, capture_stdout=True, spawn=refuse)
    ended = child.start().wait()
    assert len(asked) == 1 and asked[0]["MARK"] == "1"
    assert ended.returncode == 3 and "fresh" in ended.output_tail


def test_a_jobs_seconds_count_from_before_its_spawn(tmp_path: Path) -> None:
    """A trial's start-up is its age at the first step, counted from the launch; its whole time must count from
    the same moment, or a slow fork makes the start-up longer than the trial that holds it."""
    from autotune.supervisor.process import Child

    def slow(env: dict[str, str]) -> None:
        time.sleep(0.5)  # a loaded machine's fork, or the fork server taking its time to answer

    script = _write(tmp_path / "quick.py", "print('done', flush=True)\n")
    launched = time.monotonic()
    ended = Child([sys.executable, script], env=_env(), echo=False, capture_stdout=True, spawn=slow).start().wait()
    assert ended.returncode == 0 and "done" in ended.output_tail
    assert 0.5 <= ended.seconds <= time.monotonic() - launched
