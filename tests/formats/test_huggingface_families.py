"""Every causal-LM family KerasHub converts loads sharded, bitwise equal to
stock `Backbone.from_preset(hf_dir)`.

KerasHub's converter is the source of truth: if its mapping of any family
changes (a new transpose, a renamed tensor), stock and keras_hub_dist are
compared on the same files here, so the drift fails this test.

Three settings per family cover the matrix without multiplying it:
mesh (1, 8) x float32 file x untied x one file; (2, 4) x bfloat16 file x
tied x index + shards; (8, 1) x float32 file x untied x shards, loaded as
bfloat16. Outputs are compared where the model is float32.
"""

import re

import keras_hub
import numpy as np
import pytest
from conftest import jitted_outputs

from keras_hub_dist import load_sharded_preset
from keras_hub_dist.formats import huggingface
from tests.formats.hf import dense, moe, recent
from tests.formats.hf.writer import write_hf_checkpoint

pytestmark = pytest.mark.usefixtures("short_delta_chunks")

MODULES = {case: module for module in (dense, moe, recent) for case in module.CASES}

SETTINGS = {
    "1x8-f32-untied-single": dict(mesh=(1, 8), file_dtype="float32", tied=False, shards=1, dtype=None),
    "2x4-bf16-tied-sharded": dict(mesh=(2, 4), file_dtype="bfloat16", tied=True, shards=3, dtype=None),
    "8x1-f32-untied-sharded-as-bf16": dict(mesh=(8, 1), file_dtype="float32", tied=False, shards=2, dtype="bfloat16"),
}


def _inputs(config, backbone):
    """Inputs of a forward pass, or None where the backbone needs media
    inputs this test does not build (Gemma 4 / Qwen 3.5 towers): their
    weights are still compared bitwise."""
    inputs = {"token_ids": np.arange(3, 11, dtype="int32")[None], "padding_mask": np.ones((1, 8), "int32")}
    names = {t.name for t in backbone.inputs}
    if names - set(inputs) - {"images", "vision_mask", "vision_indices"}:
        return None
    if "images" in names:
        vision = config["vision_config"]
        tokens = config.get("mm_tokens_per_image", 4)
        size = vision["image_size"]
        inputs["images"] = np.random.default_rng(0).standard_normal((1, 1, size, size, 3)).astype("float32")
        inputs["vision_mask"] = np.array([[0] + [1] * tokens + [0] * (7 - tokens)], "int32")
        inputs["vision_indices"] = np.arange(1, 1 + tokens, dtype="int32")[None]
    return {k: v for k, v in inputs.items() if k in names}


def _outputs(backbone, inputs):
    """The jitted forward pass's outputs, by name, as float32."""
    out = jitted_outputs(backbone, inputs)
    out = out if isinstance(out, dict) else {"sequence_output": out}
    return {k: np.asarray(v, dtype=np.float32) for k, v in out.items()}


def _unnumbered(path):
    return re.sub(r"_\d+(?=/|$)", "", path)


def _bits(value):
    array = np.asarray(value)
    return array.dtype, array.shape, np.atleast_1d(array).view(np.uint8).tobytes()


def test_every_tested_model_type_has_a_fixture():
    model_types = {
        MODULES[case].hf_checkpoint(case, tied=False, dtype="float32")[0]["model_type"]
        for case in MODULES
    }
    assert set(huggingface.TESTED_MODEL_TYPES) <= model_types, (
        set(huggingface.TESTED_MODEL_TYPES) - model_types
    )


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("case", list(MODULES))
def test_family_loads_sharded_bitwise_equal_to_stock(case, setting, tmp_path, capsys):
    s = SETTINGS[setting]
    config, tensors = MODULES[case].hf_checkpoint(case, tied=s["tied"], dtype=s["file_dtype"])
    path = write_hf_checkpoint(str(tmp_path / case), config, tensors, num_shards=s["shards"])

    stock = keras_hub.models.Backbone.from_preset(path, dtype=s["dtype"])
    inputs = _inputs(config, stock)
    expected = _outputs(stock, inputs) if s["dtype"] is None and inputs else None
    capsys.readouterr()  # what stock printed (Qwen 3.5's converter audits)
    model, report = load_sharded_preset(
        path, mesh=s["mesh"], dtype=s["dtype"], memory_report=True, progress=False
    )
    assert capsys.readouterr().out == ""  # the library prints nothing
    assert type(model) is type(stock)
    assert report.format == "huggingface"
    assert report.fallbacks == (), report.fallbacks
    if case == "gpt_oss":
        # MXFP4 is read in whole 32-value groups: devices whose blocks split
        # a group (here: 8-way over a 32-wide expert ffn) each read it.
        assert report.file_bytes <= report.bytes_read < 2 * report.file_bytes
    else:
        assert report.bytes_read == report.file_bytes  # one process reads each byte once
    # Paths of layers Keras auto-names differ by a counter between the two
    # builds (`moe_block` / `moe_block_2`), and SmolLM3 reuses paths: compare
    # weights in order.
    assert [_unnumbered(w.path) for w in model.weights] == [_unnumbered(w.path) for w in stock.weights]
    for weight, stock_weight in zip(model.weights, stock.weights):
        assert _bits(weight.value) == _bits(stock_weight.value), weight.path
        sharding = weight.value.sharding
        for shard in weight.value.addressable_shards:
            assert shard.data.shape == sharding.shard_shape(weight.shape)
    if expected is not None:  # run sharded, under the distribution the load set
        got = _outputs(model, inputs)
        for key in expected:
            np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, atol=1e-5, err_msg=key)
