"""`host_io.BufferPool` (host buffers taken back once their values are
consumed, handed out again) and `host_io.collector_paused`."""

import gc

import numpy as np
import pytest

from keras_hub_dist.storage import host_io

MIB = 1 << 20
SIZE = 8 * MIB  # over the pool's minimum: an anonymous mapping of its own


def test_a_given_back_buffer_takes_the_next_read_of_its_size():
    pool = host_io.BufferPool([SIZE, SIZE])
    first = pool.empty((SIZE // 4,), np.float32)
    first[:] = 1
    pool.give(first)
    second = pool.empty((1024, SIZE // 2048), np.uint16)  # same bytes, another shape and dtype
    assert np.shares_memory(first, second)
    assert second.shape == (1024, SIZE // 2048) and second.dtype == np.uint16
    assert second.ctypes.data % 64 == 0 and second.flags.c_contiguous
    assert pool.reused_bytes == SIZE


def test_only_whole_buffers_the_pool_handed_out_are_taken_back():
    pool = host_io.BufferPool([SIZE] * 6)
    mine = pool.empty((SIZE // 4,), np.float32)
    foreign = host_io.aligned_empty((SIZE // 4,), np.float32)  # a reader's own
    plain = np.empty(SIZE // 4, np.float32)
    for array in (foreign, plain, mine[: SIZE // 8], mine.reshape(2, -1).T):
        pool.give(array)
    for _ in range(4):
        assert not np.shares_memory(pool.empty((SIZE,), np.uint8), mine)
    assert pool.reused_bytes == 0


def test_the_pool_keeps_only_what_a_later_read_will_ask_for():
    pool = host_io.BufferPool([SIZE, SIZE, 2 * SIZE], max_bytes=3 * SIZE)
    a, b = pool.empty((SIZE,), np.uint8), pool.empty((SIZE,), np.uint8)
    pool.give(a)
    pool.give(b)  # no third read of SIZE is planned: not kept
    assert pool._bytes == 0
    big = pool.empty((2 * SIZE,), np.uint8)
    pool.give(big)  # no read of 2 * SIZE left
    assert pool._bytes == 0 and pool.reused_bytes == 0

    pool = host_io.BufferPool([SIZE] * 4, max_bytes=SIZE)
    a, b = pool.empty((SIZE,), np.uint8), pool.empty((SIZE,), np.uint8)
    pool.give(a)
    pool.give(b)  # over max_bytes
    assert pool._bytes == SIZE
    pool.clear()
    assert pool._bytes == 0 and not np.shares_memory(pool.empty((SIZE,), np.uint8), a)


def test_small_buffers_are_never_pooled():
    pool = host_io.BufferPool([MIB, MIB])
    small = pool.empty((MIB,), np.uint8)
    pool.give(small)
    assert not np.shares_memory(pool.empty((MIB,), np.uint8), small)


def test_collector_paused_restores_the_collector_even_on_error():
    assert gc.isenabled()
    with pytest.raises(OSError):
        with host_io.collector_paused():
            assert not gc.isenabled()
            with host_io.collector_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()  # the inner block leaves it as it found it
            raise OSError("read failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with host_io.collector_paused():
            pass
        assert not gc.isenabled()  # was off before: stays off
    finally:
        gc.enable()


def test_scratch_buffers_hand_the_same_memory_to_the_next_lease():
    buffers = host_io.ScratchBuffers(min_bytes=1 << 20, keep=2)
    with buffers.lease() as scratch:
        a = scratch((256, 256), np.float32)  # 256 KiB: gets a 1 MiB buffer
        b = scratch((300, 1024), np.float32)  # 1.2 MiB
        assert a.flags.c_contiguous and a.ctypes.data % 64 == 0 and a.dtype == np.float32
        first = {a.ctypes.data, b.ctypes.data}
    with buffers.lease() as scratch:
        # the smallest buffer that fits: the 1 MiB one for a small request
        c = scratch((1000,), np.int8)
        d = scratch((1 << 20,), np.int8)
        assert {c.ctypes.data, d.ctypes.data} == first and c.ctypes.data == a.ctypes.data
        e = scratch((10,), np.float64)  # none free: a fresh one
        assert e.ctypes.data not in first
    assert len(buffers._free) == 2  # at most `keep` held: the largest
    assert max(x.nbytes for x in buffers._free) == 300 * 1024 * 4
