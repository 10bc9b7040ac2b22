"""The write plan, with fake devices: every distinct block is written once,
by a process whose devices hold it, and replicated blocks spread out."""

import itertools

import numpy as np
import pytest
from fakes import FakeMesh

from keras_hub_dist.formats.base import byte_runs
from keras_hub_dist.load.block_plan import block_indices
from keras_hub_dist.save.write_plan import SaveRequest, plan_save

SHAPE = (16, 8)


def _request(name, spec, mesh, offset=0, shape=SHAPE):
    return SaveRequest(name, f"path/{name}", shape, np.dtype("float32"), "w.h5", offset,
                       block_indices(shape, spec, mesh))


def _plans(requests, processes):
    return [plan_save(requests, process_index=p, process_count=processes) for p in range(processes)]


def _element_writes(plans):
    """(value, element) -> how many times it is written, by whom."""
    seen = {}
    for plan in plans:
        for value in plan.values:
            for block in value.blocks:
                for element in itertools.product(*(range(a, b) for a, b in block.index)):
                    seen.setdefault((value.name, element), []).append(plan.process_index)
    return seen


@pytest.mark.parametrize("axes,processes", [({"batch": 1, "model": 8}, 2),
                                            ({"batch": 2, "model": 4}, 2),
                                            ({"batch": 8, "model": 1}, 4),
                                            ({"batch": 2, "model": 4}, 1)])
def test_every_element_written_once_by_a_holder(axes, processes):
    mesh = FakeMesh(axes, num_processes=processes)
    requests = [
        _request("split_rows", ("model", None), mesh, 0),
        _request("split_cols", (None, "model"), mesh, 4096),
        _request("replicated", (None, None), mesh, 8192),
        _request("both", ("batch", "model"), mesh, 12288),
    ]
    plans = _plans(requests, processes)
    seen = _element_writes(plans)
    assert len(seen) == 4 * SHAPE[0] * SHAPE[1]
    assert all(len(writers) == 1 for writers in seen.values())
    holders = {r.name: r.device_indices for r in requests}
    for plan in plans:
        for value in plan.values:
            for block in value.blocks:
                device = next(d for d in holders[value.name] if d.id == block.device_id)
                assert device.process_index == plan.process_index
                assert holders[value.name][device] == block.index
                assert block.runs == byte_runs(SHAPE, 4, block.index, value_offset(requests, value.name))
    # Everyone computed the same global totals; replicated bytes spread out.
    assert len({p.bytes_per_process for p in plans}) == 1
    totals = plans[0].bytes_per_process
    assert sum(totals) == 4 * SHAPE[0] * SHAPE[1] * 4
    assert [p.nbytes for p in plans] == list(totals)
    if processes > 1:
        assert max(totals) - min(totals) <= SHAPE[0] * SHAPE[1] * 4  # within one value


def value_offset(requests, name):
    return next(r.offset for r in requests if r.name == name)


def test_replicated_values_alternate_between_processes():
    mesh = FakeMesh({"batch": 1, "model": 8}, num_processes=2)
    requests = [_request(f"norm{i}", (None, None), mesh, 512 * i) for i in range(6)]
    plans = _plans(requests, 2)
    owners = [[p.process_index for p in plans if p.values[i].blocks] for i in range(6)]
    assert owners == [[0], [1], [0], [1], [0], [1]]


def test_host_values_are_written_by_process_zero():
    request = SaveRequest("step", "optimizer/iterations", (), np.dtype("int64"), "w.h5", 64, None)
    plans = _plans([request], 2)
    assert [len(p.values[0].blocks) for p in plans] == [1, 0]
    block = plans[0].values[0].blocks[0]
    assert block.device_id is None and block.index == () and block.nbytes == 8
