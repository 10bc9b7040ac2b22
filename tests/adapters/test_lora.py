"""LoRA adapters out to PEFT (`save_lora_adapter`) and in from PEFT
(`load_sharded_preset(..., lora_adapter=...)`), checked against `peft` on
Transformers' model of the same tiny checkpoints (llama, gemma, qwen3 and
qwen3_moe from the project's fixtures).

Keras's logits are computed with the loaded weights on one device: on a
sharded mesh XLA's float32 sums differ from torch's by up to ~2e-4 on these
checkpoints with no LoRA at all, which says nothing about the adapter. The
placement on the meshes is checked bitwise instead (the same factors on
(1, 8), (2, 4) and (8, 1)). The tiny Llama itself, without any adapter,
gives logits 1.3e-4 from Transformers' (which are 6e-6 from float64's), at
a few positions that stay off by as much with an adapter: there the logits
are compared within 1e-4 plus that base difference.
"""

import json
import os

import jax
import keras
import numpy as np
import pytest
from conftest import lazy_import
import safetensors.numpy

import keras_hub_dist
from keras_hub_dist import PresetError, SaveError
from tests.formats.hf import dense, moe
from tests.formats.hf.writer import write_hf_checkpoint
from tests.save.test_hf_transformers import TOKENS, _causal_lm

torch = lazy_import("torch")
transformers = lazy_import("transformers")
peft = lazy_import("peft")

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASES = {  # case: (fixture module, tied, PEFT targets, mesh)
    "llama": (dense, True, SEVEN, (1, 8)),
    "gemma": (dense, True, SEVEN, (8, 1)),
    "qwen3": (dense, True, SEVEN, (2, 4)),
    # Transformers' MoE experts are fused parameters, no linear modules.
    "qwen3_moe": (moe, False, ["q_proj", "k_proj", "v_proj", "o_proj"], (2, 4)),
}


def _logits(lm):
    """The model's logits, computed on one device (see the module)."""
    keras.distribution.set_distribution(None)
    device = jax.devices()[0]
    inputs = {"token_ids": TOKENS, "padding_mask": np.ones_like(TOKENS)}

    def forward(trainable, non_trainable, x):
        return lm.stateless_call(trainable, non_trainable, x)[0]

    put = lambda variables: [jax.device_put(v.value, device) for v in variables]  # noqa: E731
    return np.asarray(jax.jit(forward)(put(lm.trainable_variables), put(lm.non_trainable_variables), inputs))


def _assert_close(logits, expected, case, root):
    """Within 1e-4 of PEFT's logits (see the module for Llama)."""
    _, cases = root
    if case != "llama":
        np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4)
        return
    keras_base, hf_base = cases["llama_base"]
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4 + np.abs(keras_base - hf_base).max())


def _torch_logits(model):
    with torch.no_grad():
        return model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Per case: the tiny checkpoint, a PEFT adapter of it (r=4,
    lora_alpha=8, random lora_A and lora_B) and PEFT's logits."""
    base = tmp_path_factory.mktemp("lora")
    out = {}
    for case, (module, tied, targets, _) in CASES.items():
        config, tensors = module.hf_checkpoint(case, tied=tied, dtype="float32")
        hf = write_hf_checkpoint(str(base / case), config, tensors)
        model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        if case == "llama":
            keras_base = _logits(_causal_lm(keras_hub_dist.load_sharded_preset(hf, mesh=(1, 8), progress=False)))
            out["llama_base"] = (keras_base, _torch_logits(model))
        tuned = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, parameter in tuned.named_parameters():
                if "lora_" in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
        tuned.save_pretrained(str(base / f"{case}_peft"))
        out[case] = (hf, str(base / f"{case}_peft"), _torch_logits(tuned))
    return base, out


def _lora_variables(model):
    return {v.path: v for v in model.weights if "lora_kernel" in v.path}


