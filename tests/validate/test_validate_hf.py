"""Tests of `keras-hub-dist validate` with Hugging Face checkpoints.

`--preset DIR` where DIR is a Transformers checkpoint (config.json with
`model_type` + safetensors), and `--checkpoint_format huggingface`, which
makes the load phase write its synthetic checkpoint in that format.
"""

import importlib.util
import json
import os
import signal
import subprocess
import types

import keras_hub
import pytest

from keras_hub_dist.formats.synthetic_hf import write_synthetic_hf_checkpoint
from keras_hub_dist.cli import main as cli
from keras_hub_dist.validate import options as _options
from keras_hub_dist.validate import report as _report_mod
from keras_hub_dist.validate import runner as _runner
from keras_hub_dist.validate import schema as _schema
from keras_hub_dist.validate import worker as _validate_worker
from tests import worker_zygote

KIB = 1024

# A Gemma small enough to write, build and load in a second; one KV head (as
# gemma_2b_en), 8 query heads so every mesh divides them.
TINY_HF_GEMMA = {
    "vocabulary_size": 256,
    "num_layers": 1,
    "num_query_heads": 8,
    "num_key_value_heads": 1,
    "hidden_dim": 64,
    "intermediate_dim": 256,
    "head_dim": 16,
}


def _override_flags(config):
    """`--num_layers N --override KEY=VALUE ...` shrinking a named architecture."""
    flags = ["--num_layers", str(config["num_layers"])]
    for key, value in config.items():
        if key != "num_layers":
            flags += ["--override", f"{key}={json.dumps(value)}"]
    return flags


def _forked_run(cmd, env, stdout, stderr, timeout, check):
    """`subprocess.run` of a case process (`python -m MODULE SPEC RESULT`),
    forked from the suite's worker zygote (tests/worker_zygote.py) instead
    of started afresh: still a fresh process for JAX (its own backend,
    device count and memory figures), without the ~3 CPU-s of imports."""
    python, flag, module, *args = cmd
    assert flag == "-m", cmd
    proc = worker_zygote.spawn([python, importlib.util.find_spec(module).origin, *args], env=env)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    stdout.write(proc.stderr.read().encode())  # the case's log, as the runner keeps it
    return subprocess.CompletedProcess(cmd, proc.returncode)


