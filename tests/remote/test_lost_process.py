"""A process of a 2-process x 4-device job (loopback, gloo, started with
`keras_hub_dist.initialize`) SIGKILLed at a known point mid-load, mid-save
(a directory, S3) and mid-restore: the survivor raises the operation's
`ProcessLostError` naming process 1 within the heartbeat (plus a margin for
this shared machine), exits with status 1 (no SIGABRT, no exit-time hang),
nothing is readable at the target, and the next save sweeps what was left.

The times are those of the events: the test's SIGKILL (once the victim has
written that it reached its point) and the survivor's own clock when it
caught the error (tests/remote/lost_process_worker.py)."""

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
from tests.multiprocess_jobs import lost_process_presets, run_lost_process_job, weights_only_checkpoint

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


def _checkpoint(root, preset):
    directory = root / "checkpoint"
    return str(directory) if directory.exists() else weights_only_checkpoint(root, preset)


@pytest.mark.parametrize("phase", ["load", "save", "s3", "restore"])
def test_a_killed_process_raises_process_lost_on_the_survivor(presets, remote_target, tmp_path, phase):
    root, tiny, parts = presets
    preset, target = tiny, str(tmp_path / "saved")
    if phase == "s3":
        preset, remote = parts, remote_target("s3")
        target = remote.url
    elif phase == "restore":
        pytest.importorskip("orbax.checkpoint")
        target = _checkpoint(root, tiny)
    out = tmp_path / "job"
    out.mkdir()
    result = run_lost_process_job(WORKER, [preset, phase, target], out, heartbeat_s=HEARTBEAT_S)
    report = result["report"]
    assert result["exit"] == 1 and report, result["stderr"][-3000:]
    wanted = {"load": "PresetError", "save": "SaveError", "s3": "SaveError", "restore": "CheckpointError"}[phase]
    assert "ProcessLostError" in report["classes"] and wanted in report["classes"], report
    assert report["lost"] == [1] and "lost process 1 " in report["message"], report["message"]
    assert "dataset" not in report["message"] and "Loading variable" not in report["message"]
    assert result["kill_to_error_s"] <= BOUND_S and result["kill_to_exit_s"] <= BOUND_S + 4, result
    print(f"{phase}: kill -> error {result['kill_to_error_s']:.2f} s, kill -> exit {result['kill_to_exit_s']:.2f} s")

    if phase in ("save", "s3"):
        _check_nothing_published_then_swept(preset, target, phase)


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
    from keras_hub_dist import PresetError, _processes

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
    monkeypatch.setattr(_processes, "_HOSTS", {0: "a (10.0.0.1)", 1: "b (10.0.0.2)", 2: "c (10.0.0.3)"})
    assert _processes.lost_processes(str(gloo)) == (1,)
