"""A save's staging directory: who owns it, publishing it, and removing
those whose save died.

`save_sharded_preset` writes into `.<name>.partial-<token>` beside the
target and publishes it with a rename; replacing an existing preset moves
the old one aside to `.<name>.replaced-<token>` for a moment. A save killed
outright (SIGKILL from the OOM killer, a preempted VM, a power loss) leaves
them behind. Before it creates its own, the next save to the same target
calls `sweep_stale`, which removes (or restores) only what it can prove a
dead save left, and reports every directory it removed, restored or had to
leave (`save_sharded_preset` warns with it: `StaleStagingWarning`).

Ownership: before the directory exists, the save writes an owner record
`.<name>.owner-<token>.json` beside it (not inside: the directory becomes
the preset, which holds exactly what `save_to_preset` writes): host name,
boot id, PID namespace, pid and start time of the process that owns the
directory (process 0 of the job), the token, the job's process count and
the creation time. The record is removed last, after the directories, so a
staging directory of this package always has one. A save is dead when its
record says this machine and:

- the machine has rebooted since (another boot id): every process of the
  earlier boot is gone;
- or, in the same PID namespace, no process has that pid (or only a zombie),
  or the process with that pid started at another time (the pid was
  reused).

A record from another host, or from another PID namespace of this host (a
container), cannot be proven dead from here: it is left alone, and named in
the warning with how to remove it by hand once that save is over. Host
names are taken to name one machine among those that save to this
directory. A directory with no readable owner record (left by an earlier
version of this package) is removed only once nothing in it has changed
for `UNOWNED_MIN_AGE_S` (a live save writes its files continually).

Of a dead save's `.replaced-` directory (killed between the two renames of
publishing): when the target exists it is the old preset, now replaced, and
removed; when the target is missing it is the only copy and is renamed back
to the target (the killed save never happened).

Processes are looked up with `os.kill(pid, 0)` and, on Linux, the start
time from `/proc/<pid>/stat` in clock ticks since boot: exact and fixed for
the process's life. Elsewhere psutil's `create_time` gives it (on Linux
psutil adds the current boot time, which moves with clock adjustments, so
the same process could look like another one).

Example:

```python
report = sweep_stale("/ckpt", "gemma_tuned")  # None when nothing was there
path = create("/ckpt/gemma_tuned", token, process_count=1)
...  # write the preset into `path`
publish(path, "/ckpt/gemma_tuned", token, durable=True)
discard("/ckpt/gemma_tuned", token)  # the owner record
```
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from dataclasses import asdict, dataclass
from typing import Literal

import psutil

__all__ = [
    "UNOWNED_MIN_AGE_S",
    "Owner",
    "create",
    "discard",
    "fsync_path",
    "fsync_tree",
    "publish",
    "record_path",
    "replaced_path",
    "staging_path",
    "sweep_stale",
]

# A staging directory with no owner record is removed only once nothing in
# it has changed for this long.
UNOWNED_MIN_AGE_S = 24 * 3600
_LINUX_PROC = os.path.exists("/proc/self/stat")
Liveness = Literal["alive", "dead", "unknown"]


def staging_path(parent: str, base: str, token: str) -> str:
    return os.path.join(parent, f".{base}.partial-{token}")


def replaced_path(parent: str, base: str, token: str) -> str:
    return os.path.join(parent, f".{base}.replaced-{token}")


def record_path(parent: str, base: str, token: str) -> str:
    return os.path.join(parent, f".{base}.owner-{token}.json")


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def _boot_id() -> str | None:
    return _read_text("/proc/sys/kernel/random/boot_id")


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _process_start(pid: int) -> tuple[bool, str | None]:
    """Whether process `pid` runs (a zombie does not), and when it started:
    a token telling it from any other process of this boot with that pid,
    `None` where it cannot be read."""
    if pid <= 0:
        return False, None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False, None
    except PermissionError:
        pass  # it runs, as another user
    if _LINUX_PROC:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            return True, None  # hidden (`hidepid`), or it just ended
        fields = stat[stat.rindex(b")") + 2 :].split()
        if fields[0] in (b"Z", b"X"):
            return False, None
        return True, f"ticks:{int(fields[19])}"
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False, None
        return True, f"epoch:{process.create_time()!r}"
    except psutil.NoSuchProcess:
        return False, None
    except psutil.Error:
        return True, None


@dataclass(frozen=True)
class Owner:
    """The process that owns a staging directory (its owner record)."""

    host: str
    boot_id: str | None
    pid_namespace: str | None
    pid: int
    started: str | None
    token: str
    process_count: int
    created: float

    @classmethod
    def of_process(cls, pid: int, token: str, process_count: int) -> Owner:
        """The record of process `pid` of this host (the saver: `os.getpid()`)."""
        return cls(
            socket.gethostname(), _boot_id(), _pid_namespace(), pid,
            _process_start(pid)[1], token, process_count, time.time(),
        )

    @classmethod
    def read(cls, path: str) -> Owner | None:
        """The record at `path`; `None` when missing or unreadable."""
        try:
            with open(path, encoding="utf-8") as f:
                fields = json.load(f)
            owner = cls(**fields)
        except (OSError, ValueError, TypeError):
            return None
        if not (isinstance(owner.pid, int) and isinstance(owner.host, str)):
            return None
        return owner

    def write(self, path: str, *, durable: bool = False) -> None:
        """Creates the record at `path` (which must not exist)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            # One write: a kill leaves it whole or empty.
            os.write(fd, json.dumps(asdict(self)).encode())
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)

    def liveness(self) -> tuple[Liveness, str]:
        """Whether the owning save still runs, and why it is thought so."""
        who = f"process {self.pid} on host {self.host!r}"
        if self.host != socket.gethostname():
            return "unknown", f"{who}: another host, whose processes cannot be seen from here"
        boot = _boot_id()
        if self.boot_id and boot and self.boot_id != boot:
            return "dead", f"{who}, which has rebooted since"
        namespace = _pid_namespace()
        if self.pid_namespace and namespace and self.pid_namespace != namespace:
            return "unknown", f"{who}, in another PID namespace (container) of this host"
        running, started = _process_start(self.pid)
        if not running:
            return "dead", f"{who}, which no longer runs"
        if started is None or self.started is None:
            return "unknown", f"{who}, which runs, but whose start time cannot be read"
        if started != self.started:
            return "dead", f"{who}, which no longer runs (pid {self.pid} is another process now)"
        return "alive", f"{who}, which runs"


