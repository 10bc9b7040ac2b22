"""`plan_memory(..., target=...)`: the TPU / GPU compilers from this CPU host, and the estimates."""

import importlib.metadata

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from keras_hub_dist import PlanError
from keras_hub_dist.jobs import chips, collectives, programs, step_time, targets
from keras_hub_dist.jobs.abstract_job import abstract_job
from keras_hub_dist.jobs.memory_plan import plan_memory
from keras_hub_dist.plan import presets

TINY = dict(
    vocabulary_size=256, num_layers=1, num_query_heads=8, num_key_value_heads=8,
    hidden_dim=64, intermediate_dim=128, head_dim=8,
)
FIELDS = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes")


def _libtpu():
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None


needs_libtpu = pytest.mark.skipif(
    _libtpu() is None, reason='libtpu is not installed (pip install "keras-hub-dist[tpu]")'
)


@needs_libtpu
def test_tpu_fit_plan_equals_the_tpu_compilers_analysis_of_the_train_step():
    plan = plan_memory(
        "gemma_7b_en", (1, 8), job="fit", batch_size=8, sequence_length=16, dtype="float32",
        overrides=TINY, target="v5e-8",
    )
    # The same train step, lowered on its own for a mesh of the target's
    # devices and compiled by libtpu (tests/jobs/test_memory_plan.py shows the
    # lowered step equals the program a real `fit` compiles).
    cls, config, _ = presets.backbone_config("gemma_7b_en", dtype="float32", **TINY)
    job = abstract_job(cls, config, targets.target_mesh("v5e-8", (1, 8)))
    compiled = targets.compile_for_target(programs.lower_fit(job, 8, 16, "adam")).executable
    assert {d.platform for d in jax.tree.leaves(compiled.input_shardings)[0].device_set} == {"tpu"}
    real = programs.program_memory(compiled)
    for field in FIELDS:
        assert getattr(plan, field) == real[field], field
    assert plan.total_bytes == real["total_bytes"]
    assert plan.compiler.startswith("TPU v5 lite x8 (v5e-8)")
    assert f"libtpu {_libtpu()}" in plan.compiler
    assert plan.target == "v5e-8" and plan.fits and plan.hbm_bytes == 16 * 2**30
    estimate = plan.step_time
    assert estimate.chip == "TPU v5e" and estimate.decode is None
    assert estimate.step.overlapped_s == max(estimate.step.compute_s, estimate.step.memory_s, estimate.step.comms_s)
    assert "ESTIMATED time" in plan.summary()


@needs_libtpu
def test_tpu_refusal_is_the_verdict_with_the_compilers_figures():
    mesh = targets.target_mesh("v5e-8", (1, 8))
    big = jax.ShapeDtypeStruct((64 * 1024, 65536), jnp.float32, sharding=NamedSharding(mesh, P(None, "model")))
    result = targets.compile_for_target(jax.jit(lambda a: (a * 2, a + 1, a @ a.T)).lower(big))
    assert result.executable is None
    assert "RESOURCE_EXHAUSTED" in result.refusal
    assert result.available_bytes == int(15.75 * 2**30)
    assert result.required_bytes > result.available_bytes


@needs_libtpu
def test_the_collective_reader_on_a_known_program():
    mesh = targets.target_mesh("v5e-8", (2, 4))
    x = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "model")))
    w = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P("model", None)))

    def ten_matmuls(x, w):
        def body(i, x):
            return jax.lax.with_sharding_constraint(x @ w, NamedSharding(mesh, P(None, "model")))

        return jax.lax.fori_loop(0, 10, body, x)

    compiled = targets.compile_for_target(jax.jit(ten_matmuls).lower(x, w)).executable
    hlo = collectives.read_hlo(compiled.as_text(), {"batch": 2, "model": 4})
    # Each trip: x's column block (1024 x 1024) times w's row block, summed
    # over the model axis: one all-reduce of 1024 x 4096 bf16 per trip.
    assert hlo.dot_flops == 10 * 2 * 1024 * 1024 * 4096
    (reduce,) = [c for c in hlo.collectives if c.kind == "all-reduce"]
    assert (reduce.axes, reduce.group_size, reduce.count) == (("model",), 4, 10)
    assert reduce.bytes == 10 * 1024 * 4096 * 2
    assert reduce.wire_bytes == 10 * 2 * 3 / 4 * 1024 * 4096 * 2
    assert hlo.unknown_loops == 0


def test_the_collective_reader_on_hlo_text():
    text = """HloModule m
%body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]) parameter(0)
  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %ag = f32[8,64]{1,0} all-gather(%x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={1}
  %w = f32[64,16]{1,0} constant({...})
  %d = f32[8,16]{1,0} dot(%ag, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], f32[8,16]) tuple(%i, %d)
}
%cond (p: (s32[], f32[8,16])) -> pred[] {
  %p = (s32[], f32[8,16]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}
ENTRY %main (a: f32[8,16]) -> f32[8,16] {
  %a = f32[8,16]{1,0} parameter(0)
  %ar = f32[8,16]{1,0} all-reduce(%a), replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  %l = (s32[], f32[8,16]) while(%t0), condition=%cond, body=%body
  ROOT %r = f32[8,16]{1,0} get-tuple-element(%l), index=1
}
"""
    hlo = collectives.read_hlo(text, {"batch": 2, "model": 4})
    by_kind = {c.kind: c for c in hlo.collectives}
    assert by_kind["all-gather"].axes == ("model",) and by_kind["all-gather"].count == 6
    assert by_kind["all-gather"].bytes == 6 * 8 * 64 * 4
    assert by_kind["all-reduce"].axes == ("batch",) and by_kind["all-reduce"].count == 1
    assert hlo.dot_flops == 6 * 2 * 8 * 16 * 64


