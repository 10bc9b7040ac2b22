"""Tests of the validation tool (`keras-hub-dist validate`)."""

import copy
import json
import os
import subprocess
import sys

import keras
import pytest

from keras_hub_dist.cli import main as cli
from keras_hub_dist.validate import options as _options
from keras_hub_dist.validate import plot as _plot
from keras_hub_dist.validate import report as _report_mod
from keras_hub_dist.validate import runner as _runner
from keras_hub_dist.validate import schema as _schema
from keras_hub_dist.validate import worker as _validate_worker
from tests.multiprocess_jobs import command_env

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
KIB = 1024

# A Gemma small enough to build in a second; 8 heads so every mesh divides.
TINY_GEMMA = {
    "vocabulary_size": 512,
    "num_layers": 1,
    "num_query_heads": 8,
    "num_key_value_heads": 8,
    "hidden_dim": 64,
    "intermediate_dim": 128,
    "head_dim": 8,
}


# -- options and flags ------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [("1x8", (1, 8)), ("2x4", (2, 4)), ("8X1", (8, 1)), ("8", (1, 8)), (None, None)],
)
def test_parse_mesh(text, expected):
    assert _options.parse_mesh(text) == expected


@pytest.mark.parametrize("text", ["1x", "x8", "0x8", "1x2x4", "abc"])
def test_parse_mesh_rejects(text):
    with pytest.raises(ValueError, match="Expected --mesh as BATCHxMODEL"):
        _options.parse_mesh(text)


def test_parse_overrides():
    assert _options.parse_overrides(["hidden_dim=64", "dtype=bfloat16", "x=true"]) == {
        "hidden_dim": 64,
        "dtype": "bfloat16",
        "x": True,
    }
    with pytest.raises(ValueError, match="Expected --override KEY=VALUE"):
        _options.parse_overrides(["hidden_dim"])


def test_options_defaults_and_validation():
    options = _options.ValidateOptions(num_layers=2, overrides={"hidden_dim": 64})
    assert options.phases == ("init", "load")
    assert options.mesh_shape == (1, 8)
    assert options.simulated_devices == 8
    assert options.config_overrides() == {"hidden_dim": 64, "num_layers": 2}
    assert _options.ValidateOptions(mesh=(2, 2)).simulated_devices == 4
    assert _options.ValidateOptions(phases=("load", "init")).phases == ("init", "load")
    with pytest.raises(ValueError, match="Expected phases among"):
        _options.ValidateOptions(phases=("train",))
    with pytest.raises(ValueError, match="Expected hbm_gb > 0"):
        _options.ValidateOptions(hbm_gb=0)
    with pytest.raises(ValueError, match="Expected num_layers >= 1"):
        _options.ValidateOptions(num_layers=0)


def test_cli_flags_map_to_options():
    args = cli.build_parser().parse_args(
        [
            "validate", "--preset", "llama3_8b_en", "--mesh", "2x4", "--dtype", "bfloat16",
            "--phases", "load", "--num_layers", "1", "--no-baseline", "--hbm_gb", "16",
            "--override", "vocabulary_size=512", "--devices", "8",
        ]
    )
    options = cli.options_from_args(args)
    assert options.mesh == (2, 4)
    assert options.phases == ("load",)
    assert options.baseline is False
    assert options.hbm_gb == 16
    assert options.config_overrides() == {"vocabulary_size": 512, "num_layers": 1}
    assert cli.build_parser().parse_args(["validate"]).baseline is True


def test_child_environment_sets_simulated_devices():
    env = _runner.child_environment(
        4, {"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=2", "A": "b"}
    )
    assert env["XLA_FLAGS"].split() == ["--xla_foo=1", "--xla_force_host_platform_device_count=4"]
    assert env["KERAS_BACKEND"] == "jax"
    assert env["A"] == "b"


# -- summaries, budget and exit codes (fabricated measurements) --------------