def _run_cli(args, capsys, monkeypatch):
    """`keras-hub-dist validate ARGS` in this process, each case in its own
    forked process. The command's real start (`python -m
    keras_hub_dist.cli.main`, fresh case processes) is run end to end by
    tests/validate/test_validate.py::test_cli_end_to_end_budget_json_and_plot."""
    forked = types.SimpleNamespace(
        run=_forked_run, STDOUT=subprocess.STDOUT, TimeoutExpired=subprocess.TimeoutExpired
    )
    monkeypatch.setattr(_runner, "subprocess", forked)
    capsys.readouterr()
    code = cli.main(["validate", *args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf") / "tiny_gemma_hf")
    write_synthetic_hf_checkpoint(
        path, keras_hub.models.GemmaBackbone, TINY_HF_GEMMA, dtype="bfloat16", progress=False
    )
    return path


# -- options and flags ------------------------------------------------------------


def test_checkpoint_format_flag_maps_to_options():
    parser = cli.build_parser()
    assert cli.options_from_args(parser.parse_args(["validate"])).checkpoint_format == "keras"
    for flag in ("--checkpoint_format", "--checkpoint-format"):
        args = parser.parse_args(["validate", "--preset", "llama3_8b_en", flag, "huggingface"])
        assert cli.options_from_args(args).checkpoint_format == "huggingface"
    with pytest.raises(SystemExit):
        parser.parse_args(["validate", "--checkpoint_format", "gguf"])
    with pytest.raises(ValueError, match="Expected --checkpoint_format among"):
        _options.ValidateOptions(checkpoint_format="gguf")
    # The absl script's call (no checkpoint_format) keeps the default.
    options = _options.ValidateOptions.from_flags(mesh="1x8", phases="load", override=None)
    assert options.checkpoint_format == "keras"


def test_preset_cache_key_holds_the_format(tmp_path):
    cache = str(tmp_path / "cache")
    keras_dir = _runner._preset_cache_dir(
        _options.ValidateOptions(num_layers=1, preset_cache=cache), ""
    )
    hf_dir = _runner._preset_cache_dir(
        _options.ValidateOptions(num_layers=1, preset_cache=cache, checkpoint_format="huggingface"),
        "",
    )
    assert keras_dir != hf_dir
    assert os.path.basename(hf_dir).startswith("gemma_7b_en-hf-")
    # Without a cache the run's own temporary directory is used, either format.
    options = _options.ValidateOptions(checkpoint_format="huggingface")
    assert _runner._preset_cache_dir(options, "/w") == "/w/synthetic_preset"


def test_hf_synthetic_cache_is_reused_with_its_format(tmp_path, monkeypatch):
    specs = []

    def fake_worker(spec, workdir, label, env, options):
        specs.append(spec)
        os.makedirs(spec["out_dir"])
        with open(os.path.join(spec["out_dir"], "config.json"), "w") as f:
            f.write('{"model_type": "gemma"}')
        return {"ok": True, "preset_dir": spec["out_dir"], "writer": "fake",
                "bytes_on_disk": 2, "wall_s": 0.1}

    monkeypatch.setattr(_runner, "_run_worker", fake_worker)
    options = _options.ValidateOptions(
        preset="gemma_2b_en", num_layers=1, preset_cache=str(tmp_path / "cache"),
        checkpoint_format="huggingface",
    )
    args = (options, {"dtype": None}, str(tmp_path), {}, lambda _m: None)
    first, info = _runner._prepare_preset(*args)
    assert info["format"] == "huggingface" and info["writer"] == "fake"
    # gemma_2b_en's own dtype, checked in the parent, travels to the writer.
    assert specs[0]["checkpoint_dtype"] == "bfloat16"
    again, info = _runner._prepare_preset(*args)
    assert again == first and (info["format"], info["writer"]) == ("huggingface", "reused")
    assert len(specs) == 1
    # The KerasHub preset of the same architecture is another directory.
    keras_options = _options.ValidateOptions(
        preset="gemma_2b_en", num_layers=1, preset_cache=str(tmp_path / "cache")
    )
    other, info = _runner._prepare_preset(keras_options, {}, str(tmp_path), {}, lambda _m: None)
    assert other != first and info["format"] == "keras" and len(specs) == 2


def test_hf_checkpoint_dtype_is_checked():
    assert _validate_worker.hf_checkpoint_dtype("GemmaBackbone", None, "x") == "float32"
    assert _validate_worker.hf_checkpoint_dtype("Llama3Backbone", "float16", "x") == "float16"
    with pytest.raises(ValueError, match=r"Expected --dtype .* among them\. Received: 'int8'"):
        _validate_worker.hf_checkpoint_dtype("GemmaBackbone", "int8", "x")
    # `--dtype` wins over the architecture's own (bfloat16 for gemma_2b_en).
    options = _options.ValidateOptions(
        preset="gemma_2b_en", dtype="float32", checkpoint_format="huggingface"
    )
    assert _runner._hf_checkpoint_dtype(options) == "float32"
    options = _options.ValidateOptions(
        preset="gemma_2b_en", overrides={"dtype": "float16"}, checkpoint_format="huggingface"
    )
    assert _runner._hf_checkpoint_dtype(options) == "float16"


def test_checkpoint_format_huggingface_without_hf_layout_is_a_clear_error(capsys):
    # Qwen 3.5 has no Hugging Face layout in `formats.synthetic_hf`: refused
    # before any process starts, with exit status 2 (bad flags).
    code = cli.main(
        ["validate", "--preset", "qwen3_5_4b", "--num_layers", "1", "--phases", "load",
         "--checkpoint_format", "huggingface", "--quiet"]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "keras-hub-dist validate: error: --checkpoint_format huggingface cannot write" in err
    assert "no Hugging Face layout for its backbone class Qwen3_5Backbone" in err
    assert "Expected an architecture whose class is one of" in err
    assert "Received: --preset qwen3_5_4b (Qwen3_5Backbone)" in err
    assert "Use --checkpoint_format keras" in err
    assert "Traceback" not in err


def test_hf_layout_that_changes_the_weights_is_a_clear_error(tmp_path):
    # Gemma 2's HF layout (model_type "gemma2") has both the post-attention
    # and the post-FFW norms; a GemmaBackbone with only the latter is written
    # in Gemma's, which would read back without it.
    overrides = {**TINY_HF_GEMMA, "num_key_value_heads": 8, "use_post_attention_norm": False}
    with pytest.raises(ValueError, match="cannot write 'gemma2_2b_en' faithfully") as info:
        _validate_worker.run_task(
            {"task": "write_preset", "preset": "gemma2_2b_en", "overrides": overrides,
             "dtype": None, "out_dir": str(tmp_path / "out"), "checkpoint_format": "huggingface"}
        )
    message = str(info.value)
    assert "use_post_ffw_norm=True reads back as False" in message
    assert "Received: --preset gemma2_2b_en (GemmaBackbone)" in message
    assert "Use --checkpoint_format keras" in message
    assert not os.path.exists(tmp_path / "out")  # refused before writing


def test_worker_failure_on_bad_input_is_a_value_error_in_the_parent(tmp_path, monkeypatch):
    def fake_worker(spec, workdir, label, env, options):
        return {"ok": False, "error": "ValueError: no good", "input_error": True,
                "log_tail": "Traceback ..."}

    monkeypatch.setattr(_runner, "_run_worker", fake_worker)
    options = _options.ValidateOptions(
        preset="gemma_2b_en", num_layers=1, checkpoint_format="huggingface"
    )
    with pytest.raises(ValueError, match="Could not write a synthetic Hugging Face checkpoint "
                       "of 'gemma_2b_en': ValueError: no good$"):
        _runner._prepare_preset(options, {}, str(tmp_path), {}, lambda _m: None)


def test_checkpoint_format_huggingface_with_a_keras_preset_dir_is_refused(tmp_path):
    # Only config.json decides the format: a KerasHub one has registered_name.
    path = tmp_path / "keras_preset"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "module": "keras_hub.src.models.gemma.gemma_backbone", "class_name": "GemmaBackbone",
        "config": TINY_HF_GEMMA, "registered_name": "keras_hub>GemmaBackbone",
    }))
    path = str(path)
    options = _options.ValidateOptions(
        preset=path, phases=("load",), checkpoint_format="huggingface"
    )
    with pytest.raises(ValueError, match="a preset directory is\\s+read in its own format"):
        _runner._prepare_preset(options, {}, str(tmp_path), {}, lambda _m: None)