def test_roofline_arithmetic():
    chip = chips.CHIPS["v5e"]
    part = step_time.roofline(197e12, 819e9, 200e9, chip)
    assert part.compute_s == pytest.approx(1.0)
    assert part.memory_s == pytest.approx(1.0)
    assert part.comms_s == pytest.approx(1.0)  # half of the 400 GB/s bidirectional ICI
    assert part.overlapped_s == pytest.approx(1.0) and part.serial_s == pytest.approx(3.0)
    assert collectives.wire_bytes("all-reduce", 800, 8) == 1400
    assert collectives.wire_bytes("all-gather", 800, 8) == 700
    assert collectives.wire_bytes("reduce-scatter", 100, 8) == 700
    assert collectives.wire_bytes("all-reduce", 800, 1) == 0


def test_maxtext_training_flops_by_hand():
    cls, config, _ = presets.backbone_config("gemma_7b_en", dtype="float32", **TINY)
    job = abstract_job(cls, config, (1, 8))
    backbone = job.task.backbone
    # Gemma's matmul weights: q, k, v, o (64 x 8 x 8 each), gate, up, down
    # (64 x 64 each: intermediate_dim / 2), the tied embedding once (256 x 64).
    params = 4 * 64 * 64 + 3 * 64 * 64 + 256 * 64
    rows, seq = 8 / 8, 16
    expected = 6 * rows * seq * params + 3 * 1 * 4 * rows * seq**2 * 8 * 8 / 2
    assert step_time.maxtext_training_flops(backbone, 8, seq, 8) == expected


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(target="v9z-8"), r"Unknown plan target\. Expected one of \[.*'h100-8'.*'v5e-8'.*\]\. Received: target='v9z-8'"),
        (dict(target="v5e-8", mesh=(1, 4)), r"v5e-8 has 8 devices: Expected a mesh of 8 devices, e\.g\. \(1, 8\).*Received: mesh=\(1, 4\)"),
        (dict(target="v4-8", mesh=(1, 8)), r"v4-8 has 4 devices"),
        (dict(target="v5e-8", hbm_gb=32), r"v5e-8's devices have 16 GiB each: Expected hbm_gb <= 16\. Received: hbm_gb=32"),
    ],
)
def test_bad_targets_are_refused_before_anything_is_compiled(kwargs, match, monkeypatch):
    monkeypatch.setattr(programs, "lower_fit", lambda *a, **k: pytest.fail("compiled"))
    mesh = kwargs.pop("mesh", (1, 8))
    with pytest.raises(PlanError, match=match):
        plan_memory("gemma_7b_en", mesh, overrides=TINY, **kwargs)


def test_a_target_whose_compiler_is_missing_says_the_command(monkeypatch):
    monkeypatch.setattr(targets, "_installed", lambda platform: None)
    targets.target_devices.cache_clear()
    try:
        with pytest.raises(PlanError, match=r'Expected the libtpu package installed\. Received: none .*pip install "keras-hub-dist\[tpu\]"'):
            plan_memory("gemma_7b_en", (1, 8), overrides=TINY, target="v6e-8")
        with pytest.raises(PlanError, match=r"jax-cuda12-plugin.*keras-hub-dist\[cuda-plan\]"):
            plan_memory("gemma_7b_en", (1, 8), overrides=TINY, target="h100-8")
    finally:
        targets.target_devices.cache_clear()


def test_the_cli_plans_for_a_target(capsys):
    from keras_hub_dist.cli.main import main as cli_main

    assert cli_main(["plan", "gemma_7b_en", "--mesh", "1x4", "--target", "v5e-8"]) == 2
    assert "v5e-8 has 8 devices: Expected a mesh of 8 devices" in capsys.readouterr().err
    assert cli_main(["plan", "gemma_7b_en", "--target", "tpu-v9"]) == 2
    assert "Unknown plan target" in capsys.readouterr().err


def test_run_on_device_parses_and_plans_on_cpu():
    """tools/run_on_device.py's plan half (its run half needs an accelerator)."""
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "tools" / "run_on_device.py"
    spec = importlib.util.spec_from_file_location("run_on_device", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    overrides = [f"--override={k}={json.dumps(v)}" for k, v in TINY.items()]
    args = tool.parse_args(["--mesh", "2x4", "--job", "fit", "--batch", "8", "--seq", "16", "--dtype", "float32", *overrides])
    assert (args.num_layers, args.steps, args.overrides["hidden_dim"]) == (2, 3, 64)
    assert args.overrides["num_layers"] == 2  # --num_layers wins over an override
    plan = tool.plan_half(args)
    assert plan.mesh_axis_sizes == {"batch": 2, "model": 4} and plan.options["sequence_length"] == 16
    with pytest.raises(SystemExit):
        tool.parse_args(["--steps", "1"])
    with pytest.raises(SystemExit):
        tool.parse_args(["--override", "hidden_dim"])
