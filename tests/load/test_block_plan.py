"""Load planning, pure: which bytes go to which (fake or real) device."""

import itertools
import math

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import MESH_SHAPES
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fakes import FakeMesh

from keras_hub_dist.formats.base import byte_runs
from keras_hub_dist.formats.keras_h5 import DatasetInfo, dataset_source
from keras_hub_dist.load.block_plan import (
    DIRECT_MIN_RUN_BYTES,
    VariableRequest,
    block_indices,
    plan_load,
)

SPECS = [
    (),
    ("model",),
    ("model", None),
    (None, "model"),
    ("model", "batch"),
    ("batch", "model"),
    (("batch", "model"), None),
    (("model", "batch"), None),
    (None, None, "model"),
    ("model", "batch", None),
]


def _dataset(shape, dtype=np.float32, offset=4096, name="layers/x/vars/0"):
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    return dataset_source(DatasetInfo("/f.h5", name, tuple(shape), dtype, offset, nbytes))


def _real_mesh(shape):
    return Mesh(np.array(jax.devices()).reshape(shape), ("batch", "model"))


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
@pytest.mark.parametrize("spec", SPECS)
def test_block_indices_match_jax_named_sharding(mesh_shape, spec):
    shape = (16, 24, 8)[: max(len(spec), 2)]
    mesh = _real_mesh(mesh_shape)
    ours = block_indices(shape, spec, mesh)
    theirs = NamedSharding(mesh, PartitionSpec(*spec)).devices_indices_map(shape)
    assert set(ours) == set(theirs)
    for device, index in theirs.items():
        expected = tuple(
            (s.start or 0, s.stop if s.stop is not None else d)
            for s, d in zip(index, shape)
        )
        assert ours[device] == expected, (device, spec)


def test_fake_mesh_gives_the_same_blocks_as_a_real_one():
    fake = block_indices((16, 8), ("model", "batch"), FakeMesh({"batch": 2, "model": 4}))
    real = block_indices((16, 8), ("model", "batch"), _real_mesh((2, 4)))
    assert {d.id: i for d, i in fake.items()} == {d.id: i for d, i in real.items()}


@pytest.mark.parametrize("seed", range(30))
def test_byte_runs_cover_exactly_the_block(seed):
    rng = np.random.default_rng(seed)
    ndim = int(rng.integers(1, 5))
    shape = tuple(int(x) for x in rng.integers(1, 7, size=ndim))
    index = []
    for d in shape:
        a = int(rng.integers(0, d))
        b = int(rng.integers(a + 1, d + 1))
        index.append((a, b))
    index = tuple(index)
    array = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    offset = 100
    blob = np.zeros(offset, np.uint8).tobytes() + array.tobytes()
    runs = byte_runs(shape, 4, index, offset)
    got = b"".join(blob[o : o + n] for o, n in runs)
    expected = array[tuple(slice(a, b) for a, b in index)]
    assert np.array_equal(np.frombuffer(got, np.float32).reshape(expected.shape), expected)
    assert runs.nbytes == expected.nbytes
    assert runs.num_runs == len(list(runs))


