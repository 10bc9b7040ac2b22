"""`keras-hub-dist validate --phases fit,generate`: the jobs run for real, beside their plan."""

import copy
import json

import keras
import pytest

from keras_hub_dist.shaping.remat import REMAT_MODES
from keras_hub_dist.cli import main as cli
from keras_hub_dist.validate import job_worker
from keras_hub_dist.validate import options as _options
from keras_hub_dist.validate import report as _report_mod
from keras_hub_dist.validate import runner as _runner
from keras_hub_dist.validate import schema as _schema
from keras_hub_dist.validate import worker as _worker

# 8 heads so every mesh divides; 64 positions, prompt chunks of 16: long
# enough for ours' chunked prompt pass to show against stock's single pass.
TINY_GEMMA = {
    "vocabulary_size": 512, "num_layers": 1, "num_query_heads": 8, "num_key_value_heads": 8,
    "hidden_dim": 64, "intermediate_dim": 128, "head_dim": 8,
}
# A memory sample every 20 ms, not 2: what is compared here is XLA's figures
# of the programs, and a peak only against itself (the budget test); the
# sampling thread ran beside every job case.
JOB = dict(mesh=(2, 4), phases=("fit", "generate"), batch=8, seq=64, prompt_chunk=16,
           interval_ms=20.0)
FIELDS = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes")


def _in_this_process(spec, workdir, label, env, options):
    """`runner._run_worker`, without the fresh process: the cases run here
    (the suite's 8 devices, its compilation cache), one after the other."""
    run = job_worker.measure_job if spec.get("phase") in job_worker.JOB_PHASES else _worker.run_task
    result = run(spec)
    result.update(returncode=0, process_wall_s=result.get("wall_s", 0.0))
    return result


@pytest.fixture(scope="module")
def job_run(tmp_path_factory):
    """One run of the four job cases on a tiny Gemma preset, reused below."""
    import keras_hub

    path = str(tmp_path_factory.mktemp("preset") / "tiny_gemma")
    keras.utils.set_random_seed(0)
    keras_hub.models.GemmaBackbone(**TINY_GEMMA).save_to_preset(path)
    options = _options.ValidateOptions(preset=path, **JOB)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_runner, "_run_worker", _in_this_process)
        report = _runner.run_validation(options)
    return options, report


def test_both_jobs_are_measured_ours_and_stock(job_run):
    options, report = job_run
    assert [(c["phase"], c["case"], c["ok"]) for c in report["cases"]] == [
        ("fit", "ours", True), ("fit", "stock", True),
        ("generate", "ours", True), ("generate", "stock", True),
    ], [c.get("error") for c in report["cases"]]
    assert report["options"]["phases"] == ["fit", "generate"]
    assert report["options"]["batch"] == 8 and report["options"]["seq"] == 64
    for c in report["cases"]:
        program = c["program"]
        assert job_worker.PROGRAMS[c["phase"]] in program["name"]
        # The real run holds at least the program's temporaries on top of what
        # was live before it (the weights).
        for d, peak in c["peak_per_device"].items():
            assert peak >= c["start_per_device"][d] + program["temp_bytes"] > 0
        assert c["job"]["batch"] == 8 and c["job"]["seq"] == 64
    fit_ours = _report_mod.find_case(report, "fit", "ours")
    assert fit_ours["plan"]["optimizer_bytes"] > 0 and fit_ours["job"]["optimizer"] == "adam"
    gen_ours = _report_mod.find_case(report, "generate", "ours")
    assert gen_ours["job"]["sampler"] == "greedy" and gen_ours["job"]["prompt_chunk"] == 16
    assert gen_ours["plan"]["kv_cache_bytes"] > 0


def test_the_plan_equals_the_measured_program(job_run):
    _, report = job_run
    for c in report["cases"]:
        assert c["plan_mismatches"] == [], (c["phase"], c["case"])
        for field in FIELDS:
            assert c["plan"][field] == c["program"][field], (c["phase"], c["case"], field)
        assert c["plan"]["total_bytes"] == c["program"]["total_bytes"]
    assert report["plan_mismatches"] == []
    assert report["exit_code"] == _schema.EXIT_OK


