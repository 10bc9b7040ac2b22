"""The suite's persistent XLA compilation cache, shared by the pytest workers
and the subprocesses of the multi-process tests (tests/conftest.py).

JAX's cache with a size limit (`jax_compilation_cache_max_size`) takes a
file lock around every read and, before every write, lists and stats every
entry of the directory to find what to evict (`LRUCache._evict_if_needed`):
with the suite's ~2,300 entries one write cost ~0.28 s, and a stock
`quantize("int4")` of a tiny Llama spent 9.5 s of its 12.9 s there
(cProfile). Without a limit JAX neither locks nor evicts, but writes an
entry in place, so another process could read it half written (JAX then
warns and compiles again). `write_entries_atomically` makes each write a
rename of a finished file instead: a reader finds the whole entry or none.
The directory is the suite's own (`.cache/jax-tests`), deleted by hand.
"""

import os


def write_entries_atomically() -> None:
    """In this process, JAX's unbounded compilation cache writes each entry
    to a temporary file and renames it into place."""
    from jax._src import lru_cache

    if getattr(lru_cache.LRUCache.put, "writes_atomically", False):
        return
    plain_put = lru_cache.LRUCache.put

    def put(self, key: str, value: bytes) -> None:
        if self.eviction_enabled:
            return plain_put(self, key, value)
        path = os.path.join(str(self.path), f"{key}-cache")
        if os.path.exists(path):
            return
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "wb") as f:
            f.write(value)
        os.replace(temporary, path)

    put.writes_atomically = True
    lru_cache.LRUCache.put = put
