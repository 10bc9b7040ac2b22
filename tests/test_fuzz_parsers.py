"""Bounded fuzzing of the index parsers and the HDF5 indexer (the
safetensors header and config parsers have theirs in
tests/formats/test_safetensors_header.py and tests/load/test_config_bound.py):
each case is accepted or refused with a `PresetError`, nothing else.
benchmarks/bench_fuzz.py runs 10,000+ cases per parser."""

import collections

import pytest
from hypothesis import HealthCheck, given, settings

from keras_hub_dist.errors import PresetError
from tests.fuzzing import STRATEGIES, Targets


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    return Targets(str(tmp_path_factory.mktemp("fuzz")))


@pytest.mark.parametrize("name, cases", [("safetensors_index", 200), ("keras_weights_index", 200),
                                         ("hdf5_indexer", 200)])
def test_fuzz_a_parser_only_accepts_or_raises_a_preset_error(targets, name, cases):
    outcomes = collections.Counter()

    @settings(max_examples=cases, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(STRATEGIES[name])
    def run(case):
        try:
            outcomes[getattr(targets, name)(case)] += 1
        except PresetError:
            outcomes["refused"] += 1

    run()
    # Both outcomes occur: the cases reach past the parser's first check.
    assert outcomes["accepted"] > cases // 20 and outcomes["refused"] > cases // 20, outcomes