def test_byte_runs_row_block_is_one_run_and_column_block_one_per_row():
    rows = byte_runs((8, 6), 4, ((2, 4), (0, 6)), 0)
    assert (rows.num_runs, rows.offset, rows.run_bytes) == (1, 2 * 6 * 4, 2 * 6 * 4)
    cols = byte_runs((8, 6), 4, ((0, 8), (3, 6)), 0)
    assert (cols.num_runs, cols.run_bytes) == (8, 12)
    whole = byte_runs((8, 6), 4, ((0, 8), (0, 6)), 40)
    assert (whole.num_runs, whole.offset, whole.nbytes) == (1, 40, 192)
    scalar = byte_runs((), 2, (), 8)
    assert (scalar.num_runs, scalar.nbytes) == (1, 2)


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
def test_replicated_variable_is_read_once_per_host(mesh_shape):
    mesh = FakeMesh(dict(zip(("batch", "model"), mesh_shape)))
    ds = _dataset((64,))
    plan = plan_load([VariableRequest("norm/scale", ds, (None,), np.float32)], mesh)
    (var,) = plan.variables
    assert var.replicated
    assert len(var.blocks) == 1
    assert var.blocks[0].device_ids == tuple(range(8))
    assert var.read_bytes == ds.nbytes
    assert plan.device_bytes() == {d: ds.nbytes for d in range(8)}


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
@pytest.mark.parametrize("spec", [("model", None), (None, "model"), ("model", "batch")])
def test_each_byte_is_read_once_and_every_device_gets_its_share(mesh_shape, spec):
    mesh = FakeMesh(dict(zip(("batch", "model"), mesh_shape)))
    ds = _dataset((64, 32))
    plan = plan_load([VariableRequest("k", ds, spec, np.float32)], mesh)
    (var,) = plan.variables
    axes = {a for e in spec if e for a in ((e,) if isinstance(e, str) else e)}
    parts = math.prod(dict(zip(("batch", "model"), mesh_shape))[a] for a in axes)
    assert len(var.blocks) == parts
    assert sum(len(b.device_ids) for b in var.blocks) == 8
    assert sum(b.runs.nbytes for b in var.blocks) == ds.nbytes
    assert var.read_bytes == ds.nbytes
    assert plan.device_bytes() == {d: ds.nbytes // parts for d in range(8)}


def test_cast_changes_device_bytes_not_read_bytes():
    mesh = FakeMesh({"batch": 1, "model": 8})
    ds = _dataset((64, 32), np.float32)
    plan = plan_load(
        [VariableRequest("k", ds, ("model", None), ml_dtypes.bfloat16)], mesh
    )
    assert plan.read_bytes == ds.nbytes
    assert plan.device_bytes() == {d: ds.nbytes // 16 for d in range(8)}
    assert plan.variables[0].target_dtype == np.dtype(ml_dtypes.bfloat16)


def test_strategies():
    mesh = FakeMesh({"batch": 1, "model": 8})
    rows = plan_load([VariableRequest("a", _dataset((64, 32)), ("model", None), np.float32)], mesh)
    assert rows.variables[0].strategy == "direct"
    cols = plan_load([VariableRequest("b", _dataset((64, 32)), (None, "model"), np.float32)], mesh)
    var = cols.variables[0]
    assert var.strategy == "scatter"
    assert var.read_bytes == 64 * 32 * 4
    # Long runs are read directly even when split along the last axis.
    wide = _dataset((4, 8 * DIRECT_MIN_RUN_BYTES // 4))
    long_runs = plan_load([VariableRequest("c", wide, (None, "model"), np.float32)], mesh)
    assert long_runs.variables[0].strategy == "direct"
    chunked = dataset_source(
        DatasetInfo("/f.h5", "d", (64, 32), np.dtype(np.float32), None, 64 * 32 * 4)
    )
    h5 = plan_load([VariableRequest("d", chunked, (None, "model"), np.float32)], mesh)
    # A transform runs once over the box the local blocks tile, not per block.
    assert h5.variables[0].strategy == "read_union"
    assert h5.variables[0].union == ((0, 64), (0, 32))
    assert h5.variables[0].read_bytes == 64 * 32 * 4
    assert all(b.runs is None for b in h5.variables[0].blocks)
    norm = dataset_source(DatasetInfo("/f.h5", "n", (32,), np.dtype(np.float32), None, 128))
    replicated = plan_load([VariableRequest("n", norm, (None,), np.float32)], mesh)
    assert replicated.variables[0].strategy == "read"  # one block: nothing to share


def test_read_union_covers_only_this_process_blocks():
    mesh = FakeMesh({"batch": 1, "model": 8}, num_processes=2)
    chunked = dataset_source(
        DatasetInfo("/f.h5", "d", (64, 32), np.dtype(np.float32), None, 64 * 32 * 4)
    )
    for p, box in ((0, ((0, 64), (0, 16))), (1, ((0, 64), (16, 32)))):
        var = plan_load([VariableRequest("d", chunked, (None, "model"), np.float32)], mesh, process_index=p).variables[0]
        assert var.strategy == "read_union" and var.union == box
        assert var.read_bytes == 64 * 16 * 4


def test_bfloat16_widening_is_exact_for_every_bit_pattern():
    from keras_hub_dist.storage.host_io import BufferPool
    from keras_hub_dist.load.execute import _cast

    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16)
    widened = _cast(patterns, np.dtype(np.float32), BufferPool())
    np.testing.assert_array_equal(
        widened.view(np.uint32), patterns.astype(np.float32).view(np.uint32)
    )


@pytest.mark.parametrize("num_processes", [2, 4])
def test_each_process_plans_only_its_own_devices(num_processes):
    mesh = FakeMesh({"batch": 1, "model": 8}, num_processes=num_processes)
    sharded = _dataset((64, 32), name="a")
    replicated = _dataset((32,), offset=999_999, name="b")
    requests = [
        VariableRequest("emb", sharded, ("model", None), np.float32),
        VariableRequest("norm", replicated, (None,), np.float32),
    ]
    seen_devices = set()
    read_ranges = []
    norm_ranges = []
    for p in range(num_processes):
        plan = plan_load(requests, mesh, process_index=p)
        emb, norm = plan.variables
        devices = {d for b in emb.blocks for d in b.device_ids}
        assert all(mesh.devices.flat[d].process_index == p for d in devices)
        assert len(devices) == 8 // num_processes
        seen_devices |= devices
        assert emb.read_bytes == sharded.nbytes // num_processes
        read_ranges += [r for b in emb.blocks for r in b.runs]
        # Replicated: held whole by every local device, but read in parts:
        # each process reads only its devices' parts, once, and the devices
        # exchange them.
        assert len(norm.blocks) == 1
        assert len(norm.blocks[0].device_ids) == 8 // num_processes
        assert norm.exchange is not None and norm.exchange.spec == ("model",)
        assert norm.read_bytes == replicated.nbytes // num_processes
        norm_ranges += [r for rnd in norm.exchange.rounds for b in rnd.blocks for r in b.runs]
        # Without the exchange, each process reads it whole.
        alone = plan_load(requests, mesh, process_index=p, exchange=False).variables[1]
        assert alone.exchange is None and alone.read_bytes == replicated.nbytes
    assert sorted(norm_ranges) == [(replicated.stored.offset + 4 * i, 4) for i in range(32)] or (
        sum(n for _, n in norm_ranges) == replicated.nbytes
        and len({o for o, _ in norm_ranges}) == len(norm_ranges)
    )
    assert seen_devices == set(range(8))
    # Together the processes read every byte of the sharded table exactly once.
    covered = sorted(read_ranges)
    assert covered[0][0] == sharded.stored.offset
    assert sum(n for _, n in covered) == sharded.nbytes
    for (o1, n1), (o2, _) in itertools.pairwise(covered):
        assert o1 + n1 == o2


def test_a_process_holding_half_the_columns_reads_only_them():
    # Two processes split the columns: each reads exactly its half of every
    # row, never the other process's bytes.
    mesh = FakeMesh({"batch": 1, "model": 8}, num_processes=2)
    ds = _dataset((64, 32))
    plan = plan_load([VariableRequest("k", ds, (None, "model"), np.float32)], mesh, process_index=1)
    var = plan.variables[0]
    assert var.strategy == "scatter"
    assert var.read_bytes == ds.nbytes // 2
    runs = sorted(r for b in var.blocks for r in b.runs)
    assert sum(n for _, n in runs) == ds.nbytes // 2
    row = 32 * 4
    assert all((o - ds.stored.offset) % row >= row // 2 for o, _ in runs)


@pytest.mark.parametrize("spec", [("model", None), (None, "model"), (None, None)])
def test_blocks_held_on_several_processes_are_read_once_per_job(spec, monkeypatch):
    """2 processes x 4 devices on a (2, 4) mesh whose batch axis spans the
    processes: every block is held on both. Each process reads a disjoint
    half of each of its blocks, in rounds of bounded size, and the halves
    tile the file exactly once."""
    from keras_hub_dist.load import block_plan

    monkeypatch.setattr(block_plan, "EXCHANGE_ROUND_BYTES", 1024)
    mesh = FakeMesh({"batch": 2, "model": 4}, num_processes=2)
    table = _dataset((64, 32), name="t")
    request = VariableRequest("t", table, spec, np.float32)
    job = []
    for p in range(2):
        (var,) = plan_load([request], mesh, process_index=p).variables
        exchange = var.exchange
        assert exchange is not None and exchange.dim == 0
        entry = spec[0]
        assert exchange.spec[0] == (("model", "batch") if entry == "model" else "batch")
        assert exchange.parts == (8 if entry == "model" else 2)
        # Rounds of at most EXCHANGE_ROUND_BYTES per device's final block.
        block_bytes = table.nbytes // (1 if spec == (None, None) else 4)
        assert len(exchange.rounds) == min(block_bytes // 1024, 64 // exchange.parts)
        assert var.read_bytes == table.nbytes // 2
        for rnd in exchange.rounds:
            for block in rnd.blocks:
                (start, stop) = block.read_index[0]
                part = block.index[0][0] // (stop - start)
                rows_per_part = 64 // exchange.parts
                assert start == part * rows_per_part + rnd.offset  # its piece of its part
                job += list(block.runs)
        # The final blocks it holds are unchanged (what device_bytes counts).
        assert {d for b in var.blocks for d in b.device_ids} == set(range(4 * p, 4 * p + 4))
    offsets = sorted(job)
    assert sum(n for _, n in offsets) == table.nbytes
    for (o1, n1), (o2, _) in itertools.pairwise(offsets):
        assert o1 + n1 == o2  # disjoint, and together the whole table


def test_no_exchange_when_no_dimension_takes_the_parts():
    mesh = FakeMesh({"batch": 2, "model": 4}, num_processes=2)
    odd = _dataset((3,), name="odd")  # 3 rows cannot be cut in 2 parts
    (var,) = plan_load([VariableRequest("odd", odd, (None,), np.float32)], mesh, process_index=0).variables
    assert var.exchange is None and var.read_bytes == odd.nbytes


@pytest.mark.parametrize(
    "shape, spec, staged",
    [
        ((64, 32), ("model", "batch"), (("model", "batch"), None)),
        ((64, 32), (None, "batch"), ("batch", None)),
        ((16, 4, 32), ("model", None, "batch"), (("model", "batch"), None, None)),
    ],
)
def test_a_remote_tensor_the_processes_split_on_a_later_axis_is_read_as_whole_rows(shape, spec, staged, monkeypatch):
    """Each process needs a short run of every row (a request per row from
    an object store): instead it reads whole rows, half the rows each, as a
    few long ranges, and the rounds move them to their devices. A local file
    keeps its strided reads (no device exchange)."""
    from keras_hub_dist.load import block_plan

    monkeypatch.setattr(block_plan, "EXCHANGE_ROUND_BYTES", 1024)
    mesh = FakeMesh({"batch": 2, "model": 4}, num_processes=2)
    nbytes = math.prod(shape) * 4
    info = DatasetInfo("/f.h5", "t", shape, np.dtype(np.float32), 4096, nbytes, opened=object())
    local = dataset_source(DatasetInfo("/f.h5", "t", shape, np.dtype(np.float32), 4096, nbytes))
    job = []
    for p in range(2):
        (var,) = plan_load([VariableRequest("t", dataset_source(info), spec, np.float32)], mesh, process_index=p).variables
        assert var.exchange is not None and var.exchange.dim == 0 and var.exchange.spec == staged
        assert var.read_bytes == nbytes // 2
        for rnd in var.exchange.rounds:
            for block in rnd.blocks:
                assert block.runs.num_runs == 1  # whole rows: one range
                job += list(block.runs)
        # The final blocks it holds are unchanged.
        assert {d for b in var.blocks for d in b.device_ids} == set(range(4 * p, 4 * p + 4))
        (kept,) = plan_load([VariableRequest("t", local, spec, np.float32)], mesh, process_index=p).variables
        assert kept.exchange is None and kept.read_bytes == nbytes // 2
    offsets = sorted(job)
    assert sum(n for _, n in offsets) == nbytes
    for (o1, n1), (o2, _) in itertools.pairwise(offsets):
        assert o1 + n1 == o2  # disjoint, and together the tensor once