@pytest.mark.parametrize("case", CASES)
def test_peft_adapter_loads_as_peft_computes(case, root, tmp_path):
    _, cases = root
    hf, adapter, expected = cases[case]
    mesh = CASES[case][3]
    backbone, report = keras_hub_dist.load_sharded_preset(
        hf, mesh=mesh, progress=False, lora_adapter=adapter, memory_report=True)
    # The factors too go straight into their shards: no device ever holds more.
    assert max(report.peak_per_device[d] / report.final_per_device[d] for d in report.final_per_device) <= 1.05
    lm = _causal_lm(backbone)
    lora = _lora_variables(lm)
    modules = 2 * len(CASES[case][2])  # two layers
    assert len(lora) == 2 * modules
    # Only the factors train, as after `enable_lora`.
    assert {v.path for v in lm.trainable_variables} == set(lora)
    _assert_close(_logits(lm), expected, case, root)

    if case == "qwen3":  # the LoRA model exported whole, merged, for Transformers alone
        export = str(tmp_path / "merged_hf")
        keras_hub_dist.save_sharded_preset(lm, export, format="huggingface", progress=False)
        model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
        _assert_close(_torch_logits(model), expected, case, root)

    merged = _causal_lm(keras_hub_dist.load_sharded_preset(hf, mesh=mesh, progress=False, lora_adapter=adapter, merge=True))
    assert not _lora_variables(merged)
    _assert_close(_logits(merged), expected, case, root)


@pytest.mark.parametrize("case", CASES)
def test_keras_lora_saves_an_adapter_peft_computes(case, root, tmp_path):
    """Keras's own LoRA (`Backbone.enable_lora`: query / value, one update
    per head) for llama and gemma (whose kernels put the heads first), PEFT's
    form (`keras_hub_dist.enable_lora`, lora_alpha != r) on every projection
    the model has for qwen3 and qwen3_moe."""
    _, cases = root
    hf, _, _ = cases[case]
    keras.distribution.set_distribution(None)
    backbone = keras_hub_dist.load_sharded_preset(hf, mesh=CASES[case][3], progress=False)
    base = hf
    if case == "llama":  # the base as the Hugging Face export writes it
        base = str(tmp_path / "base")
        keras_hub_dist.save_sharded_preset(backbone, base, format="huggingface", progress=False)
    if case in ("llama", "gemma"):
        backbone.enable_lora(rank=2)
    else:
        keras_hub_dist.enable_lora(backbone, rank=3, lora_alpha=5, target_modules=CASES[case][2])
    rng = np.random.default_rng(1)
    for variable in _lora_variables(backbone).values():
        variable.assign(rng.normal(scale=0.02, size=variable.shape).astype("float32"))
    lm = _causal_lm(backbone)
    adapter = str(tmp_path / "adapter")
    keras_hub_dist.save_lora_adapter(lm, adapter, base_model_name_or_path=base, progress=False)
    assert sorted(os.listdir(adapter)) == [
        "adapter_config.json", "adapter_model.safetensors", "adapter_model.safetensors.index.json"]
    config = json.loads(open(os.path.join(adapter, "adapter_config.json")).read())
    assert config["peft_type"] == "LORA" and config["bias"] == "none" and config["task_type"] == "CAUSAL_LM"
    assert config["base_model_name_or_path"] == base
    if case in ("llama", "gemma"):  # one rank-2 update per query head, as PEFT's rank 8 x 2
        assert config["target_modules"] == ["q_proj", "v_proj"]
        assert config["r"] == 2 * 8 and config["lora_alpha"] == 2 * 8
    else:
        assert config["target_modules"] == sorted(CASES[case][2]) and (config["r"], config["lora_alpha"]) == (3, 5)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tuned = peft.PeftModel.from_pretrained(model, adapter)
    _assert_close(_logits(lm), _torch_logits(tuned), case, root)


def _tensors(folder):
    return safetensors.numpy.load_file(os.path.join(folder, "adapter_model.safetensors"))


