"""A rank that died, named by its node and local rank in the error the others raise.

When a rank dies (killed, a segfault, its node lost) the others learn of it as a failed collective, whose
message names a socket ("Connection closed by peer [10.0.0.7]:41235") or nothing at all, and on a cluster that
does not say which of hundreds of processes to look for. So where `fit` or a training step fails on a lost
peer, the rank calls the roll through the job's own store (the rendezvous store torchrun and
`init_process_group` set up, which outlives any one worker). Every rank answers from a thread of its own,
started when it first entered `fit` or a step (where it also wrote its node, torchrun's `GROUP_RANK`, its
local rank and its host), so a rank blocked in a collective behind another live rank answers as well; the
ranks that have not answered after `ROLL_CALL_SECONDS` are named in the error. A rank its launcher stopped
right after the first death (torchrun stops every worker of a node where one failed) may be named beside it.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from ..errors import RankDied
from ..torch_private import default_store
from .ranks import active, rank, world_size

ROLL_CALL_SECONDS = 3.0  # how long the ranks alive wait for the others' answers (each answers from a thread)
_WAIT = datetime.timedelta(hours=1)  # an answering thread's wait for the next roll call, renewed
_PREFIX = "autotune/ranks/"
# What a collective says when a peer went away: gloo's transport, NCCL's watchdog and c10d's own errors.
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket Timeout",
              "Timed out waiting", "Application timeout", "NCCL communicator was aborted")
_registered: set[int] = set()  # the groups (by id) this process has written its name into
_calls = 0  # roll calls held by this process: each its own keys, the same count on every rank alive


def lost_peer(exc: BaseException) -> bool:
    """Whether `exc` is a collective failing because another rank went away (not an error of this rank's)."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _LOST_PEER)


@contextlib.contextmanager
def named_deaths() -> Iterator[None]:
    """Around `fit` and a training step: a collective failing on a lost peer becomes a `RankDied` naming the
    ranks that no longer answer; any other error, or one where every rank answers, passes through unchanged."""
    if not active():
        yield
        return
    _register()
    try:
        yield
    except Exception as exc:
        if isinstance(exc, RankDied) or not lost_peer(exc):
            raise
        missing = _roll_call()
        if not missing:
            raise
        said = (str(exc).splitlines() or [type(exc).__name__])[0].split(". This is typically")[0]
        raise RankDied(f"{_names(missing)} stopped answering: a collective on {_name(rank())} failed with "
                       f"\"{said}\". Look in that node's log for why the process ended (an OOM kill, a signal, a "
                       "crash), then restart the job") from exc


def _store() -> Any:
    """The job's store (None: the error goes out as the collective raised it)."""
    return default_store()


def _register() -> None:
    """Write this rank's node, local rank and host where the others can read them once it is gone, and start
    the thread that answers roll calls for it."""
    group = id(dist.group.WORLD)
    if group in _registered:
        return
    store = _store()
    if store is None:
        return
    me = {"node": os.environ.get("GROUP_RANK"), "local": os.environ.get("LOCAL_RANK"), "host": socket.gethostname()}
    try:
        store.set(f"{_PREFIX}where/{rank()}", json.dumps(me))
        # Its own connection to the store: a wait on the shared one would hold it from this rank's other calls.
        answerer = _Answerer(store.clone(), rank())
    except Exception:  # noqa: BLE001 - a store that cannot clone: this rank is named from the rank numbering
        return
    answerer.start()
    atexit.register(answerer.stop, store)
    _registered.add(group)


class _Answerer(threading.Thread):
    """This rank's answer to every roll call, from a thread of its own: a rank alive but blocked in a collective
    behind another rank still alive (a ring's next hop), which learns of the failure only when that rank
    leaves, answers at once, and only the dead stay silent.

    It waits on its own bell for each call in turn (`bell/<rank>/<call>`), so that at the process's exit it can
    be woken and leave: a thread still inside the store's wait when the interpreter finalizes aborts the
    process once the store closes under it."""

    def __init__(self, store: Any, me: int) -> None:
        super().__init__(name="autotune-roll-call", daemon=True)
        self.store, self.me, self.call = store, me, 1

    def bell(self) -> str:
        return f"{_PREFIX}bell/{self.me}/{self.call}"

    def run(self) -> None:
        while True:
            try:
                self.store.wait([self.bell()], _WAIT)
                if self.store.get(self.bell()) == b"stop":
                    return
            except Exception as exc:  # noqa: BLE001 - the wait's timeout: wait again; the store gone: leave
                if "timeout" in str(exc).lower():
                    continue
                return
            with contextlib.suppress(Exception):
                self.store.set(f"{_PREFIX}alive/{self.call}/{self.me}", "1")
            self.call += 1

    def stop(self, store: Any) -> None:
        """At exit: ring this rank's bell with "stop" (through the main connection) and let the thread leave."""
        with contextlib.suppress(Exception):
            store.set(self.bell(), "stop")
            self.join(timeout=2)


def _roll_call() -> list[int]:
    """The ranks that did not answer within `ROLL_CALL_SECONDS`; empty where the store is out of reach."""
    global _calls
    store = _store()
    if store is None:
        return []
    _calls += 1
    keys = [f"{_PREFIX}alive/{_calls}/{r}" for r in range(world_size())]
    try:
        if store.add(f"{_PREFIX}calls/{_calls}", 1) == 1:  # the first rank to call rings every rank's bell
            for r in range(world_size()):
                store.set(f"{_PREFIX}bell/{r}/{_calls}", "call")
        deadline = time.monotonic() + ROLL_CALL_SECONDS
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.1)
        answered = [store.check([key]) for key in keys]
    except Exception:  # noqa: BLE001 - the store went with the dead (its host's node): nothing to name
        return []
    return [r for r, ok in enumerate(answered) if not ok]


def _name(r: int) -> str:
    """"rank 3 (node 1, local rank 1, host gpu-07)": as the rank wrote itself, else from the rank numbering."""
    from .topology import topology

    where = None
    store = _store()
    with contextlib.suppress(Exception):
        key = f"{_PREFIX}where/{r}"
        if store is not None and store.check([key]):
            where = json.loads(store.get(key))
    if not where or where.get("node") is None or where.get("local") is None:
        return topology().where(r)
    return f"rank {r} (node {where['node']}, local rank {where['local']}, host {where['host']})"


def _names(ranks: list[int]) -> str:
    return ", ".join(_name(r) for r in ranks)
