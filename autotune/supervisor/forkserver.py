"""Trial processes forked from a warm parent, so a zero-change tune pays for the interpreter and imports once.

Each zero-change trial runs the script in a process of its own, so its memory, its CUDA context and a crash
end with it. Most of a short trial is start-up, and much of that is importing torch and the framework.
`ForkServer` starts one process per tune. That process imports torch, autotune's agent and the packages the
script imports at its top level: installed packages only, never the script's own modules, whose import could
do work. It then forks one child per trial. The child leads a process group of its own and takes the trial's
environment, arguments, folder and output pipe, and runs the agent as `python -m autotune.supervisor.bootstrap`
would.

The server must never initialize CUDA, because a forked child could not use it then. It imports with
PYTORCH_NVML_BASED_CUDA_CHECK=1, so a package that asks `torch.cuda.is_available()` at import asks NVML. It
also refuses to serve when CUDA is initialized or a Python thread runs after the imports: a lock held by
another thread would stay held in every child. When the server refuses or breaks, trials start as fresh
processes, as they do with AUTOTUNE_FORK_TRIALS=0.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator, Sequence
from typing import IO, Any

import psutil

log = logging.getLogger(__name__)

MESSAGE_BYTES = 1 << 20  # a request carries the trial's environment; one message each way, never split
READY_SECONDS = 120.0  # how long the server may take to import before trials start fresh instead
SERVE = "from autotune.supervisor.forkserver import serve; serve()"


class ForkServerError(Exception):
    """The fork server refused to start, broke, or did not answer."""


class ForkedProcess:
    """A trial forked by the server, with the parts of `subprocess.Popen` that `process.Child` uses.

    Its exit status arrives over the server's socket (the server is its parent and reaps it), converted as
    `Popen.returncode` is: negative for a signal.
    """

    def __init__(self, server: ForkServer, pid: int, output: IO[bytes]) -> None:
        self.server, self.pid = server, pid
        self.returncode: int | None = None
        self.stdout: IO[bytes] | None = output
        self.stderr: IO[bytes] | None = None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                reply = self.server.receive(timeout)
            except ForkServerError:  # the server died: its status reports went with it
                reply = self._orphaned(timeout)
            if reply is None:
                raise subprocess.TimeoutExpired(f"trial process {self.pid}", timeout or 0.0)
            self.returncode = int(reply["status"])
        return self.returncode

    def _orphaned(self, timeout: float | None) -> dict[str, Any] | None:
        """Watch a trial whose server is gone: running, or ended with a status nobody kept (read as killed)."""
        try:
            running = psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            running = False
        if running:
            time.sleep(timeout or 0.0)
            return None
        return {"status": -signal.SIGKILL}

    def poll(self) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.wait(0.0)
        return None


class ForkServer:
    """One warm process per tune that forks each trial of `script` (see the module's docstring)."""

    def __init__(self, script: str, env: dict[str, str]) -> None:
        self.script, self.env = script, env
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self.log: IO[bytes] | None = None  # the server's own stderr: what it said before it died
        self.import_seconds = 0.0
        self.modules: list[str] = []

    @staticmethod
    def supported() -> bool:
        return sys.platform.startswith("linux") and hasattr(socket, "send_fds")

    def start(self) -> None:
        """Start the server and wait until it has imported; `ForkServerError` says why it will not serve."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**self.env, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-c", SERVE, str(theirs.fileno()), self.script], env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log,
                                     pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        self.sock = ours
        started = time.perf_counter()
        ready = self.receive(READY_SECONDS)
        if ready is None or not ready.get("ready"):
            why = ready.get("why") if ready else self._death()
            self.close()
            raise ForkServerError(str(why))
        self.import_seconds, self.modules = time.perf_counter() - started, list(ready["modules"])

    def spawn(self, args: Sequence[str], env: dict[str, str], cwd: str) -> ForkedProcess:
        """Fork a trial running the agent on `args` (the script, then its arguments), its output on one pipe."""
        if self.sock is None:
            raise ForkServerError("the fork server is not running")
        read_end, write_end = os.pipe()
        request = json.dumps({"argv": list(args), "env": env, "cwd": cwd}).encode()
        try:
            socket.send_fds(self.sock, [request], [write_end])
        except OSError as exc:
            os.close(read_end)
            raise ForkServerError(f"the fork server is gone ({exc})") from None
        finally:
            os.close(write_end)
        reply = self.receive(30.0)
        if reply is None or "pid" not in reply:
            os.close(read_end)
            raise ForkServerError(f"the fork server did not fork the trial ({reply or self._death()})")
        return ForkedProcess(self, int(reply["pid"]), os.fdopen(read_end, "rb", buffering=0))

    def receive(self, timeout: float | None) -> dict[str, Any] | None:
        """The server's next message; None when `timeout` passes first. A closed socket is an error."""
        assert self.sock is not None
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(MESSAGE_BYTES)
        except (TimeoutError, BlockingIOError):
            return None
        if not data:
            raise ForkServerError(f"the fork server ended ({self._death()})")
        message: dict[str, Any] = json.loads(data)
        return message

    def describe(self) -> str:
        """What the trials fork from, for the log and the plan's reason."""
        return (f"trials forked from a process that imported torch{''.join(', ' + m for m in self.modules)} once "
                f"({self.import_seconds:.1f} s)")

    def close(self) -> None:
        """Stop the server: closing its socket ends its loop; it is killed if it does not end in 5 s."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self.log is not None:
            self.log.close()
            self.log = None

    def _death(self) -> str:
        if self.proc is None or self.proc.poll() is None:
            return "no answer"
        tail = ""
        if self.log is not None:
            self.log.seek(0)
            tail = self.log.read()[-2000:].decode(errors="replace")
        return f"exit code {self.proc.returncode}" + (f": {tail.strip().splitlines()[-1]}" if tail.strip() else "")


# -- the server's side ------------------------------------------------------------------------------------

def script_imports(script: str) -> list[str]:
    """The installed packages `script` imports at its top level, in order; its own modules left out."""
    try:
        with open(script, "rb") as f:
            tree = ast.parse(f.read(), filename=script)
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in _top_level(tree.body):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    home = os.path.dirname(os.path.abspath(script))
    return [n for n in dict.fromkeys(names) if n != "__future__" and _installed(n, home)]


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements run at import, into `try`, `if` and `with` blocks (an import guarded by `try` counts)."""
    for node in body:
        yield node
        if isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from _top_level(block)
        elif isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.With):
            yield from _top_level(node.body)