def test_round_trip_is_bitwise_on_every_mesh(root, tmp_path):
    """PEFT -> Keras on (1, 8) -> PEFT gives PEFT's tensors bit for bit;
    loaded again on (2, 4) and (8, 1), the same factors bit for bit."""
    _, cases = root
    hf, adapter, _ = cases["gemma"]
    first = keras_hub_dist.load_sharded_preset(hf, mesh=(1, 8), progress=False, lora_adapter=adapter)
    saved = str(tmp_path / "saved")
    keras_hub_dist.save_lora_adapter(first, saved, progress=False)
    ours, theirs = _tensors(saved), _tensors(adapter)
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert ours[name].tobytes() == theirs[name].tobytes(), name
    values = {p: np.asarray(v.value) for p, v in _lora_variables(first).items()}
    for mesh in ((2, 4), (8, 1)):
        keras.distribution.set_distribution(None)
        again = keras_hub_dist.load_sharded_preset(hf, mesh=mesh, progress=False, lora_adapter=saved)
        assert {p: np.asarray(v.value).tobytes() for p, v in _lora_variables(again).items()} == {
            p: v.tobytes() for p, v in values.items()}


def _adapter(folder, config=None, tensors=None, drop=(), **changes):
    """A copy of a PEFT adapter with changes, written without torch."""
    os.makedirs(folder)
    config = dict(config)
    config.update(changes)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    safetensors.numpy.save_file({k: v for k, v in tensors.items() if k not in drop},
                                os.path.join(folder, "adapter_model.safetensors"))
    return folder


