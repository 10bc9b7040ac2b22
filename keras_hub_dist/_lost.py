"""A process of the `jax.distributed` job lost mid-operation: one error,
named, raised fast, and an exit that waits for nobody.

A process killed mid-operation (preempted, OOM-killed) shows up on the
survivors as a JaxRuntimeError of the collective they were in or next
enter: gloo's "Connection closed by peer" / "reset by peer" (immediately),
"Gloo context initialization failed: DEADLINE_EXCEEDED" (a new group of
devices: after gloo's 30 s), or the coordination service's "Task N
heartbeat timeout". `raises_process_lost` turns any of them, wherever the
operation wrapped it, into the operation's `ProcessLostError`, and detaches
JAX's distributed client so that the exit-time `jax.distributed.shutdown()`
does not wait for the lost process at a barrier.

Waits that a lost process would make endless are ended by the beats
(`start_beats`, from `keras_hub_dist.initialize`): each process sets a key
of the coordination service every second; one whose key stops changing for
the heartbeat timeout is lost. The waits of the package watch them
(`await_ready`, `watching_peers`); a wait it does not own (inside JAX,
Keras, gloo) is ended by the same thread: it raises the loss into the
operation's thread, and if that thread is stuck in native code it prints
the operation's error and ends the process with status 1 — before JAX's
coordinator, whose heartbeat `initialize` sets longer, would abort it.
See docs/multi-host.md.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from keras_hub_dist import _compat
from keras_hub_dist.errors import ProcessLostError, process_lost_class

_LOST_SIGNS = re.compile(
    r"Gloo [\w -]*failed|heartbeat timeout|stopped sending heartbeats|tasks? (?:are|is) unhealthy"
    r"|lost earlier in this job",
    re.IGNORECASE,
)
# Only from JAX's runtime: an object store's reset connection is no lost process.
_JAX_LOST_SIGNS = re.compile(
    r"Connection closed by peer|Connection reset by peer|Socket closed|Connection refused|Broken pipe",
    re.IGNORECASE,
)
# What each kind of operation leaves behind when a process is lost.
LOAD_LEFT = "nothing: no model is returned, nothing was written, this process's device arrays go with it"
SAVE_LEFT = (
    "nothing published at the target (a preset already there is unchanged); the staging directory, or in "
    "a bucket the owner record and any multipart uploads not aborted, are swept by the next save to the "
    "same target (docs/multi-host.md)"
)
RESTORE_LEFT = "the model's variables partly restored: restore the checkpoint again in the restarted job"
# A loss after process 0 published (the last agreement of a save).
PUBLISHED_LEFT = (
    "the target, published whole before the loss (every process had written and hashed its share): it is "
    "readable; nothing else"
)
LEFT_NOW: list[str] = []  # what the running operation leaves instead of its `left`, once known
LOST: list[str] = []  # the first lost-process error seen, if any
HOSTS: dict[int, str] = {}  # process id -> "hostname (address)", from `initialize`
PHASE: list[str] = []  # the operations and phases running, outermost first
STEP = [""]  # the last cross-process step entered (check_all's context)
# The outermost operation running: (error class, operation, left, thread id).
_RUNNING: list[tuple[type[Exception], str, str, int]] = []

# Beats: "client", "timeout_s", "seen": {key: (value, since)}, "done": ids.
_BEATS: dict[str, Any] = {}
_BEAT_KEY = "keras_hub_dist/beat/"
_DONE_KEY = "keras_hub_dist/done/"
# After a loss is noticed: seconds the operation's thread has to raise it
# itself (a watched wait: 0.05 s), then to raise it once it is put into
# that thread (Python code), before its error is printed and the process
# ends (a thread stuck in native code).
_OWN_RAISE_S, _PUT_RAISE_S = 0.5, 1.5


def start_beats(client: Any, timeout_s: int) -> None:
    """Starts this process's beats and the watch on the others' (one
    daemon thread), and marks this process done at a clean exit (a process
    that finished is not lost)."""
    _BEATS.update(client=client, timeout_s=timeout_s, seen={}, done=set())
    me = jax.process_index()
    threading.Thread(target=_beat, args=(client, f"{_BEAT_KEY}{me}"), name="khd-beat", daemon=True).start()

    def done() -> None:
        with contextlib.suppress(Exception):  # the coordinator gone: nobody to tell
            client.key_value_set(f"{_DONE_KEY}{me}", "1", allow_overwrite=True)

    atexit.register(done)  # after JAX's: runs before its shutdown barrier


def _beat(client: Any, key: str) -> None:
    count, noticed, put = 0, None, False
    while True:
        count += 1
        with contextlib.suppress(Exception):  # the coordinator gone: JAX itself ends this process
            client.key_value_set(key, str(count), allow_overwrite=True)
        if noticed is None and silent_processes():
            noticed = time.monotonic()
        if noticed is not None:
            put = _end_the_wait(time.monotonic() - noticed, put)
        time.sleep(0.25 if noticed is not None else 1.0)


def _end_the_wait(since_s: float, put: bool) -> bool:
    """After a loss noticed `since_s` ago: nothing while the operation's
    thread raises it; else puts it into that thread, then ends the process
    (status 1, the error printed). Past the heartbeat, a survivor that
    caught the error and went on is ended too, before JAX's coordinator
    aborts it. Returns whether the error was put into the thread."""
    if LOST:
        if since_s > 1.5 * _BEATS["timeout_s"]:
            _end(f"{LOST[0]} This process caught the error and went on; it is ended before JAX's "
                 "coordinator aborts it.")
        return put
    if not _RUNNING:  # a loss outside any operation of the package: as JAX would, but status 1
        _end(str(process_lost(_PeerSilent(), ProcessLostError, "this job", "whatever this process held")))
    error_class, operation, left, thread = _RUNNING[0]
    if since_s >= _OWN_RAISE_S and not put:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(_PeerSilent))
        return True
    if since_s >= _OWN_RAISE_S + _PUT_RAISE_S:
        error = process_lost(_PeerSilent(), error_class, operation, left)
        _end(f"{type(error).__module__}.{type(error).__name__}: {error} (the operation's thread was stuck "
             "in native code: the process ends here)")
    return put


def _end(message: str) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.write(f"keras_hub_dist: {message}\n")
        sys.stderr.flush()
    os._exit(1)


def silent_processes() -> list[int]:
    """The processes whose beat has not changed for the heartbeat timeout,
    those that exited cleanly left out (at most one key-value read a
    second)."""
    if not _BEATS:
        return []
    now, state = time.monotonic(), _BEATS
    if now - state.setdefault("read", 0.0) >= 1.0:
        state["read"] = now
        try:
            beats = dict(state["client"].key_value_dir_get(_BEAT_KEY))
            done = dict(state["client"].key_value_dir_get(_DONE_KEY))
        except Exception:  # noqa: BLE001 - the coordinator gone: JAX itself ends this process
            return []
        state["done"] = {int(k.rsplit("/", 1)[1]) for k in done}
        seen = state["seen"]
        for key, value in beats.items():
            if seen.get(key, (None,))[0] != value:
                seen[key] = (value, now)
    me = jax.process_index()
    return [
        p for p in range(jax.process_count())
        if p != me and p not in state["done"]
        and now - state["seen"].get(f"{_BEAT_KEY}{p}", (None, now))[1] > state["timeout_s"]
    ]


class _PeerSilent(RuntimeError):
    """What a wait raises when a process stopped beating."""

    def __str__(self) -> str:
        silent = silent_processes() or [p for p in range(jax.process_count()) if p != jax.process_index()][:1]
        return (" ".join(f"Task {p} heartbeat timeout." for p in silent)
                + f" (no keras_hub_dist beat for {_BEATS.get('timeout_s')} s)")


def watching_peers(function: Callable, *args: Any) -> Any:
    """`function(*args)`, run in a helper thread while this one watches the
    beats: a lost process raises here (the call is left behind) instead of
    waiting in a cross-process wait that only its own timeout ends (Orbax's
    barriers: minutes)."""
    if not _BEATS or jax.process_count() == 1:
        return function(*args)
    done, box = threading.Event(), {}

    def run() -> None:
        try:
            box["value"] = function(*args)
        except BaseException as error:  # noqa: BLE001 - re-raised by the caller
            box["error"] = error
        finally:
            done.set()

    threading.Thread(target=run, name="khd-watched", daemon=True).start()
    while not done.wait(0.05):
        if silent_processes():
            raise _PeerSilent()
    if "error" in box:
        raise box["error"]
    return box["value"]


def await_ready(array: jax.Array) -> None:
    """`array.block_until_ready()`, but a program waiting for a lost
    process raises (`Task N heartbeat timeout`) instead of waiting forever."""
    if not _BEATS or jax.process_count() == 1:
        array.block_until_ready()
        return
    pause = 0.001
    while not array.is_ready():
        time.sleep(pause)
        pause = min(2 * pause, 0.1)
        if silent_processes():
            raise _PeerSilent()
    array.block_until_ready()  # raises the program's own error, if any


# --- The test hook: `KERAS_HUB_DIST_TEST_KILL_AT="OPERATION.EVENT:K"` (read
# by `initialize`) SIGKILLs this process at the K-th EVENT of OPERATION, to
# test what the other processes do then (tests/remote/lost_process_worker.py,
# benchmarks/bench_lost_host.py). OPERATION: load, save, conversion,
# adapter-save, restore (the outermost one running); EVENT: step (each
# cross-process step entered), exchange (each exchange round of a load),
# part (each part written or uploaded), publish. Unset: `reached` returns at
# its first test.
_KILL_AT: list = []  # [event, k, count]


def arm_test_kill(spec: str | None) -> None:
    """Arms the test hook with `spec` ("OPERATION.EVENT:K"), or disarms it."""
    _KILL_AT.clear()
    if spec:
        event, _, k = spec.rpartition(":")
        _KILL_AT.extend([event, int(k), 0])


def reached(event: str) -> None:
    """Marks one `event` of the running operation (the test hook)."""
    if not _KILL_AT or not _RUNNING:
        return
    if f"{_RUNNING[0][1].removeprefix('the ').replace(' ', '-')}.{event}" != _KILL_AT[0]:
        return
    _KILL_AT[2] += 1
    if _KILL_AT[2] == _KILL_AT[1]:
        sys.stderr.write(f"keras_hub_dist test hook: SIGKILL at {_KILL_AT[0]}:{_KILL_AT[1]} t={time.time():.6f}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


@atexit.register  # after JAX's (imported above), so it runs before JAX's clean-up
def _exit_after_loss() -> None:
    """A process that saw a lost process ends here, with status 1: JAX's
    exit-time clean-up would wait for programs stuck on the lost process
    (and for it at a shutdown barrier)."""
    if LOST:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)


def _end_on_uncaught_loss() -> None:
    """An uncaught error ends the process as soon as its traceback is
    printed: Python would first join threads left waiting on the lost
    process (a thread pool's call stuck at an Orbax barrier)."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        previous(kind, value, traceback)
        _exit_after_loss()

    sys.excepthook = hook


def refuse_after_loss() -> None:
    """Fails at once a collective entered after a loss (e.g. in a failed
    save's clean-up): it would wait up to gloo's 30 s for the lost process."""
    if LOST:
        raise RuntimeError(f"A process of this job was lost earlier in this job: {LOST[0]}")


def lost_process_cause(error: BaseException) -> BaseException | None:
    """The innermost error of `error`'s chain (causes, contexts, wrapped
    messages) that says a process of the job is gone, or `error` itself
    after a loss seen earlier; `None` if none does (or one process)."""
    if jax.process_count() == 1:
        return None
    seen: set[int] = set()
    found, current = None, error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = f"{type(current).__name__}: {current}"
        if _LOST_SIGNS.search(text) or (
            type(current).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and _JAX_LOST_SIGNS.search(text)
        ):
            found = current
        current = current.__cause__ or current.__context__
    return found or (error if LOST else None)


def lost_processes(text: str) -> tuple[int, ...]:
    """The process ids `text` names as lost: the coordination service's
    "Task N heartbeat timeout" / unhealthy tasks, or gloo's peer address
    when one other process has it; with 2 processes, the other one."""
    ids = {int(n) for n in re.findall(r"Task (\d+) heartbeat timeout", text)}
    if unhealthy := re.search(r"stopped sending heartbeats\):\s*([\d,\s]+)", text):
        ids |= {int(n) for n in re.findall(r"\d+", unhealthy.group(1))}
    me, count = jax.process_index(), jax.process_count()
    if not ids and (peer := re.search(r"peer \[([^\]]+)\]", text)):
        at = [p for p, host in HOSTS.items() if p != me and host.endswith(f"({peer.group(1)})")]
        ids = set(at) if len(at) == 1 else ids
    if not ids and count == 2:
        ids = {1 - me}
    return tuple(sorted(ids - {me}))


def _first_line(text: str, limit: int = 400) -> str:
    line = " ".join(text.strip().split("\n")[0].split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def process_lost(error: BaseException, error_class: type[Exception], operation: str, left: str) -> ProcessLostError | None:
    """The `ProcessLostError` (also an `error_class`) that `error` amounts
    to, or `None` when it does not say a process is lost. Detaches JAX's
    distributed client once a loss is seen."""
    cause = lost_process_cause(error)
    if cause is None:
        return None
    text = f"{type(cause).__name__}: {cause}"
    if not LOST:
        LOST.append(_first_line(text))
        _compat.distributed_client(detach=True)
        _end_on_uncaught_loss()
    lost = lost_processes(text)
    hosts = [f"process {p}" + (f" on {HOSTS[p]}" if p in HOSTS else "") for p in lost]
    who = ", ".join(hosts) if hosts else f"another process (this one is process {jax.process_index()})"
    left = LEFT_NOW[0] if LEFT_NOW else left
    where = " > ".join(PHASE) or operation
    step = f' (the last cross-process step begun: "{STEP[0]}")' if STEP[0] else ""
    return process_lost_class(error_class)(
        f"{operation.capitalize()} lost {who} of the {jax.process_count()}-process jax.distributed job "
        f"during {where}{step}. Expected every process to take part in that step; received from JAX on "
        f"process {jax.process_index()}: {LOST[0]} No file or variable is at fault. Left behind: {left}. "
        "Fix: find why that process died (its log, the scheduler's preemption or OOM events), then "
        "restart the whole job, every process. This process no longer waits for the lost one at exit; "
        "start jobs with keras_hub_dist.initialize() so that a loss is noticed within its heartbeat.",
        lost=lost, phase=where, left=left,
    )


def raises_process_lost(error_class: type[Exception], operation: str, left: str) -> Callable:
    """Decorates a public operation: an error that says a process of the
    job was lost, wherever it was raised or wrapped, leaves as the
    operation's `ProcessLostError` (`process_lost`)."""

    def decorate(function: Callable) -> Callable:
        @functools.wraps(function)
        def run(*args: Any, **kwargs: Any) -> Any:
            PHASE.append(operation)
            if len(PHASE) == 1:
                _RUNNING.append((error_class, operation, left, threading.get_ident()))
            try:
                return function(*args, **kwargs)
            except ProcessLostError:
                raise
            except Exception as error:
                lost = process_lost(error, error_class, operation, left)
                if lost is None:
                    raise
                raise lost from lost_process_cause(error)
            finally:
                PHASE.pop()
                if not PHASE:
                    STEP[0] = ""
                    _RUNNING.clear()
                    LEFT_NOW.clear()

        return run

    return decorate