def test_ours_generate_needs_fewer_temporaries_than_stock(job_run):
    _, report = job_run
    ours = _report_mod.find_case(report, "generate", "ours")["program"]["temp_bytes"]
    stock = _report_mod.find_case(report, "generate", "stock")["program"]["temp_bytes"]
    assert ours < stock
    row = next(r for r in report["comparisons"] if r["phase"] == "generate")
    assert row["stock_over_ours_program_temp"] == stock / ours > 1.0


def test_report_schema_and_text(job_run, tmp_path):
    _, report = job_run
    _schema.check_report(report)
    assert report["schema_version"] == _schema.SCHEMA_VERSION == 2
    path = tmp_path / "report.json"
    _report_mod.write_json(report, str(path))
    assert json.loads(path.read_text()) == json.loads(json.dumps(report))
    text = _report_mod.format_report(report)
    assert "== fit ==" in text and "== generate ==" in text
    assert "jit_train_step" in text and "ours plan" in text and "stock measured" in text
    assert text.count("plan = measured") == 4 and "temporaries: stock / ours" in text
    broken = copy.deepcopy(report)
    broken["cases"][0].pop("plan")
    with pytest.raises(ValueError, match=r"report.cases\[0\]: missing key 'plan'"):
        _schema.check_report(broken)


def test_budget_and_plan_mismatch_exit_codes(job_run):
    options, report = job_run
    # The budget applies to the job phases' peaks too.
    peak = max(_report_mod.find_case(report, "generate", "ours")["peak_per_device"].values())
    tight = _options.ValidateOptions(preset=options.preset, hbm_gb=(peak - 1) / 2**30, **JOB)
    over = copy.deepcopy(report)
    _report_mod.summarize(over, tight)
    assert over["exit_code"] == _schema.EXIT_OVER_BUDGET
    assert ("generate", "ours") in {(o["phase"], o["case"]) for o in over["over_budget"]}
    assert any(
        line.startswith("OVER BUDGET: phase generate, ours")
        for line in _report_mod.over_budget_lines(over)
    )
    # A plan that differs from the measured program is flagged and fails.
    wrong = copy.deepcopy(report)
    case = _report_mod.find_case(wrong, "fit", "stock")
    case["plan"]["temp_bytes"] += 1
    case["plan_mismatches"] = job_worker.mismatches(case["program"], case["plan"])
    _report_mod.summarize(wrong, options)
    assert wrong["exit_code"] == _schema.EXIT_PLAN_MISMATCH
    assert wrong["plan_mismatches"] == [{
        "phase": "fit", "case": "stock", "field": "temp_bytes",
        "plan_bytes": case["program"]["temp_bytes"] + 1,
        "measured_bytes": case["program"]["temp_bytes"],
    }]
    _schema.check_report(wrong)
    assert "PLAN MISMATCH (stock)" in _report_mod.format_report(wrong)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--phases", "fit", "--remat", "everything"], "Unknown --remat mode. Expected one of"),
        (["--phases", "fit", "--mesh", "2x4", "--batch", "3"], "Expected a --batch it divides, e.g. [2, 4, 6, 8]"),
        (["--phases", "load", "--lora", "4"], "--lora and --remat apply to the fit phase"),
        (["--phases", "fit", "--lora", "0"], "Expected --lora RANK >= 1"),
        (["--phases", "generate", "--seq", "1"], "Expected --seq >= 2"),
        (["--phases", "train"], "Use e.g. --phases init,load or --phases fit,generate"),
    ],
)
def test_bad_job_flags_fail_before_anything_runs(flags, message, capsys, monkeypatch):
    monkeypatch.setattr(_runner, "run_validation", lambda *a, **k: pytest.fail("ran"))
    assert cli.main(["validate", *flags]) == 2
    assert message in capsys.readouterr().err


def test_defaults_stay_init_and_load():
    assert cli.build_parser().parse_args(["validate"]).phases == "init,load"
    assert _options.ValidateOptions().phases == ("init", "load")
    assert _options.REMAT_MODES == REMAT_MODES
    args = cli.build_parser().parse_args(
        ["validate", "--phases", "fit", "--lora", "8", "--remat", "full", "--batch", "4", "--seq", "32"]
    )
    options = cli.options_from_args(args)
    assert (options.phases, options.lora_rank, options.remat, options.batch, options.seq) == (
        ("fit",), 8, "full", 4, 32
    )
    # A report of init / load only carries no job settings (as before).
    assert "batch" not in _runner._new_report(_options.ValidateOptions())["options"]