def test_hf_dir_with_checkpoint_format_huggingface_is_read_as_is(tiny_hf_dir, tmp_path):
    options = _options.ValidateOptions(
        preset=tiny_hf_dir, phases=("load",), checkpoint_format="huggingface"
    )
    assert _runner._prepare_preset(options, {}, str(tmp_path), {}, lambda _m: None) == (
        os.path.abspath(tiny_hf_dir), None
    )


# -- the worker, in this process ---------------------------------------------------


def test_resolve_architecture_of_an_hf_dir(tiny_hf_dir):
    cls, config, source = _validate_worker.resolve_architecture(tiny_hf_dir, {}, None)
    assert cls is keras_hub.models.GemmaBackbone
    assert {k: config[k] for k in TINY_HF_GEMMA} == TINY_HF_GEMMA
    assert config["dtype"] == "bfloat16"  # the checkpoint's own torch_dtype
    assert source == {
        "kind": "hf_dir", "path": os.path.abspath(tiny_hf_dir), "model_type": "gemma",
        "torch_dtype": "bfloat16",
    }
    serialized = _validate_worker.serialized_config(cls, config)
    assert serialized["class_name"] == "GemmaBackbone"
    # --dtype and overrides (the init phase) replace the checkpoint's.
    _, config, _ = _validate_worker.resolve_architecture(tiny_hf_dir, {"num_layers": 2}, "float32")
    assert config["dtype"] == "float32" and config["num_layers"] == 2


def test_worker_init_from_an_hf_dir(tiny_hf_dir):
    result = _validate_worker.run_task(
        {"task": "measure", "case": "ours", "phase": "init", "preset": tiny_hf_dir,
         "mesh": [1, 8], "interval_s": 0.05}  # no peak asserted: few samples
    )
    assert result["ok"] and result["architecture"]["kind"] == "hf_dir"
    assert result["backbone_class"] == "GemmaBackbone"
    assert result["weight_dtypes"] == ["bfloat16"]


def test_worker_writes_a_synthetic_hf_checkpoint_of_llama(tmp_path):
    out_dir = str(tmp_path / "llama_hf")
    overrides = {"vocabulary_size": 256, "num_layers": 1, "num_query_heads": 8,
                 "num_key_value_heads": 2, "hidden_dim": 64, "intermediate_dim": 128}
    result = _validate_worker.run_task(
        {"task": "write_preset", "preset": "llama3_8b_en", "overrides": overrides,
         "dtype": "float16", "out_dir": out_dir, "checkpoint_format": "huggingface"}
    )
    assert result["ok"] and result["format"] == "huggingface"
    assert result["writer"].endswith("write_synthetic_hf_checkpoint")
    assert set(os.listdir(out_dir)) == {"config.json", "model.safetensors"}
    with open(os.path.join(out_dir, "config.json")) as f:
        hf_config = json.load(f)
    assert hf_config["model_type"] == "llama" and hf_config["torch_dtype"] == "float16"
    assert hf_config["num_hidden_layers"] == 1 and hf_config["vocab_size"] == 256
    cls, config, source = _validate_worker.resolve_architecture(out_dir, {}, None)
    assert cls.__name__ in ("LlamaBackbone", "Llama3Backbone")
    assert source["kind"] == "hf_dir" and config["dtype"] == "float16"
    # KerasHub's Llama converter ignores rms_norm_eps: same weights, recorded.
    assert result["config_differences"] == ["layer_norm_epsilon=1e-05 reads back as 1e-06"]


