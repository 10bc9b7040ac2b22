"""A process of a 2-process x 4-device job (loopback, gloo, started with
`keras_hub_dist.initialize`) SIGKILLed by the package's test hook at a
chosen event (a variable placed, an exchange round, a cross-process step, a
part written, the publish) of a load (Keras and HF formats, a directory and
S3), a save (a directory, S3), an HF export, `convert_checkpoint`, an
adapter save and load, and `restore_checkpoint`: the survivor raises the operation's
`ProcessLostError` naming process 1 within the heartbeat (plus a margin for
this shared machine), exits with status 1 (no SIGABRT, no exit-time hang),
nothing is readable at the target, and the next save sweeps what was left.

The times are those of the events: the victim's SIGKILL (the time its hook
wrote) and the survivor's own clock when it caught the error
(tests/remote/lost_process_worker.py)."""

import functools
import pathlib
import sys
import warnings

import keras
import pytest

import keras_hub_dist
from keras_hub_dist import StaleStagingWarning
from keras_hub_dist.save import remote_publish
from keras_hub_dist.storage import uploads
from tests.multiprocess_jobs import (
    lost_process_hf_and_adapter,
    lost_process_presets,
    run_lost_process_job,
    weights_only_checkpoint,
)

WORKER = pathlib.Path(__file__).with_name("lost_process_worker.py")
# Beats are sent and read once a second: 3 s still lets a starved beat
# thread be 2 s late without a false loss.
HEARTBEAT_S = 3
# The loss noticed by the heartbeat (a program stuck on the lost process),
# or at once (a collective's closed connection); the margin is this shared
# 2-core machine's.
BOUND_S = HEARTBEAT_S + 4

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux and loopback")


@pytest.fixture(scope="module")
def presets(tmp_path_factory):
    root = tmp_path_factory.mktemp("lost_process")
    return (root, *lost_process_presets(root))


@pytest.fixture(scope="module")
def hf_presets(presets):
    """(a tiny Llama 3 preset, it in the HF format, a LoRA adapter of it)."""
    return lost_process_hf_and_adapter(presets[0])


def _checkpoint(root, preset):
    directory = root / "checkpoint"
    return str(directory) if directory.exists() else weights_only_checkpoint(root, preset)


# A few kill points per operation, from the first event to the last
# (benchmarks/bench_lost_host.py --sweep kills at every one): the victim's
# test hook (KERAS_HUB_DIST_TEST_KILL_AT) SIGKILLs it at its K-th EVENT.
KILLS = [
    ("load", "tiny", None, "load.exchange:2", "PresetError"),
    ("load", "tiny@s3", None, "load.variable:9", "PresetError"),
    ("save", "tiny", "dir", "save.part:2", "SaveError"),
    ("s3", "parts", "s3", "save.step:1", "SaveError"),
    ("s3", "parts", "s3", "save.publish:1", "SaveError"),
    ("hf", "tiny3", "dir", "save.step:4", "SaveError"),
    ("convert", "tiny3", "dir", "conversion.step:2", "SaveError"),
    ("adapter-save", "tiny3", "dir", "adapter-save.publish:1", "SaveError"),
    ("adapter-load", "tiny_hf", "adapter", "load.exchange:1", "PresetError"),
    ("restore", "tiny", "checkpoint", "restore.step:2", "CheckpointError"),
]


@pytest.mark.parametrize(("phase", "source", "target_kind", "kill_at", "wanted"), KILLS,
                         ids=[f"{k[0]}-{k[3]}" for k in KILLS])
