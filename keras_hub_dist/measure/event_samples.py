"""Samples taken at the moment of an event, not when a thread happens to look.

A `MemorySampler`'s background thread sees an allocation only if one of its
samples falls inside the allocation's life; a whole tensor that lives for a
millisecond on device 0 (stock `from_preset`'s moment before each reshard)
is seen on an idle machine and missed on a busy one. `sampling_after_calls`
takes one sample right after each call of a function returns, while the
caller still holds the call's arguments: for `jax.device_put`, the moment a
tensor exists both whole and in its new layout.

Example:

```python
with MemorySampler() as sampler:
    with sampling_after_calls(sampler, jax, "device_put") as samples:
        model = keras_hub.models.Backbone.from_preset(preset)
max(s[0] for s in samples)  # device 0 at its fullest moment, every run
```
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

__all__ = ["sampling_after_calls"]


@contextlib.contextmanager
def sampling_after_calls(sampler: Any, owner: Any, name: str) -> Iterator[list[dict[int, int]]]:
    """Makes `owner.name` call `sampler.sample()` after each call, in the block.

    Patch the attribute that callers look up at call time (a module's
    function such as `jax.device_put`, which Keras's `distribute_tensor`
    calls as `jax.device_put(...)`). The patch is process-wide while the
    block runs and removed on exit.

    Args:
        sampler: A running `MemorySampler`.
        owner: The module or class holding the function.
        name: The attribute name.

    Yields:
        The list the samples are appended to (bytes per device id), in call
        order.
    """
    original = getattr(owner, name)
    samples: list[dict[int, int]] = []

    @functools.wraps(original)
    def sampled(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        samples.append(sampler.sample())
        return result

    setattr(owner, name, sampled)
    try:
        yield samples
    finally:
        setattr(owner, name, original)