# -- the command, end to end (forked case processes) --------------------------------


def _check_load_figures(report, cases=("ours", "stock")):
    _schema.check_report(report)
    assert [(c["phase"], c["case"], c["ok"]) for c in report["cases"]] == [
        ("load", case, True) for case in cases
    ]
    for c in report["cases"]:
        assert set(c["peak_per_device"]) == {str(i) for i in range(8)}
        assert c["weight_dtypes"] == ["bfloat16"]
        assert c["architecture"]["kind"] == "hf_dir"
        for d, peak in c["peak_per_device"].items():
            assert peak >= c["final_per_device"][d] >= c["weights_per_device"][d] > 0
    ours = report["cases"][0]
    for d, peak in ours["peak_per_device"].items():
        assert peak / ours["final_per_device"][d] <= 1.05, (d, peak)
    (row,) = report["comparisons"]
    assert row["phase"] == "load" and row["ours_peak_over_final"] <= 1.05
    assert report["model"]["architecture"]["kind"] == "hf_dir"
    assert report["model"]["architecture"]["model_type"] == "gemma"
    assert report["model"]["backbone_class"] == "GemmaBackbone"


def test_cli_validates_an_hf_checkpoint_dir(tmp_path, tiny_hf_dir, capsys, monkeypatch):
    json_path = tmp_path / "report.json"
    proc = _run_cli(
        ["--preset", tiny_hf_dir, "--mesh", "1x8", "--phases", "load", "--json", str(json_path)],
        capsys, monkeypatch,
    )
    assert proc.returncode == _schema.EXIT_OK, proc.stdout + proc.stderr
    assert "[Hugging Face checkpoint, model_type=gemma]" in proc.stdout
    report = json.loads(json_path.read_text())
    _check_load_figures(report)
    assert report["synthetic_preset"] is None  # a checkpoint directory was given
    assert report["model"]["architecture"]["path"] == os.path.abspath(tiny_hf_dir)
    ours, stock = report["cases"]
    assert ours["model_bytes"] == stock["model_bytes"] == report["model"]["model_bytes"]
    assert report["comparisons"][0]["stock_peak_max"] is not None
    assert "stock/ours peak" in _report_mod.format_report(report)


def test_cli_checkpoint_format_huggingface_writes_and_loads_hf(tmp_path, capsys, monkeypatch):
    json_path, cache = tmp_path / "report.json", tmp_path / "cache"
    proc = _run_cli(
        ["--preset", "gemma_2b_en", *_override_flags(TINY_HF_GEMMA), "--mesh", "1x8",
         "--phases", "load", "--checkpoint_format", "huggingface", "--no-baseline",
         "--preset_cache", str(cache), "--json", str(json_path)],
        capsys, monkeypatch,
    )
    assert proc.returncode == _schema.EXIT_OK, proc.stdout + proc.stderr
    assert "synthetic Hugging Face checkpoint" in proc.stderr
    report = json.loads(json_path.read_text())
    _check_load_figures(report, cases=("ours",))
    assert report["options"]["checkpoint_format"] == "huggingface"
    synthetic = report["synthetic_preset"]
    assert synthetic["format"] == "huggingface"
    assert synthetic["writer"].endswith("write_synthetic_hf_checkpoint")
    (written,) = os.listdir(cache)
    assert written.startswith("gemma_2b_en-hf-")
    assert synthetic["preset_dir"] == str(cache / written)
    with open(cache / written / "config.json") as f:
        hf_config = json.load(f)
    assert hf_config["model_type"] == "gemma"
    assert hf_config["torch_dtype"] == "bfloat16"  # gemma_2b_en's own dtype
    assert hf_config["num_hidden_layers"] == 1 and hf_config["vocab_size"] == 256
    assert "config_differences" not in synthetic  # Gemma's layout is exact
    assert report["model"]["parameter_count"] == keras_hub.models.GemmaBackbone(
        **TINY_HF_GEMMA
    ).count_params()