def _case(phase, case, peaks, finals, host=(100, 300), wall=2.0):
    ids = [str(i) for i in range(len(peaks))]
    per = lambda values: dict(zip(ids, values))  # noqa: E731
    return {
        "ok": True, "phase": phase, "case": case, "error": None, "returncode": 0,
        "process_wall_s": wall + 5, "wall_s": wall, "source": "live_arrays",
        "peak_per_device": per(peaks), "final_per_device": per(finals),
        "start_per_device": per([0] * len(peaks)), "live_peak_per_device": per(peaks),
        "temp_per_device": per([0] * len(peaks)), "weights_per_device": per(finals),
        "host_start_rss": host[0], "host_peak_rss": host[1], "host_final_rss": host[1],
        "timeline": {
            "t": [0.0, 1.0, 2.0],
            "bytes": {d: [0, p, f] for d, p, f in zip(ids, peaks, finals)},
            "live_bytes": {d: [0, p, f] for d, p, f in zip(ids, peaks, finals)},
            "host_rss": [host[0], host[1], host[1]],
        },
        "backbone_class": "GemmaBackbone", "parameter_count": 1000, "model_bytes": 4000,
        "weight_dtypes": ["float32"], "architecture": {"kind": "named"}, "config": {},
        "platform": "cpu", "device_kind": "cpu", "device_count": len(peaks),
        "versions": {"jax": "x"}, "bytes_limit_per_device": dict.fromkeys(ids),
    }


def _report(cases, **option_kwargs):
    options = _options.ValidateOptions(mesh=(1, 2), devices=2, **option_kwargs)
    report = {
        "schema_version": 1, "tool": "keras-hub-dist validate", "created": "now",
        "options": {
            "preset": options.preset, "mesh": list(options.mesh_shape), "dtype": None,
            "phases": list(options.phases), "num_layers": None, "overrides": {},
            "baseline": options.baseline, "hbm_gb": options.hbm_gb, "devices": 2,
            "interval_ms": 2.0,
        },
        "model": None, "environment": None, "synthetic_preset": None,
        "budget_bytes": None, "budget_source": None, "cases": cases,
    }
    _report_mod.summarize(report, options)
    _schema.check_report(report)
    return report


def _stock_spike_cases(phase="init"):
    # Stock: the whole model on device 0 first (8 KiB), then 1 KiB shards.
    return [
        _case(phase, "ours", [KIB, KIB], [KIB, KIB], host=(100, 200), wall=1.0),
        _case(phase, "stock", [8 * KIB, KIB], [KIB, KIB], host=(100, 500), wall=3.0),
    ]


def test_comparisons_ratios():
    report = _report(_stock_spike_cases(), phases=("init",))
    (row,) = report["comparisons"]
    assert row["ours_peak_over_final"] == 1.0
    assert row["stock_peak_over_final"] == 8.0
    assert row["stock_over_ours_peak"] == 8.0
    assert row["stock_over_ours_host_growth"] == 4.0
    assert row["stock_over_ours_wall"] == 3.0
    assert report["exit_code"] == _schema.EXIT_OK
    assert report["model"]["backbone_class"] == "GemmaBackbone"
    text = _report_mod.format_report(report)
    assert "8.00x" in text and "1.00x" in text and "stock/ours peak" in text
    assert "host peak RSS growth" in text and "(4.00x)" in text


def test_budget_exceeded_by_ours_fails_with_phase_and_device():
    cases = _stock_spike_cases("init") + [
        _case("load", "ours", [KIB, 3 * KIB], [KIB, KIB]),
        _case("load", "stock", [KIB, KIB], [KIB, KIB]),
    ]
    report = _report(cases, hbm_gb=2 * KIB / 2**30)
    assert report["budget_bytes"] == 2 * KIB
    assert report["budget_source"] == "hbm_gb"
    assert report["exit_code"] == _schema.EXIT_OVER_BUDGET
    over = {(o["phase"], o["case"], o["device"]) for o in report["over_budget"]}
    assert over == {("init", "stock", "0"), ("load", "ours", "1")}
    lines = _report_mod.over_budget_lines(report)
    assert "OVER BUDGET: phase load, ours, device 1: peak 3.00 KiB > budget 2.00 KiB" in lines
    assert any(line.startswith("stock would not fit: phase init, stock, device 0") for line in lines)


