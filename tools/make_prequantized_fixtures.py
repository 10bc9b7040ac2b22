"""Regenerates tests/data/prequantized/: tiny pre-quantized Llama checkpoints
written by the real writers, and their writers' readers' logits.

Not part of the package and not run by the suite: the suite reads the files
this writes (config.json, model.safetensors, reference_logits.npy per
fixture) and needs none of these installs. Run it in a separate venv, never
in the package's own (CI must not need the writers):

    python3 -m venv /tmp/fixture-venv
    # reuse the package venv's CPU torch 2.13.0 (and accelerate) underneath:
    echo /work/main/.venv/lib/python3.11/site-packages > \\
        /tmp/fixture-venv/lib/python3.11/site-packages/zz_main_venv.pth
    /tmp/fixture-venv/bin/pip install "llmcompressor==0.14.*"
    # gives llmcompressor 0.14.0.1, compressed-tensors 0.19.0,
    # transformers 5.17.0 (over the package venv's 5.24.0), torch 2.13.0+cpu
    /tmp/fixture-venv/bin/python tools/make_prequantized_fixtures.py \
        ct_w4a16 ct_w4a16_asym ct_fp8_dynamic ct_fp8_block fp8_native

    # gptqmodel in a venv of its own (it installs torch 2.14.1 and CUDA
    # wheels; about 3 minutes; its kernels run on CPU in float16 only):
    python3 -m venv /tmp/fixture-venv-gptq
    echo /work/main/.venv/lib/python3.11/site-packages > \
        /tmp/fixture-venv-gptq/lib/python3.11/site-packages/zz_main_venv.pth
    GPTQMODEL_CPU_WORKERS=2 /tmp/fixture-venv-gptq/bin/pip install gptqmodel
    # gives gptqmodel 7.7.0, torch 2.14.1, transformers 5.24.0 (the package's)
    GPTQMODEL_CPU_WORKERS=2 /tmp/fixture-venv-gptq/bin/python \
        tools/make_prequantized_fixtures.py gptq gptq_desc_act awq_gemm

The tiny model: Llama, hidden 256, 2 query heads and 1 key/value head of
128, MLP 256, one layer, vocabulary 64, RMS epsilon 1e-6 (KerasHub's
Llama converter keeps its own 1e-6 whatever config.json says), float32 (so
the writers' scales are float32 and their readers dequantize in float32),
untied lm_head (left unquantized by every recipe, as `ignore: ["lm_head"]`).

Fixtures (one directory each):
- `ct_w4a16`, `ct_w4a16_asym`: compressed-tensors `pack-quantized`, groups
  of 128 (`QuantizationModifier`, schemes W4A16 / W4A16_ASYM);
- `ct_fp8_dynamic`: compressed-tensors `float-quantized`, per-channel scales
  (FP8_DYNAMIC);
- `ct_fp8_block`: compressed-tensors `float-quantized`, 128 x 128 blocks
  (FP8_BLOCK);
- `fp8_native`: transformers' `FineGrainedFP8Config(weight_block_size=(128,
  128))` (`quant_method: "fp8"`, `weight_scale_inv`), quantized on CPU
  (`validate_environment` refuses CPU; the quantization itself runs there);
- `gptq`, `gptq_desc_act`: gptqmodel `GPTQConfig(bits=4, group_size=128,
  sym=False, desc_act=False / True)` on 32 random calibration sequences
  (`format: gptq`: `qzeros` store z - 1; act-order `g_idx`);
- `awq_gemm`: gptqmodel `AWQConfig(bits=4, group_size=128, sym=False)`
  (`version: gemm`), on the model in float16 (its AWQ modules take no
  float32).

`reference_logits.npy`: float32 logits of `TOKEN_IDS` from
`AutoModelForCausalLM.from_pretrained(fixture, dtype=torch.float32)` (which
decompresses on CPU), i.e. the writer's own reader; for compressed-tensors
with its activation fake-quantization turned off after decompressing
(`disable_quantization`: keras_hub_dist loads weight-only, activations in
the compute dtype); for gptqmodel's, the weights its own modules decode
(`dequantize_weight`, `dequantize_gemm`) with float32 scales in a float32
Transformers forward (its kernels compute in float16 only).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.normpath(os.path.join(HERE, "..", "tests", "data", "prequantized"))
TOKEN_IDS = [[1, 5, 17, 33, 2, 60, 7, 9]]
KEEP = ("config.json", "model.safetensors")


def base_model(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=128,
        max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-6,
        initializer_range=0.05, bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path)
    # gptqmodel loads a tokenizer with the model (not kept in the fixtures).
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(64)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2", pad_token="t3"
    ).save_pretrained(path)


def reference_logits(path: str, quantization_config=None) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    kwargs = {} if quantization_config is None else {"quantization_config": quantization_config}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    model.eval()
    if getattr(model.config, "quantization_config", None) is not None and quantization_config is None:
        # compressed-tensors' reader also fake-quantizes the activations of
        # FP8_DYNAMIC / FP8_BLOCK (W8A8 emulated); keras_hub_dist loads the
        # weights into a float model (W8A16): the reference is the reader's
        # decompressed weights with its activation quantization off.
        from compressed_tensors.quantization import disable_quantization

        with torch.no_grad():
            model(torch.tensor(TOKEN_IDS))  # decompresses the weights
        model.apply(disable_quantization)
    with torch.no_grad():
        logits = model(torch.tensor(TOKEN_IDS)).logits
    return logits.float().numpy()


def keep_only(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for name in KEEP:
        shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    # The writer's build's own keys, not the model's: dropped for stable files.
    config.pop("transformers_version", None)
    # gptqmodel records its temporary directory: not the model's either.
    config.get("quantization_config", {}).get("meta", {}).pop("offload_to_disk_path", None)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def compressed_tensors(base: str, scheme: str, out: str) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    oneshot(model=model, recipe=recipe)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, save_compressed=True)
        keep_only(tmp, out)


def native_fp8(base: str, out: str) -> None:
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.quantizers import quantizer_finegrained_fp8

    # Refuses CPU; quantizing runs on CPU all the same.
    quantizer_finegrained_fp8.FineGrainedFP8HfQuantizer.validate_environment = lambda self, *a, **k: None
    config = FineGrainedFP8Config(weight_block_size=(128, 128))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, quantization_config=config)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        keep_only(tmp, out)


def _calibration() -> list[dict[str, list[int]]]:
    rng = np.random.default_rng(0)
    return [{"input_ids": ids, "attention_mask": [1] * len(ids)}
            for ids in rng.integers(3, 64, size=(32, 32)).tolist()]


def gptqmodel_fixture(base: str, out: str, method: str, desc_act: bool = False) -> None:
    from gptqmodel import GPTQModel
    from gptqmodel.quantization.config import AWQConfig, GPTQConfig

    if method == "awq":
        config = AWQConfig(bits=4, group_size=128, sym=False)
    else:
        config = GPTQConfig(bits=4, group_size=128, desc_act=desc_act, sym=False)
    # gptqmodel's AWQ modules take float16 / bfloat16 models only.
    model = GPTQModel.load(base, config, dtype=torch.float16 if method == "awq" else torch.float32)
    model.quantize(_calibration(), batch_size=1)
    with tempfile.TemporaryDirectory() as tmp:
        model.save(tmp)
        keep_only(tmp, out)


FIXTURES = {
    # gptqmodel 7.7 (its own venv: it installs torch 2.14.1), see below.
    "gptq": lambda base, out: gptqmodel_fixture(base, out, "gptq", desc_act=False),
    "gptq_desc_act": lambda base, out: gptqmodel_fixture(base, out, "gptq", desc_act=True),
    "awq_gemm": lambda base, out: gptqmodel_fixture(base, out, "awq"),
    "ct_w4a16": lambda base, out: compressed_tensors(base, "W4A16", out),
    "ct_w4a16_asym": lambda base, out: compressed_tensors(base, "W4A16_ASYM", out),
    "ct_fp8_dynamic": lambda base, out: compressed_tensors(base, "FP8_DYNAMIC", out),
    "ct_fp8_block": lambda base, out: compressed_tensors(base, "FP8_BLOCK", out),
    "fp8_native": native_fp8,
}


def gptqmodel_reference(path: str, base: str) -> np.ndarray:
    """Logits with the weights gptqmodel's own reader decodes (its torch
    modules' `dequantize_weight` / AWQ's `dequantize_gemm`: unpacking, zero
    offsets, g_idx), in float32: its kernels run in float16 / bfloat16 only,
    so the decoded codes meet float32 scales and a float32 Transformers
    forward, as keras_hub_dist's float32 load computes them."""
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(path, tmp, dirs_exist_ok=True)
        for name in os.listdir(base):
            if name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(os.path.join(base, name), tmp)
        quantized = GPTQModel.load(tmp, backend=BACKEND.TORCH, device="cpu", dtype=torch.float16)
    weights = {}
    for name, module in quantized.model.named_modules():
        if not hasattr(module, "qweight"):
            continue
        module.scales = module.scales.float()
        if hasattr(module, "dequantize_weight"):
            weight = module.dequantize_weight()
        else:
            weight = dequantize_gemm(module.qweight, module.qzeros, module.scales, module.bits, module.group_size)
        assert weight.dtype == torch.float32, weight.dtype
        weights[name + ".weight"] = weight.T.contiguous()
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config")
    model = LlamaForCausalLM(LlamaConfig(**config)).float().eval()
    stored = {k: v.float() for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
    state = {k: stored.get(k, weights.get(k)) for k in model.state_dict()}
    model.load_state_dict(state)
    with torch.no_grad():
        return model(torch.tensor(TOKEN_IDS)).logits.float().numpy()


def reference_for(name: str, path: str, base: str = "") -> np.ndarray:
    if name.startswith(("gptq", "awq")):
        return gptqmodel_reference(path, base)
    if name == "fp8_native":
        from transformers import FineGrainedFP8Config
        from transformers.quantizers import quantizer_finegrained_fp8

        quantizer_finegrained_fp8.FineGrainedFP8HfQuantizer.validate_environment = lambda self, *a, **k: None
        # On CPU the reader dequantizes the e4m3 blocks into the model dtype.
        return reference_logits(path, FineGrainedFP8Config(weight_block_size=(128, 128), dequantize=True))
    return reference_logits(path)


def main(names: list[str]) -> None:
    names = names or list(FIXTURES)
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # gptqmodel writes its logs/ under the working directory
        base = os.path.join(tmp, "base")
        base_model(base)
        for name in names:
            out = os.path.join(OUT, name)
            shutil.rmtree(out, ignore_errors=True)
            FIXTURES[name](base, out)
            logits = reference_for(name, out, base)
            np.save(os.path.join(out, "reference_logits.npy"), logits.astype(np.float32))
            print(name, logits.shape, float(np.abs(logits).max()))
    with open(os.path.join(OUT, "token_ids.json"), "w") as f:
        json.dump(TOKEN_IDS, f)


if __name__ == "__main__":
    main(sys.argv[1:])