def test_bad_adapters_refused_before_any_device_memory(root, tmp_path, clean_state):
    _, cases = root
    hf, adapter, _ = cases["llama"]
    config = json.loads(open(os.path.join(adapter, "adapter_config.json")).read())
    tensors = _tensors(adapter)
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"

    def refused(folder, *needles, base=hf):
        with clean_state(), pytest.raises(PresetError) as info:
            keras_hub_dist.load_sharded_preset(base, mesh=(1, 8), progress=False, lora_adapter=folder)
        for needle in needles:
            assert needle in str(info.value), str(info.value)

    for i, (change, needle) in enumerate([
        ({"use_dora": True}, "DoRA (use_dora)"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({"alpha_pattern": {"q_proj": 8}}, "alpha_pattern"),
        ({"bias": "all"}, "bias != 'none'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"peft_type": "IA3"}, "peft_type 'LORA'"),
    ]):
        refused(_adapter(str(tmp_path / f"feature_{i}"), config, tensors, **change), needle)
    # A target module the family does not have, and a layer it does not have.
    refused(_adapter(str(tmp_path / "target"), config, tensors, target_modules=SEVEN + ["gate_up_proj"]),
            "'gate_up_proj', which this model does not have")
    extra = dict(tensors)
    extra["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = tensors[q_a]
    refused(_adapter(str(tmp_path / "layer"), config, extra), "layers.7.self_attn.q_proj", "has no module")
    # Another architecture: the qwen3 adapter (head_dim 16) on llama.
    refused(cases["qwen3"][1], "q_proj.lora_B.weight: expected shape (64, 4), received (128, 4)")
    # Another rank than the config's, and a factor missing.
    refused(_adapter(str(tmp_path / "rank"), config, tensors, r=8), f"{q_a}: expected shape (8, 64), received (4, 64)")
    refused(_adapter(str(tmp_path / "half"), config, tensors, drop=(q_a,)), "only lora_B")
    refused(str(tmp_path / "nowhere"), "does not exist")


def test_bad_saves(root, tmp_path):
    _, cases = root
    hf, adapter, _ = cases["qwen3"]
    backbone = keras_hub_dist.load_sharded_preset(hf, mesh=(1, 8), progress=False)
    with pytest.raises(SaveError, match="no LoRA-enabled layer"):
        keras_hub_dist.save_lora_adapter(backbone, str(tmp_path / "a"))
    with pytest.raises(SaveError, match="huggingface-cli upload"):  # buckets: test_lora_remote.py
        keras_hub_dist.save_lora_adapter(backbone, "hf://owner/adapter")
    with pytest.raises(ValueError, match="'w_proj', which this model does not have"):
        keras_hub_dist.enable_lora(backbone, rank=2, target_modules=["q_proj", "w_proj"])
    keras_hub_dist.enable_lora(backbone, rank=2, target_modules=["q_proj"])
    layer = next(l for l in backbone._flatten_layers() if l.path == "transformer_layer_0/self_attention/value")
    layer.enable_lora(4, lora_alpha=2)  # another scale than the others' (1)
    with pytest.raises(SaveError, match="scale their updates differently"):
        keras_hub_dist.save_lora_adapter(backbone, str(tmp_path / "b"))
    assert not os.path.exists(tmp_path / "b")


def test_adapter_from_the_hub(root, tmp_path, monkeypatch):
    """`hf://owner/name`: the adapter read by byte ranges from a Hub (a
    loopback stand-in), as PEFT computes."""
    from remote import hub, servers

    _, cases = root
    hf, adapter, expected = cases["qwen3"]
    with servers.RangeServer() as server:
        hub.patch_huggingface_hub(monkeypatch, server.url, str(tmp_path / "hf-cache"))
        server.add_hub_repo("someone/qwen3-lora", {rel: path for path, rel in servers.walk_files(adapter)})
        backbone = keras_hub_dist.load_sharded_preset(
            hf, mesh=(2, 4), progress=False, lora_adapter="hf://someone/qwen3-lora")
    _assert_close(_logits(_causal_lm(backbone)), expected, "qwen3", root)


def test_verify_checks_the_adapter_too(root, tmp_path, clean_state):
    """`verify=True` checks a saved adapter against its own checksums: a
    flipped byte is named, and a PEFT adapter (no checksums) is refused."""
    _, cases = root
    hf, adapter, _ = cases["llama"]
    base = str(tmp_path / "base")
    keras_hub_dist.save_sharded_preset(
        keras_hub_dist.load_sharded_preset(hf, mesh=(1, 8), progress=False), base, format="huggingface")
    first = keras_hub_dist.load_sharded_preset(hf, mesh=(1, 8), progress=False, lora_adapter=adapter)
    saved = str(tmp_path / "saved")
    keras_hub_dist.save_lora_adapter(first, saved, progress=False)
    again = keras_hub_dist.load_sharded_preset(base, mesh=(2, 4), progress=False, lora_adapter=saved, verify=True)
    assert {p: np.asarray(v.value).tobytes() for p, v in _lora_variables(again).items()} == {
        p: np.asarray(v.value).tobytes() for p, v in _lora_variables(first).items()}
    keras.distribution.set_distribution(None)  # the loads above set one
    with clean_state(), pytest.raises(PresetError, match="save_pretrained` writes none"):
        keras_hub_dist.load_sharded_preset(base, mesh=(2, 4), progress=False, lora_adapter=adapter, verify=True)
    weights = os.path.join(saved, "adapter_model.safetensors")
    with open(weights, "r+b") as f:
        f.seek(os.path.getsize(weights) - 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    with clean_state(), pytest.raises(PresetError, match="adapter_model.safetensors"):
        keras_hub_dist.load_sharded_preset(base, mesh=(2, 4), progress=False, lora_adapter=saved, verify=True)


def test_the_default_targets_are_the_projections_the_model_has():
    # gpt-oss has no gate / up / down projections (its experts are stacked
    # banks): by default only its attention projections are adapted, in a
    # plan as in a real run.
    from keras_hub_dist.adapters import enable_lora_without_values
    from keras_hub_dist.jobs.abstract_job import abstract_job

    cls, config, _ = keras_hub_dist.presets.backbone_config("gpt_oss_20b_en", num_layers=1)
    job = abstract_job(cls, config, (1, 8), lora_rank=4)
    adapted = {v.path.rsplit("/", 2)[-2] for v in job.task.trainable_variables if "lora" in v.path}
    assert adapted and all(p.endswith(("query", "key", "value", "attention_output")) for p in adapted), adapted
    # Named explicitly, a projection it does not have is still refused.
    task = abstract_job(cls, config, (1, 8)).task
    with pytest.raises(ValueError, match="'gate_proj', which this model does not have"):
        enable_lora_without_values(task, 4, target_modules=("q_proj", "gate_proj"))
