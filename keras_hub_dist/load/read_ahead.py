"""Reading ahead of placing: whole variables on worker threads (`Prefetch`),
an exchanged variable's rounds on a thread of their own (`RoundsAhead`).

Both bound what is read but not yet placed, so host memory stays at the
read-ahead window (`execute.PREFETCH_BYTES`, a few rounds), and both stop
reading as soon as the load fails (nothing starts after the failure; what
is in flight is waited for by `close`).
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from keras_hub_dist.errors import PresetError
from keras_hub_dist.load.block_plan import VariablePlan

__all__ = ["Prefetch", "RoundsAhead"]


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class RoundsAhead:
    """An exchanged variable's rounds, read on a thread of their own at most
    `depth` rounds ahead of the one being placed: reading overlaps the
    rounds' programs, and the variable's host pieces never all exist at once
    (host memory stays at a few rounds, not the process's whole share)."""

    _END = object()

    def __init__(self, rounds: Iterator[Any], depth: int) -> None:
        self._queue: queue.Queue = queue.Queue(depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(rounds,), name="keras_hub_dist-rounds", daemon=True)
        self._thread.start()

    def _run(self, rounds: Iterator[Any]) -> None:
        try:
            for item in rounds:
                if not self._put(item):
                    return
        except BaseException as e:  # noqa: BLE001 - raised in the consumer
            self._put(_Failed(e))
            return
        self._put(self._END)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[Any]:
        while (item := self._queue.get()) is not self._END:
            if isinstance(item, _Failed):
                raise item.error
            yield item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class Prefetch:
    """Reads whole variables ahead on worker threads, in plan order, while
    the caller places earlier ones: reading, host transforms and device
    work overlap. At most `max_bytes` of read-but-unplaced host blocks are
    in flight beyond the variable being placed. Adjacent variables of one
    read group (`TensorSource.read_group`) are read by one job, one after
    another: a quantized kernel's scale then reuses the statistics its
    values kept instead of reading the kernel again on a second thread."""

    def __init__(self, variables: Sequence[VariablePlan], produce: Callable[[VariablePlan], list], workers: int, max_bytes: int) -> None:
        self._variables = list(variables)
        self._produce = produce
        self._pool = ThreadPoolExecutor(max(1, workers), "keras_hub_dist-prefetch")
        self._max_bytes = max_bytes
        self._futures: collections.deque = collections.deque()
        self._next = 0
        self._in_flight = 0
        self.stopped = threading.Event()

    def _group(self, start: int) -> list[VariablePlan]:
        group = [self._variables[start]]
        key = group[0].source.read_group
        while (
            key is not None
            and start + len(group) < len(self._variables)
            and self._variables[start + len(group)].source.read_group is key
        ):
            group.append(self._variables[start + len(group)])
        return group

    def _fill(self) -> None:
        while self._next < len(self._variables) and (
            not self._futures or self._in_flight + self._variables[self._next].read_bytes <= self._max_bytes
        ):
            group = self._group(self._next)
            futures = [Future() for _ in group]
            self._pool.submit(self._run, group, futures)
            for var, future in zip(group, futures):
                self._futures.append((var, future))
                self._in_flight += var.read_bytes
            self._next += len(group)

    def __iter__(self) -> Iterator[tuple[VariablePlan, Any]]:
        self._fill()
        while self._futures:
            var, future = self._futures.popleft()
            self._in_flight -= var.read_bytes
            self._fill()
            yield var, future

    def _run(self, group: Sequence[VariablePlan], futures: Sequence[Future]) -> None:
        for i, (var, future) in enumerate(zip(group, futures)):
            if not future.set_running_or_notify_cancel():
                return  # closed: the rest were cancelled too
            try:
                # A failed load stops here: no variable starts reading after it.
                if self.stopped.is_set():
                    raise PresetError("the load stopped")
                future.set_result(self._produce(var))
            except BaseException as e:  # noqa: BLE001 - the caller re-raises it
                future.set_exception(e)
                for later in futures[i + 1 :]:
                    if later.set_running_or_notify_cancel():
                        later.set_exception(PresetError("the load stopped"))
                return

    def close(self) -> None:
        self.stopped.set()
        for _, future in self._futures:
            future.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._futures.clear()