def test_a_process_killed_at_an_event_raises_process_lost_on_the_survivor(
        presets, hf_presets, remote_target, remote_checkpoint, tmp_path, phase, source, target_kind, kill_at,
        wanted):
    root, tiny, parts = presets
    tiny3, tiny_hf, adapter = hf_presets
    if source == "tiny@s3":
        preset = remote_checkpoint(tiny, schemes=("s3",))["s3"].url
    else:
        preset = {"tiny": tiny, "parts": parts, "tiny3": tiny3, "tiny_hf": tiny_hf}[source]
    target = "-"
    if target_kind == "dir":
        target = str(tmp_path / "saved")
    elif target_kind == "s3":
        target = remote_target("s3").url
    elif target_kind == "adapter":
        target = adapter
    elif target_kind == "checkpoint":
        pytest.importorskip("orbax.checkpoint")
        target = _checkpoint(root, tiny)
    out = tmp_path / "job"
    out.mkdir()
    result = run_lost_process_job(WORKER, [preset, phase, target], out, heartbeat_s=HEARTBEAT_S, kill_at=kill_at)
    assert result["reached"], f"the victim ended before {kill_at}"
    report = result["report"]
    assert result["exit"] == 1 and report, result["stderr"][-3000:]
    assert "ProcessLostError" in report["classes"] and wanted in report["classes"], report
    assert report["lost"] == [1] and "lost process 1 on " in report["message"], report["message"]
    operation = kill_at.split(".")[0].replace("-", " ")
    assert report["phase"] == f"the {operation}", report
    assert "dataset" not in report["message"] and "Loading variable" not in report["message"]
    assert result["kill_to_error_s"] <= BOUND_S and result["kill_to_exit_s"] <= BOUND_S + 4, result
    print(f"{phase} {kill_at}: kill -> error {result['kill_to_error_s']:.2f} s, "
          f"kill -> exit {result['kill_to_exit_s']:.2f} s")

    if kill_at.endswith(".publish:1"):
        # Process 1 lost after process 0 published: the target is whole, and
        # the error says so instead of "nothing published".
        assert "published whole before the loss" in report["message"], report["message"]
        assert "Left behind: nothing published" not in report["message"]
        return
    if target_kind in ("dir", "s3"):
        _check_nothing_published_then_swept(tiny3 if source == "tiny3" else preset, target,
                                            "save" if target_kind == "dir" else "s3")


@pytest.mark.parametrize("phase", ["stuck-python", "stuck-native"])
def test_a_survivor_waiting_where_the_package_does_not_watch_still_ends_named(presets, tmp_path, phase):
    """The survivor in a wait of no package code (a Python loop; JAX's own
    key-value wait, in native code) when process 1 is lost: the beats'
    thread puts the loss into the operation's thread (a Python loop raises
    it), else prints it and ends the process, status 1 either way, before
    JAX's coordinator would abort it (SIGABRT at 4 heartbeats)."""
    out = tmp_path / "job"
    out.mkdir()
    result = run_lost_process_job(WORKER, [presets[1], phase, "-"], out, heartbeat_s=HEARTBEAT_S,
                                  kill_at="load.step:2")
    assert result["reached"] and result["exit"] == 1, (result["exit"], result["stderr"][-3000:])
    assert result["kill_to_exit_s"] <= BOUND_S + 2, result
    if phase == "stuck-python":
        assert "LoadProcessLostError" in result["report"]["classes"], result["report"]
        assert result["report"]["lost"] == [1]
        return
    assert not result["report"], result["report"]  # no Python error: the thread is held in native code
    ended = "keras_hub_dist: keras_hub_dist.errors.LoadProcessLostError: The load lost process 1 on "
    assert ended in result["stderr"] and "stuck in native code" in result["stderr"], result["stderr"][-3000:]