def fsync_path(path: str) -> None:
    """Flushes a file or directory (its entries) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """Flushes every file and directory under `root`, and `root`."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(folder, name))
        fsync_path(folder)


def create(target: str, token: str, process_count: int, *, durable: bool = False) -> str:
    """Creates the parents of `target` if needed, the owner record of this
    process, then the staging directory; returns the directory's path.

    With `durable`, the record and every directory entry created are
    flushed to the disk (the staging directory's own entry is flushed when
    it is published).

    Raises:
        OSError: A directory or the record cannot be created.
    """
    parent, base = os.path.split(target)
    existing = parent
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    os.makedirs(parent, exist_ok=True)
    Owner.of_process(os.getpid(), token, process_count).write(
        record_path(parent, base, token), durable=durable
    )
    staging = staging_path(parent, base, token)
    os.mkdir(staging)
    if durable:
        created = os.path.relpath(parent, existing).split(os.sep) if parent != existing else []
        for depth in range(len(created) + 1):
            fsync_path(os.path.join(existing, *created[:depth]))
    return staging


def publish(staging: str, target: str, token: str, *, durable: bool = False) -> None:
    """Renames `staging` to `target`. An existing target is moved aside
    first and removed only once the new one is in place.

    With `durable`, every file and directory of `staging` and the parent
    are flushed to the disk before the rename, and the parent again after
    it: once this returns, a power loss leaves the new preset at `target`.
    """
    parent, base = os.path.split(target)
    if durable:
        fsync_tree(staging)
        fsync_path(parent)
    replaced = None
    if os.path.lexists(target):
        replaced = replaced_path(parent, base, token)
        os.rename(target, replaced)
    try:
        os.rename(staging, target)
    except BaseException:
        if replaced is not None:
            os.rename(replaced, target)
        raise
    if durable:
        fsync_path(parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def discard(target: str, token: str) -> None:
    """Removes what the save `token` left beside `target` (its staging
    directory, if not published, then its owner record)."""
    parent, base = os.path.split(target)
    shutil.rmtree(staging_path(parent, base, token), ignore_errors=True)
    try:
        os.remove(record_path(parent, base, token))
    except FileNotFoundError:
        pass


def _newest_change(paths: list[str]) -> float:
    newest = 0.0
    for path in paths:
        newest = max(newest, os.lstat(path).st_mtime)
        for folder, dirs, files in os.walk(path):
            for name in dirs + files:
                newest = max(newest, os.lstat(os.path.join(folder, name)).st_mtime)
    return newest


def _judge(record: str, dirs: list[str]) -> tuple[Liveness, str, float]:
    """(liveness, why, when) of the save that left `dirs`: when it began,
    or for want of a record when anything in `dirs` last changed."""
    owner = Owner.read(record)
    if owner is not None:
        return (*owner.liveness(), owner.created)
    newest = _newest_change(dirs + ([record] if os.path.lexists(record) else []))
    age = time.time() - newest
    if age >= UNOWNED_MIN_AGE_S:
        return "dead", f"no owner record, and nothing in it changed for {age / 3600:.0f} h", newest
    return "unknown", (
        f"no owner record (an earlier version's save?), and changed {age / 60:.0f} min ago: "
        f"removed once unchanged for {UNOWNED_MIN_AGE_S // 3600} h"
    ), newest


def sweep_stale(parent: str, base: str) -> str | None:
    """Removes what saves to `parent/base` that provably died left there.

    See the module docstring for when a save is dead. Nothing is raised:
    what cannot be removed is named in the report.

    Returns:
        A report naming every directory removed, restored or left (whose
        save cannot be proven dead), or `None` when there was none.
    """
    pattern = re.compile(
        re.escape(f".{base}.") + r"(partial|replaced|owner)-([0-9a-f]{12})(\.json)?"
    )
    try:
        names = os.listdir(parent)
    except OSError:
        return None
    tokens = set()
    for name in names:
        match = pattern.fullmatch(name)
        if match and (match[1] == "owner") == bool(match[3]):
            tokens.add(match[2])
    target = os.path.join(parent, base)
    judged = []
    for token in tokens:
        dirs = [p for p in (replaced_path(parent, base, token), staging_path(parent, base, token))
                if os.path.lexists(p)]
        try:
            judged.append((token, dirs, *_judge(record_path(parent, base, token), dirs)))
        except OSError:
            continue  # removed meanwhile (by a concurrent sweep)
    removed, left, failed = [], [], []
    # The newest first: once one replaced preset is restored, older ones are garbage.
    for token, dirs, verdict, why, _ in sorted(judged, key=lambda j: -j[4]):
        if verdict == "unknown":
            shown = dirs or [record_path(parent, base, token)]
            left += [f"{path!r} ({why})" for path in shown]
            continue
        if verdict == "alive":
            continue
        for path in dirs:
            try:
                if path.endswith(f".replaced-{token}") and _is_missing_or_empty(target):
                    os.rename(path, target)
                    removed.append(f"restored {target!r} from {path!r} (its save was killed "
                                   f"while replacing it: {why})")
                    continue
                shutil.rmtree(path)
                removed.append(f"removed {path!r} (its save: {why})")
            except FileNotFoundError:
                pass  # removed meanwhile (by a concurrent sweep)
            except OSError as e:
                failed.append(f"{path!r} ({type(e).__name__}: {e})")
        if not any(os.path.lexists(d) for d in dirs):
            try:
                os.remove(record_path(parent, base, token))
            except OSError:
                pass
    return _report(target, removed, left, failed)


def _is_missing_or_empty(path: str) -> bool:
    if not os.path.lexists(path):
        return True
    return os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path)


def _report(target: str, removed: list[str], left: list[str], failed: list[str]) -> str | None:
    if not (removed or left or failed):
        return None
    text = f"Found what earlier saves to {target!r} left beside it"
    text += (": " + "; ".join(removed) + ".") if removed else "."
    if failed:
        text += f" Could not remove (remove it by hand): {'; '.join(failed)}."
    if left:
        text += (
            " Left alone (its save may still run; remove it by hand once it does not): "
            + "; ".join(left) + "."
        )
    return text