def test_budget_exceeded_only_by_stock_passes():
    report = _report(_stock_spike_cases(), phases=("init",), hbm_gb=4 * KIB / 2**30)
    assert [o["case"] for o in report["over_budget"]] == ["stock"]
    assert report["exit_code"] == _schema.EXIT_OK


def test_budget_defaults_to_device_bytes_limit():
    cases = _stock_spike_cases()
    for c in cases:
        c["bytes_limit_per_device"] = {"0": 4 * KIB, "1": 4 * KIB}
    report = _report(cases, phases=("init",))
    assert (report["budget_bytes"], report["budget_source"]) == (4 * KIB, "bytes_limit")


def test_failed_ours_case_exit_code_and_table():
    failed = {
        "ok": False, "phase": "init", "case": "ours", "error": "killed by signal 9",
        "returncode": -9, "process_wall_s": 1.0, "log_tail": "",
    }
    report = _report([failed, _stock_spike_cases()[1]], phases=("init",))
    assert report["exit_code"] == _schema.EXIT_CASE_FAILED
    assert report["comparisons"][0]["stock_over_ours_peak"] is None
    assert "ours FAILED: killed by signal 9" in _report_mod.format_report(report)


# -- JSON schema ---------------------------------------------------------------


def test_schema_accepts_report_and_round_trips(tmp_path):
    report = _report(_stock_spike_cases(), phases=("init",))
    path = tmp_path / "sub" / "report.json"
    _report_mod.write_json(report, str(path))
    loaded = json.loads(path.read_text())
    _schema.check_report(loaded)
    assert loaded == json.loads(json.dumps(report))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r.pop("cases"), "missing key 'cases'"),
        (lambda r: r.update(schema_version=3), "report.schema_version: expected one of [1, 2]"),
        (lambda r: r["cases"][0].pop("peak_per_device"), "report.cases[0]: missing key 'peak_per_device'"),
        (lambda r: r["cases"][0]["final_per_device"].update({"0": -1}), "expected >= 0"),
        (lambda r: r["cases"][1].update(case="mine"), "report.cases[1].case: expected one of"),
        (lambda r: r["comparisons"][0].update(stock_over_ours_peak="8x"), "expected number/null"),
        (lambda r: r["options"].update(mesh="1x8"), "report.options.mesh: expected array"),
    ],
)
def test_schema_rejects(mutate, message):
    report = copy.deepcopy(_report(_stock_spike_cases(), phases=("init",)))
    mutate(report)
    with pytest.raises(ValueError, match="Invalid keras-hub-dist validate report") as info:
        _schema.check_report(report)
    assert message in str(info.value)


def test_schema_is_a_valid_draft7_schema():
    import jsonschema

    jsonschema.Draft7Validator.check_schema(_schema.REPORT_SCHEMA)


def test_schema_rejects_byte_figures_written_as_floats():
    report = copy.deepcopy(_report(_stock_spike_cases(), phases=("init",)))
    report["cases"][0]["host_peak_rss"] = 300.0
    with pytest.raises(ValueError, match=r"report.cases\[0\].host_peak_rss: expected integer"):
        _schema.check_report(report)


def test_schema_lists_every_problem_once():
    report = copy.deepcopy(_report(_stock_spike_cases(), phases=("init",)))
    report.pop("cases")
    report.pop("tool")
    with pytest.raises(ValueError, match=r"\(2 problem\(s\)\)") as info:
        _schema.check_report(report)
    assert "report: missing key 'tool'" in str(info.value)


def test_schema_does_not_require_figures_of_failed_cases():
    failed = {
        "ok": False, "phase": "init", "case": "stock", "error": "boom",
        "returncode": 1, "process_wall_s": 1.0,
    }
    _report([_stock_spike_cases()[0], failed], phases=("init",))


# -- plot -----------------------------------------------------------------------


def test_plot_is_a_png(tmp_path):
    report = _report(_stock_spike_cases(), phases=("init",), hbm_gb=4 * KIB / 2**30)
    path = tmp_path / "memory.png"
    _plot.plot_report(report, str(path))
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert path.stat().st_size > 10_000


