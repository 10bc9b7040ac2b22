"""`keras-hub-dist validate --quantize`: ours loads quantized, stock loads in
float under the same distribution and then calls `model.quantize`; its
failure is a case error in the report, not a crash."""

import keras
import keras_hub
import pytest

from keras_hub_dist.cli import main as cli
from keras_hub_dist.validate import report as _report_mod
from keras_hub_dist.validate import runner as _runner
from keras_hub_dist.validate import worker as _validate_worker

TINY_LLAMA = dict(vocabulary_size=512, num_layers=1, num_query_heads=8, num_key_value_heads=8,
                  hidden_dim=64, intermediate_dim=128)


@pytest.fixture(scope="module")
def tiny_preset(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("preset") / "tiny_llama")
    keras.utils.set_random_seed(0)
    keras_hub.models.LlamaBackbone(**TINY_LLAMA).save_to_preset(path)
    return path


def test_quantize_flag():
    args = cli.build_parser().parse_args(["validate", "--preset", "p", "--quantize", "int4"])
    assert cli.options_from_args(args).quantize == "int4"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["validate", "--preset", "p", "--quantize", "int2"])


def _measure(case, preset, quantize, mesh=(1, 8)):
    return _validate_worker.run_task(
        {"task": "measure", "case": case, "phase": "load", "preset": preset, "preset_dir": preset,
         "mesh": list(mesh), "interval_s": 0.002, "quantize": quantize}
    )


def test_worker_measures_ours_quantized_and_stock_quantize_failing(tiny_preset):
    ours = _measure("ours", tiny_preset, "int4")
    assert ours["ok"] and "int8" in ours["weight_dtypes"]
    # Stock under ModelParallel, then quantize("int4"): the packed kernels
    # get their float kernels' 3-axis layouts (what the issue reports).
    with pytest.raises(ValueError, match="incompatible with its sharding annotation"):
        _measure("stock", tiny_preset, "int4")
    keras.distribution.set_distribution(None)
    stock = _measure("stock", tiny_preset, "int8")
    assert stock["ok"] and stock["model_bytes"] == _measure("ours", tiny_preset, "int8")["model_bytes"]
    report = {**_runner._new_report(cli.options_from_args(cli.build_parser().parse_args(
        ["validate", "--preset", tiny_preset, "--quantize", "int8"]))), "cases": []}
    assert "quantized int8 (ours: quantize=; stock: float, then model.quantize" in _report_mod._header_lines(report)[0]
