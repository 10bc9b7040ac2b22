"""Transformers itself reads what `save_sharded_preset(..., format="huggingface")`
writes: `AutoModelForCausalLM.from_pretrained` (torch, CPU) gives the Keras
model's logits within 1e-4 (float32) for every family that exports,
including those KerasHub cannot export, and `AutoTokenizer` loads the
tokenizer files of a task.

The only module that needs torch and transformers (the `test` extra installs
the CPU wheel of torch); tiny models, one forward pass each.
"""

import os

import keras
import keras_hub
import numpy as np
import pytest
from conftest import jitted_outputs, lazy_import

from keras_hub_dist import load_sharded_preset, save_sharded_preset, write_synthetic_preset
from tests.formats.hf import dense, moe, recent
from tests.formats.hf.writer import write_hf_checkpoint

torch = lazy_import("torch")
transformers = lazy_import("transformers")

pytestmark = pytest.mark.usefixtures("short_delta_chunks")

MODULES = {case: module for module in (dense, moe, recent) for case in module.CASES}
# gemma: 2 K/V heads and heads x head_dim != hidden (where stock's map is wrong).
CASES = [
    "gemma", "gemma2", "gemma3_text", "gemma4_text", "llama", "mistral", "qwen2", "qwen3_5",
    "qwen3", "qwen3_moe", "mixtral", "gpt_oss", "smollm3", "gpt2",
]
TOKENS = np.array([[3, 17, 5, 99, 42, 7, 64, 1]], "int32")


def _causal_lm(backbone):
    cls = next(
        c for c in vars(keras_hub.models).values()
        if isinstance(c, type) and issubclass(c, keras_hub.models.CausalLM)
        and getattr(c, "backbone_cls", None) is type(backbone) and "Assistant" not in c.__name__
    )
    return cls(backbone=backbone, preprocessor=None)


def _model(case, tmp_path):
    if case == "gpt2":
        keras.utils.set_random_seed(0)
        return keras_hub.models.GPT2Backbone(
            vocabulary_size=128, num_layers=2, num_heads=4, hidden_dim=64, intermediate_dim=128,
            max_sequence_length=32)
    config, tensors = MODULES[case].hf_checkpoint(case, tied=case in ("llama", "qwen3"), dtype="float32")
    if case == "qwen3_5":  # the text model: the tower needs media inputs
        config = {k: v for k, v in config.items() if k != "vision_config"}
        tensors = {k: v for k, v in tensors.items() if "visual" not in k}
    if case == "gpt_oss":
        # KerasHub attends window + 1 positions, Transformers window (README).
        config["sliding_window"] = 64
    return keras_hub.models.Backbone.from_preset(write_hf_checkpoint(str(tmp_path / "src"), config, tensors))


def _keras_logits(lm):
    inputs = {"token_ids": TOKENS, "padding_mask": np.ones_like(TOKENS)}
    if "position_ids" in {t.name for t in lm.backbone.inputs}:
        inputs["position_ids"] = np.arange(TOKENS.shape[1], dtype="int32")[None]
    return np.asarray(jitted_outputs(lm, inputs))


@pytest.mark.parametrize("case", CASES)
def test_transformers_gives_the_keras_logits(case, tmp_path):
    lm = _causal_lm(_model(case, tmp_path))
    expected = _keras_logits(lm)
    save_sharded_preset(lm, str(tmp_path / "out"), format="huggingface", progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    assert logits.shape == expected.shape
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4)


def _sentencepiece_tokenizer(cls):
    """A tiny BPE SentencePiece tokenizer of `cls` (Transformers converts BPE
    and unigram models, not the word model of the synthetic presets), with
    no dummy prefix, as Gemma's."""
    import io

    import sentencepiece

    special = sorted(set(cls(proto=None).special_tokens) - {"<unk>"})
    words = "the quick brown fox jumps over the lazy dog a of to and in is it that was".split()
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([" ".join(words[i:] + words[:i]) for i in range(len(words))]),
        model_writer=model, vocab_size=80, model_type="bpe", unk_id=0, bos_id=-1, eos_id=-1,
        pad_id=-1, user_defined_symbols=special, hard_vocab_limit=False, minloglevel=2,
        add_dummy_prefix=False,
    )
    return cls(proto=model.getvalue())


@pytest.mark.parametrize("family", ["llama3", "qwen3", "gemma", "mixtral"])
def test_tokenizer_files_load_in_transformers(family, tmp_path):
    """Byte-pair (Llama 3, Qwen 3 as Qwen 2's) and SentencePiece (Gemma,
    Mixtral as Mistral's) tokenizers: Transformers encodes as KerasHub does."""
    cls, extra = {
        "llama3": (keras_hub.models.Llama3Backbone, {}),
        "qwen3": (keras_hub.models.Qwen3Backbone, {"head_dim": 8}),
        "gemma": (keras_hub.models.GemmaBackbone, {"head_dim": 8}),
        "mixtral": (keras_hub.models.MixtralBackbone, {"num_experts": 2, "top_k": 1}),
    }[family]
    byte_pair = family in ("llama3", "qwen3")
    path = write_synthetic_preset(
        str(tmp_path / "src"), cls, dtype="float32", tokenizer=byte_pair, vocabulary_size=320,
        num_layers=1, num_query_heads=4, num_key_value_heads=2, hidden_dim=32, intermediate_dim=64, **extra)
    if byte_pair:
        lm = load_sharded_preset(path, mesh=(1, 8), task="causal_lm", progress=False)
    else:
        backbone = load_sharded_preset(path, mesh=(1, 8), progress=False)
        task = _causal_lm(backbone)
        tokenizer = _sentencepiece_tokenizer(type(task).preprocessor_cls.tokenizer_cls)
        lm = type(task)(backbone=backbone, preprocessor=type(task).preprocessor_cls(tokenizer))
    save_sharded_preset(lm, str(tmp_path / "out"), format="huggingface", progress=False)
    assert "tokenizer_config.json" in os.listdir(tmp_path / "out")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    text = "the quick brown fox jumps over the lazy dog"
    ours = [int(i) for i in np.asarray(lm.preprocessor.tokenizer(text))]
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == ours