def _installed(name: str, home: str) -> bool:
    """Whether `name`'s top package is importable from outside the script's folder."""
    try:
        spec = importlib.util.find_spec(name.split(".")[0])
    except (ImportError, ValueError):
        return False
    origin = (spec.origin or "") if spec else ""
    locations = list(spec.submodule_search_locations or []) if spec else []
    where = [os.path.abspath(p) for p in [origin, *locations] if p and p not in ("built-in", "frozen")]
    return spec is not None and not any(p.startswith(home + os.sep) for p in where)


def _preload(script: str) -> list[str]:
    """Import what every trial imports, and name the packages beside torch; a module that fails to import is
    left for the trial to report."""
    # torch, the heaviest import of every trial, and Dynamo, which the first optimizer a trial builds imports
    # (1.5 s of CPU); neither starts a thread
    import torch._dynamo  # noqa: F401

    import autotune.supervisor.agent  # noqa: F401
    loaded: list[str] = []
    for name in script_imports(script):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  the trial imports it again and fails the way the script would
            continue
        top = name.split(".")[0]
        if top not in sys.stdlib_module_names and top not in ("torch", "autotune", *loaded):
            loaded.append(top)
    return loaded


def _unsafe() -> str:
    """Why forking now could hand a child a broken state; empty when it is safe."""
    import threading

    import torch
    if torch.cuda.is_initialized():
        return "CUDA was initialized while importing the script's packages"
    if threading.active_count() > 1:
        names = ", ".join(t.name for t in threading.enumerate() if t is not threading.main_thread())
        return f"importing the script's packages started threads ({names})"
    return ""


def serve() -> None:
    """The server's loop: `python -c SERVE FD SCRIPT`; it ends when the supervisor closes the socket."""
    sock = socket.socket(fileno=int(sys.argv[1]))
    modules = _preload(sys.argv[2])
    why = _unsafe()
    _send(sock, {"ready": not why, "why": why, "modules": modules})
    if why:
        return
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, MESSAGE_BYTES, 1)
        except OSError:
            return
        if not data:
            return
        pid = _fork(json.loads(data), fds[0], sock)
        os.close(fds[0])
        _send(sock, {"pid": pid})
        _, status = os.waitpid(pid, 0)
        _send(sock, {"status": os.waitstatus_to_exitcode(status)})


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        sock.send(json.dumps(message).encode())


def _fork(request: dict[str, Any], output: int, sock: socket.socket) -> int:
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    with warnings.catch_warnings():  # Python warns of forking beside a BLAS library's idle threads
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        sock.close()
        _run_trial(request, output)
    return pid


def _run_trial(request: dict[str, Any], output: int) -> None:
    """In the forked child: become the trial process, run the agent, exit with the code Python would."""
    os.setsid()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    from .agent import _exit_code, main
    code = 1
    try:
        main(request["argv"])
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001  as Python itself ends on an uncaught exception
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
