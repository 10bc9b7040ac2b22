"""The restore plan alone (no JAX, no files): matching and grouping."""

import numpy as np
import pytest

from keras_hub_dist import CheckpointError
from keras_hub_dist.load.restore_plan import (
    Stored,
    Wanted,
    group_reads,
    match_paths,
    plan_restore,
)

F32 = np.dtype("float32")


def _stored(section, path, shape=(4,), dtype=F32):
    return Stored((section, *path.split("/")), shape, dtype)


def _model():
    return [Wanted("dense/kernel", (4,), F32, 10), Wanted("dense/bias", (4,), F32, 3)]


def _checkpoint(optimizer="adam"):
    return [
        _stored("trainable_variables", "dense/kernel"),
        _stored("non_trainable_variables", "dense/bias"),  # frozen since: still matched
        _stored("optimizer_variables", f"{optimizer}/iteration", (), np.dtype("int32")),
        _stored("optimizer_variables", f"{optimizer}/dense_kernel_momentum"),
        _stored("metrics_variables", "loss/total", ()),  # not restored
    ]


def _optimizer(name="adam"):
    return [
        Wanted(f"{name}/iteration", (), np.dtype("int32"), 4),
        Wanted(f"{name}/dense_kernel_momentum", (4,), F32, 10),
    ]


def test_matches_every_section_and_groups_by_bytes():
    plan = plan_restore(_model(), _optimizer(), _checkpoint(), step=2, label="/c", budget=13)
    assert plan.keys == (
        ("trainable_variables", "dense", "kernel"),
        ("non_trainable_variables", "dense", "bias"),
        ("optimizer_variables", "adam", "iteration"),
        ("optimizer_variables", "adam", "dense_kernel_momentum"),
    )
    assert plan.paths == ("dense/kernel", "dense/bias", "adam/iteration", "adam/dense_kernel_momentum")
    assert plan.groups == ((0, 1), (2,), (3,))
    assert plan.read_bytes == 27


def test_automatic_numbers_match_in_their_order():
    # A process that built other optimizers first names this one `adam_3`.
    plan = plan_restore(_model(), _optimizer("adam_3"), _checkpoint("adam_1"), step=2, label="/c", budget=99)
    assert plan.keys[2:] == (
        ("optimizer_variables", "adam_1", "iteration"),
        ("optimizer_variables", "adam_1", "dense_kernel_momentum"),
    )
    pairs, left_wanted, left_stored = match_paths(
        ["seed_generator_9/state", "seed_generator_12/state", "a/b"],
        ["seed_generator_2/state", "seed_generator/state", "a/b"],
    )
    assert pairs == {
        "a/b": "a/b",
        "seed_generator_9/state": "seed_generator/state",
        "seed_generator_12/state": "seed_generator_2/state",
    }
    assert left_wanted == left_stored == []


def test_a_model_without_optimizer_reads_weights_only():
    plan = plan_restore(_model(), None, _checkpoint(), step=2, label="/c", budget=99)
    assert len(plan.keys) == 2 and plan.groups == ((0, 1),)


@pytest.mark.parametrize(
    "model, optimizer, stored, message",
    [
        (_model() + [Wanted("extra/kernel", (4,), F32)], None, _checkpoint(),
         "1 variables of the model not in it ('extra/kernel')"),
        (_model()[:1], None, _checkpoint(), "1 stored arrays the model lacks ('dense/bias')"),
        ([Wanted("dense/kernel", (8,), F32), _model()[1]], None, _checkpoint(),
         "Expected 'dense/kernel' in /c step 2 to have shape (8,) and dtype float32"),
        ([Wanted("dense/kernel", (4,), np.dtype("float16")), _model()[1]], None, _checkpoint(),
         "Received: shape (4,), dtype float32"),
        (_model(), _optimizer()[:1], _checkpoint(), "stored arrays Adam 'adam' lacks ('adam/dense_kernel_momentum')"),
        (_model(), _optimizer(), _checkpoint()[:2], "Expected optimizer state in /c step 2"),
        (_model() * 2, None, _checkpoint(), "'dense/kernel' twice"),
    ],
)
def test_mismatches_name_what_differs(model, optimizer, stored, message):
    with pytest.raises(CheckpointError) as info:
        plan_restore(model, optimizer, stored, step=2, label="/c", budget=99,
                     optimizer_name="Adam 'adam'")
    assert message in str(info.value)


def test_long_lists_are_cut():
    many = [Wanted(f"layer_{chr(97 + i)}/kernel", (4,), F32) for i in range(20)]
    with pytest.raises(CheckpointError, match="and 14 more"):
        plan_restore(_model() + many, None, _checkpoint(), step=2, label="/c", budget=9)


def test_group_reads():
    assert group_reads([], 10) == ()
    assert group_reads([4, 4, 4, 20, 1], 10) == ((0, 1), (2,), (3,), (4,))
    assert group_reads([0, 0, 0], 0) == ((0, 1, 2),)