def test_plot_without_matplotlib_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'keras-hub-dist\[plot\]'"):
        _plot.require_matplotlib()


# -- the measuring worker, in this process ------------------------------------


@pytest.fixture(scope="module")
def tiny_preset(tmp_path_factory):
    import keras_hub

    path = str(tmp_path_factory.mktemp("preset") / "tiny_gemma")
    keras.utils.set_random_seed(0)
    keras_hub.models.GemmaBackbone(**TINY_GEMMA).save_to_preset(path)
    return path


def _measure(case, phase, preset, mesh=(1, 8)):
    return _validate_worker.run_task(
        {
            "task": "measure", "case": case, "phase": phase, "preset": preset,
            "preset_dir": preset, "mesh": list(mesh), "interval_s": 0.002,
        }
    )


def test_worker_stock_init_shows_the_device0_spike(tiny_preset):
    result = _measure("stock", "init", tiny_preset)
    assert result["ok"] and result["source"] == "live_arrays"
    start, final = result["start_per_device"], result["final_per_device"]
    weights = result["weights_per_device"]
    for d in weights:
        # After the case only the model is alive (plus at most a seed counter).
        assert 0 <= final[d] - start[d] - weights[d] < KIB, (d, final, weights)
    assert sum(weights.values()) >= result["model_bytes"]
    # Stock KerasHub creates the (whole) embedding on device 0 before sharding.
    embedding = TINY_GEMMA["vocabulary_size"] * TINY_GEMMA["hidden_dim"] * 4
    assert result["live_peak_per_device"]["0"] - start["0"] >= embedding
    assert result["live_peak_per_device"]["1"] - start["1"] < embedding
    assert result["peak_per_device"]["0"] == (
        result["live_peak_per_device"]["0"] + result["temp_per_device"]["0"]
    )
    timeline = result["timeline"]
    assert timeline["t"] and set(timeline["bytes"]) == set(timeline["live_bytes"]) == set(weights)
    assert max(timeline["bytes"]["0"]) <= result["peak_per_device"]["0"]
    assert max(timeline["live_bytes"]["0"]) == result["live_peak_per_device"]["0"]
    assert result["backbone_class"] == "GemmaBackbone"
    assert keras.distribution.distribution() is None  # the worker cleaned up


def test_worker_writes_a_synthetic_preset_of_a_named_architecture(tmp_path):
    overrides = {k: v for k, v in TINY_GEMMA.items()}
    out_dir = str(tmp_path / "synthetic")
    result = _validate_worker.run_task(
        {"task": "write_preset", "preset": "gemma_2b_en", "overrides": overrides,
         "dtype": None, "out_dir": out_dir}
    )
    assert result["ok"] and result["writer"].endswith("write_synthetic_preset")
    assert result["architecture"]["name"] == "gemma_2b_en"
    assert set(os.listdir(out_dir)) >= {"config.json", "metadata.json", "model.weights.h5"}
    with open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)["config"]
    assert config["num_layers"] == 1 and config["vocabulary_size"] == 512
    assert config["dtype"]["config"]["name"] == "bfloat16"  # gemma_2b_en's own
    assert result["bytes_on_disk"] > TINY_GEMMA["vocabulary_size"] * TINY_GEMMA["hidden_dim"] * 2


def test_worker_rejects_a_mesh_bigger_than_the_devices(tiny_preset):
    with pytest.raises(ValueError, match="needs 16 devices"):
        _measure("stock", "init", tiny_preset, mesh=(2, 8))


# -- the command, end to end (one subprocess run: slow) -------------------------


def test_worker_ours_init_has_no_device0_spike(tiny_preset):
    ours = _measure("ours", "init", tiny_preset)
    assert ours["ok"]
    start, weights = ours["start_per_device"], ours["weights_per_device"]
    embedding = TINY_GEMMA["vocabulary_size"] * TINY_GEMMA["hidden_dim"] * 4
    # The embedding is created in shards: no device ever sees it whole.
    for d in weights:
        assert ours["live_peak_per_device"][d] - start[d] < embedding
        assert ours["final_per_device"][d] - start[d] - weights[d] < KIB


