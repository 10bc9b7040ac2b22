"""Callbacks on every XLA compilation and every Python-path program run.

The memory sampler needs two events that JAX does not publish: a program was
compiled (to read its temp-buffer size from XLA's buffer assignment) and a
program started running (its temps exist from then until its outputs are
ready). Both go through private JAX functions; `keras_hub_dist._compat`
holds those names (`swap_compile_function`, `swap_execute_method`) and this
module the bookkeeping around them: the listeners, one lock, and patching on
the first watcher / restoring on the last, so nested and concurrent
samplers share one patch and a user's program never breaks on a listener's
error.

Example:

```python
import jax
import jax.numpy as jnp
from keras_hub_dist.measure import program_watch

names = []
with program_watch.watch_compilations(lambda executable, name: names.append(name)):
    jax.jit(lambda x: x + 1)(jnp.ones(3))
names  # [..., 'jit__lambda']
```
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from keras_hub_dist import _compat

__all__ = ["watch_compilations", "watch_executions"]

_lock = threading.Lock()
_compile_listeners: list[Callable[[Any, str], None]] = []
_execute_listeners: list[Callable[[Any, Any], None]] = []
_original_compile: Callable[..., Any] | None = None
_original_execute: Callable[..., Any] | None = None


def _watching_compile(backend: Any, computation: Any, *args: Any, **kwargs: Any) -> Any:
    executable = _original_compile(backend, computation, *args, **kwargs)
    name = _compat.computation_name(computation)
    for listener in list(_compile_listeners):
        try:
            listener(executable, name)
        except Exception:  # noqa: BLE001 - never break a user's compile
            pass
    return executable


def _watching_execute(self: Any, *args: Any) -> Any:
    out = _original_execute(self, *args)
    for listener in list(_execute_listeners):
        try:
            listener(_compat.executed_program(self), out)
        except Exception:  # noqa: BLE001 - never break a user's program
            pass
    return out


@contextlib.contextmanager
def watch_compilations(callback: Callable[[Any, str], None]) -> Iterator[bool]:
    """Calls `callback(loaded_executable, module_name)` per XLA compilation.

    Yields `False` (and calls nothing) where this JAX version has no hook.
    The patch is process-wide and removed when the last watcher exits.
    """
    global _original_compile
    if not _compat.CAN_WATCH_COMPILATIONS:
        yield False
        return
    with _lock:
        if not _compile_listeners:
            _original_compile = _compat.swap_compile_function(_watching_compile)
        _compile_listeners.append(callback)
    try:
        yield True
    finally:
        with _lock:
            _compile_listeners.remove(callback)
            if not _compile_listeners:
                _compat.swap_compile_function(_original_compile)
                _original_compile = None


@contextlib.contextmanager
def watch_executions(callback: Callable[[Any, Any], None]) -> Iterator[bool]:
    """Calls `callback(loaded_executable, outputs)` per Python-path execution.

    Runs through JAX's C++ fast path (the same jit object called again with
    the same argument types) are not seen. Yields `False` where this JAX
    version has no hook. Process-wide; removed when the last watcher exits.
    """
    global _original_execute
    if not _compat.CAN_WATCH_EXECUTIONS:
        yield False
        return
    with _lock:
        if not _execute_listeners:
            _original_execute = _compat.swap_execute_method(_watching_execute)
        _execute_listeners.append(callback)
    try:
        yield True
    finally:
        with _lock:
            _execute_listeners.remove(callback)
            if not _execute_listeners:
                _compat.swap_execute_method(_original_execute)
                _original_execute = None