def test_a_killed_coordinator_leaves_a_bucket_the_next_save_sweeps(presets, remote_target, tmp_path):
    """Process 0 (the coordinator) SIGKILLed mid-save into S3: JAX aborts
    the survivor (SIGABRT) unless its collective failed first (then
    `ProcessLostError` naming process 0), within a second or two either
    way; what the job left (its owner record, open multipart uploads) is
    swept by the next save once the record's lease has lapsed."""
    _, _, parts = presets
    remote = remote_target("s3")
    out = tmp_path / "job"
    out.mkdir()
    result = run_lost_process_job(WORKER, [parts, "s3", remote.url], out, victim=0, heartbeat_s=HEARTBEAT_S)
    assert result["exit"] in (1, -6) and result["kill_to_exit_s"] <= BOUND_S, result
    if result["exit"] == 1:
        assert result["report"]["lost"] == [0], result["report"]
    _check_nothing_published_then_swept(parts, remote.url, "s3")


@functools.cache
def _loaded(preset):
    """The preset on (1, 8) in this process, loaded once (a save does not
    change it)."""
    keras.distribution.set_distribution(None)
    return keras_hub_dist.load_sharded_preset(preset, mesh=(1, 8), progress=False)


def _check_nothing_published_then_swept(preset, target, phase):
    """Nothing readable at the target; a save from this process (the job
    restarted) publishes and leaves nothing of the killed job behind."""
    model = _loaded(preset)
    if phase == "save":
        parent = pathlib.Path(target).parent
        assert not pathlib.Path(target).exists()
        left = [p.name for p in parent.iterdir() if p.name != "job"]
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            keras_hub_dist.save_sharded_preset(model, target, progress=False)
        assert sorted(p.name for p in parent.iterdir() if p.name != "job") == ["saved"], left
        swept = [str(w.message) for w in warned if w.category is StaleStagingWarning]
        assert not left or swept, (left, swept)
    else:
        writer = uploads.open_writer(target)
        assert "config.json" not in writer.list()
        # What a killed save leaves is swept once its lease has lapsed.
        lease = remote_publish.LEASE_SECONDS
        remote_publish.LEASE_SECONDS = 0.0
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", StaleStagingWarning)
                keras_hub_dist.save_sharded_preset(model, target, progress=False)
        finally:
            remote_publish.LEASE_SECONDS = lease
        assert "config.json" in writer.list() and writer.list_uploads() == []
        assert not [n for n in writer.list() if n.startswith(".")], writer.list()
    keras.distribution.set_distribution(None)


def test_only_a_jax_collective_or_heartbeat_failure_is_a_lost_process(monkeypatch):
    """What the survivors see, told apart from a file's or a store's error
    (in one process: the job's size faked)."""
    from keras_hub_dist import PresetError, _lost, _processes

    monkeypatch.setattr(_processes.jax, "process_count", lambda: 4)
    monkeypatch.setattr(_processes.jax, "process_index", lambda: 0)

    class JaxRuntimeError(Exception):
        pass

    gloo = JaxRuntimeError("UNKNOWN: Gloo AllGather failed: [pair.cc:547] Connection closed by peer [10.0.0.2]:5")
    wrapped = PresetError("Loading variable 'x' from dataset 'y' failed: JaxRuntimeError: UNKNOWN: Gloo ...")
    wrapped.__cause__ = gloo
    assert _processes.lost_process_cause(wrapped) is gloo
    reset = JaxRuntimeError("UNAVAILABLE: Connection reset by peer")
    assert _processes.lost_process_cause(reset) is reset
    # An object store's reset connection, a missing file: not a lost process.
    assert _processes.lost_process_cause(ConnectionResetError("[Errno 104] Connection reset by peer")) is None
    assert _processes.lost_process_cause(PresetError("model.weights.h5 is truncated")) is None
    assert _processes.lost_processes("UNAVAILABLE: Task 3 heartbeat timeout. This indicates") == (3,)
    unhealthy = "The following tasks are unhealthy (stopped sending heartbeats):\n1\n2\nThe tasks have crashed."
    assert _processes.lost_processes(unhealthy) == (1, 2)
    monkeypatch.setattr(_lost, "HOSTS", {0: "a (10.0.0.1)", 1: "b (10.0.0.2)", 2: "c (10.0.0.3)"})
    assert _processes.lost_processes(str(gloo)) == (1,)
