"""Worker processes forked from one that has already imported JAX, Keras,
KerasHub and this package, instead of started afresh.

Each multi-process test starts 2 to 4 Python processes; each spent ~3 CPU-s
importing before doing anything (62 such processes a run). A zygote, started
once per pytest process, imports those modules without initializing any JAX
backend (so each child still chooses its own device count, joins its own
`jax.distributed` job and installs JAX's at-fork handler itself), then forks
a child per worker. The child replaces its environment, argv, working
directory and standard streams, runs the worker script as `__main__`, and
leaves exactly as a fresh interpreter would: `SystemExit` or an uncaught
exception unwinds to the zygote's module level (no `finally` of the zygote
in the way), so Python prints the traceback, runs the `atexit` handlers
(JAX's distributed shutdown among them) and exits with the same status; a
signal kills it as it would any process. The zygote reaps its children and
reports each one's exit status, read by `ForkedProcess.poll`.

Usage (the test side): `spawn([sys.executable, script, *args], env=...)`
returns a `ForkedProcess` with what `subprocess.Popen` gives the tests:
`pid` (the leader of its own session), `poll`, `wait`, `communicate`,
`returncode`, `stderr`.
"""

import io
import json
import os
import pathlib
import select
import subprocess
import sys
import tempfile
import threading
import time

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _serve() -> dict | None:
    """The zygote's loop; returns in a forked child (its request), never in
    the zygote, which exits when its parent closes the pipe."""
    children, pending = set(), b""
    out = sys.stdout
    while True:
        ready, _, _ = select.select([0], [], [], 0.01)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            children.discard(pid)
            out.write(json.dumps({"pid": pid, "code": os.waitstatus_to_exitcode(status)}) + "\n")
            out.flush()
        if ready:
            data = os.read(0, 1 << 16)  # unbuffered: select sees every request
            if not data:
                sys.exit(0)
            pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                return request
            children.add(pid)
            out.write(json.dumps({"started": request["token"], "pid": pid}) + "\n")
            out.flush()


def _become(request: dict) -> None:
    """In the child: the worker's session, streams, environment and argv."""
    os.setsid()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
    os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = request["argv"][1:]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))


class ForkedProcess:
    """A worker forked by the zygote, seen as `subprocess.Popen` shows one."""

    def __init__(self, zygote: "_Zygote", pid: int, stderr_path: str) -> None:
        self._zygote, self.pid, self._stderr_path = zygote, pid, stderr_path
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout)
            self._zygote.wait_for_exit(0.05)
        return self.returncode

    def communicate(self, timeout=None):
        self.wait(timeout)
        return None, self.stderr.read()

    @property
    def stderr(self):
        with open(self._stderr_path, errors="replace") as f:
            return io.StringIO(f.read())


class _Zygote:
    def __init__(self, env: dict) -> None:
        self._process = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=env, cwd=str(_ROOT),
        )
        self._exits: dict[int, int] = {}
        self._started: dict[str, int] = {}
        self._changed = threading.Condition()
        self._lock = threading.Lock()
        self._dir = tempfile.mkdtemp(prefix="worker_zygote_")
        self._count = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._process.stdout:
            message = json.loads(line)
            with self._changed:
                if "started" in message:
                    self._started[message["started"]] = message["pid"]
                else:
                    self._exits[message["pid"]] = message["code"]
                self._changed.notify_all()

    def alive(self) -> bool:
        return self._process.poll() is None

    def spawn(self, argv, env, cwd) -> ForkedProcess:
        with self._lock:
            self._count += 1
            token = f"{os.getpid()}-{self._count}"
            request = {
                "token": token, "argv": [str(a) for a in argv], "env": dict(env), "cwd": str(cwd),
                "stdout": os.path.join(self._dir, f"{token}.out"),
                "stderr": os.path.join(self._dir, f"{token}.err"),
            }
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
        with self._changed:
            if not self._changed.wait_for(lambda: token in self._started, timeout=180):
                raise RuntimeError("the worker zygote did not fork a worker within 180 s")
            pid = self._started.pop(token)
        return ForkedProcess(self, pid, request["stderr"])

    def exit_code(self, pid: int):
        with self._changed:
            return self._exits.get(pid)

    def wait_for_exit(self, timeout: float) -> None:
        with self._changed:
            self._changed.wait(timeout)


_zygotes: dict[tuple, _Zygote] = {}


def spawn(argv, env, cwd=None) -> ForkedProcess:
    """Forks `argv` (`[sys.executable, script, *args]`) from this pytest
    process's zygote, with `env` as its whole environment. The zygote is
    started with the environment of its first request; those variables
    that JAX, Keras or this package read on import (the backend, the
    platforms, the compilation cache) must be the same for every request."""
    key = tuple(sorted((k, env.get(k)) for k in _IMPORT_TIME_ENV))
    zygote = _zygotes.get(key)
    if zygote is None or not zygote.alive():
        zygote = _zygotes[key] = _Zygote(env)
    return zygote.spawn(argv, env, cwd or os.getcwd())


# What the preloaded modules read from the environment when imported.
_IMPORT_TIME_ENV = (
    "KERAS_BACKEND", "JAX_PLATFORMS", "JAX_COMPILATION_CACHE_DIR", "JAX_ENABLE_COMPILATION_CACHE",
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
    "JAX_COMPILATION_CACHE_MAX_SIZE", "PYTHONPATH",
)


if __name__ == "__main__":
    sys.path.insert(0, str(_ROOT))
    # As the workers do before importing anything (multiprocess_jobs.simulate_cpu_devices).
    sys.modules.setdefault("tensorflow", None)
    sys.modules.setdefault("matplotlib", None)
    import jax  # noqa: F401
    import keras  # noqa: F401
    import keras_hub  # noqa: F401

    import keras_hub_dist  # noqa: F401
    import tests.multiprocess_jobs  # noqa: F401
    from jax._src import xla_bridge

    assert not xla_bridge._backends, "the zygote must fork before any JAX backend exists"
    _request = _serve()
    del _serve
    _become(_request)
    del _request
    import runpy

    runpy.run_path(sys.argv[0], run_name="__main__")
    # The script returned: leave without the interpreter's teardown (an
    # exception or `sys.exit` above still leaves as a fresh interpreter would).
    tests.multiprocess_jobs.leave()