# -- the command, end to end (one subprocess run: slow) -------------------------


def test_cli_end_to_end_budget_json_and_plot(tmp_path, tiny_preset):
    json_path, plot_path = tmp_path / "report.json", tmp_path / "memory.png"
    env = command_env()  # the tool sets the device count itself
    proc = subprocess.run(
        [
            sys.executable, "-m", "keras_hub_dist.cli.main", "validate",
            "--preset", tiny_preset, "--mesh", "2x4", "--phases", "load", "--hbm_gb", str(8 * KIB / 2**30),
            "--json", str(json_path), "--plot", str(plot_path),
        ],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == _schema.EXIT_OVER_BUDGET, proc.stdout + proc.stderr
    assert "OVER BUDGET: phase load, ours, device 0" in proc.stderr
    assert "== load ==" in proc.stdout and "stock/ours peak" in proc.stdout
    report = json.loads(json_path.read_text())
    _schema.check_report(report)
    assert [(c["phase"], c["case"], c["ok"]) for c in report["cases"]] == [
        ("load", "ours", True), ("load", "stock", True),
    ]
    assert report["environment"]["device_count"] == 8
    assert report["synthetic_preset"] is None  # a preset directory was given
    ours, stock = report["cases"]
    assert ours["weight_dtypes"] == stock["weight_dtypes"] == ["float32"]
    assert ours["model_bytes"] == stock["model_bytes"] == report["model"]["model_bytes"]
    for c in report["cases"]:
        assert set(c["peak_per_device"]) == {str(i) for i in range(8)}
        for d, peak in c["peak_per_device"].items():
            assert peak >= c["final_per_device"][d] >= c["weights_per_device"][d] > 0
    # Ours holds its shard only; stock first random-inits on device 0.
    (row,) = report["comparisons"]
    assert row["ours_peak_over_final"] < 1.05
    assert row["stock_over_ours_peak"] > 2.0
    assert plot_path.read_bytes()[:8] == PNG_MAGIC


def test_synthetic_preset_cache_is_reused_and_never_half_written(tmp_path, monkeypatch):
    calls = []

    def fake_worker(spec, workdir, label, env, options):
        calls.append(spec["out_dir"])
        os.makedirs(spec["out_dir"])
        with open(os.path.join(spec["out_dir"], "config.json"), "w") as f:
            f.write("{}")
        if len(calls) == 1:
            return {"ok": False, "error": "boom", "log_tail": ""}
        return {"ok": True, "preset_dir": spec["out_dir"], "writer": "fake",
                "bytes_on_disk": 2, "wall_s": 0.1}

    monkeypatch.setattr(_runner, "_run_worker", fake_worker)
    options = _options.ValidateOptions(num_layers=1, preset_cache=str(tmp_path / "cache"))
    args = (options, {}, str(tmp_path), {}, lambda _m: None)
    with pytest.raises(RuntimeError, match="Could not write a synthetic preset.*boom"):
        _runner._prepare_preset(*args)
    assert os.listdir(tmp_path / "cache") == []  # the failed write left nothing
    first, info = _runner._prepare_preset(*args)
    assert calls[-1] == first + ".partial" and info["writer"] == "fake"
    again, info = _runner._prepare_preset(*args)
    assert again == first and info["writer"] == "reused" and len(calls) == 2
    # Another depth is another preset.
    other = _options.ValidateOptions(num_layers=2, preset_cache=str(tmp_path / "cache"))
    assert _runner._preset_cache_dir(other, "") != first


def test_preset_directory_with_overrides_cannot_be_loaded(tiny_preset, tmp_path):
    options = _options.ValidateOptions(preset=tiny_preset, num_layers=2, phases=("load",))
    with pytest.raises(ValueError, match="cannot change a preset directory's weights"):
        _runner._prepare_preset(options, {}, str(tmp_path), {}, lambda _m: None)
    options = _options.ValidateOptions(preset=tiny_preset, phases=("load",))
    assert _runner._prepare_preset(options, {}, str(tmp_path), {}, lambda _m: None) == (
        os.path.abspath(tiny_preset), None
    )
