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


class _Hook:
    """One patched JAX function and its listeners: patched when the first
    listener arrives, restored when the last one leaves. The `_compat`
    names are looked up at each watch (tests turn a hook off there)."""

    def __init__(self, available: str, swap: str) -> None:
        self._available, self._swap_name = available, swap
        self.listeners: list[Callable[..., None]] = []
        self.original: Callable[..., Any] | None = None

    @contextlib.contextmanager
    def watch(self, callback: Callable[..., None], replacement: Callable[..., Any]) -> Iterator[bool]:
        if not getattr(_compat, self._available):
            yield False
            return
        with _lock:
            if not self.listeners:
                self.original = getattr(_compat, self._swap_name)(replacement)
            self.listeners.append(callback)
        try:
            yield True
        finally:
            with _lock:
                self.listeners.remove(callback)
                if not self.listeners:
                    getattr(_compat, self._swap_name)(self.original)
                    self.original = None

    def tell(self, *args: Any) -> None:
        for listener in list(self.listeners):
            try:
                listener(*args)
            except Exception:  # noqa: BLE001 - never break a user's program
                pass


_lock = threading.Lock()
_compiles = _Hook("CAN_WATCH_COMPILATIONS", "swap_compile_function")
_executions = _Hook("CAN_WATCH_EXECUTIONS", "swap_execute_method")


def _watching_compile(backend: Any, computation: Any, *args: Any, **kwargs: Any) -> Any:
    executable = _compiles.original(backend, computation, *args, **kwargs)
    _compiles.tell(executable, _compat.computation_name(computation))
    return executable


def _watching_execute(self: Any, *args: Any) -> Any:
    out = _executions.original(self, *args)
    _executions.tell(_compat.executed_program(self), out)
    return out


def watch_compilations(callback: Callable[[Any, str], None]) -> contextlib.AbstractContextManager[bool]:
    """Calls `callback(loaded_executable, module_name)` per XLA compilation.

    Yields `False` (and calls nothing) where this JAX version has no hook.
    The patch is process-wide and removed when the last watcher exits.
    """
    return _compiles.watch(callback, _watching_compile)


def watch_executions(callback: Callable[[Any, Any], None]) -> contextlib.AbstractContextManager[bool]:
    """Calls `callback(loaded_executable, outputs)` per Python-path execution.

    Runs through JAX's C++ fast path (the same jit object called again with
    the same argument types) are not seen. Yields `False` where this JAX
    version has no hook. Process-wide; removed when the last watcher exits.
    """
    return _executions.watch(callback, _watching_execute)
