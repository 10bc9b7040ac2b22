"""What a save killed outright leaves behind, and `durable=True`.

A save killed with SIGKILL mid-write leaves its staging directory; the next
save to the same target removes it (its owner is provably dead), warns
naming it, and publishes a complete preset. A live save's staging directory
(its owner runs, with its true start time) is left alone; one whose pid now
belongs to another process is removed; one of another host is left and
named. `durable=True` flushes every file and directory of the preset and
the parent around the rename, and writes the same bytes.
"""

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import keras
import keras_hub
import pytest

from keras_hub_dist import SaveError, StaleStagingWarning
from keras_hub_dist import load_sharded_preset, save_sharded_preset, write_synthetic_preset
from keras_hub_dist.save import hf_export, saver, staging
from tests.multiprocess_jobs import child_env
from tests.save.test_save import _assert_same_weights

WORKER = pathlib.Path(__file__).with_name("killed_save_worker.py")
TOKENS = {name: f"{i:012x}" for i, name in enumerate(["live", "reused", "elsewhere", "dead"], 1)}

LEFT_ALONE = "Left alone (its save may still run; remove it by hand once it does not)"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    return write_synthetic_preset(
        str(tmp_path_factory.mktemp("staging_source") / "gemma"), keras_hub.models.GemmaBackbone,
        dtype="float32", tokenizer=True, seed=0, vocabulary_size=512, num_layers=2,
        num_query_heads=8, num_key_value_heads=8, hidden_dim=64, intermediate_dim=128, head_dim=8,
    )


@pytest.fixture(scope="module")
def model(preset):
    return load_sharded_preset(preset, mesh=(1, 8), progress=False)


def _leftover(parent, base, token, owner=None, content=b"x"):
    """A staging directory with a file, and `owner`'s record beside it."""
    folder = pathlib.Path(staging.staging_path(str(parent), base, token))
    folder.mkdir(parents=True)
    (folder / "model.weights.h5").write_bytes(content)
    if owner is not None:
        owner.write(staging.record_path(str(parent), base, token))
    return str(folder)


def _messages(warned):
    return [str(w.message) for w in warned if w.category is StaleStagingWarning]


def _wait_for(path, proc, timeout_s=180):
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if proc.poll() is not None:
            pytest.fail(f"the worker ended first (exit {proc.returncode}): "
                        f"{proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"the worker did not reach its write in {timeout_s} s")
        time.sleep(0.05)


def test_a_save_killed_mid_write_is_removed_by_the_next(preset, model, tmp_path):
    parent, target = tmp_path / "out", tmp_path / "out" / "target"
    env = child_env()
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), preset, str(target), str(tmp_path / "ready")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )
    try:
        _wait_for(tmp_path / "ready", proc)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    (partial,) = [n for n in os.listdir(parent) if n.startswith(".target.partial-")]
    token = partial.rsplit("-", 1)[1]
    assert sorted(os.listdir(parent)) == [f".target.owner-{token}.json", partial]
    assert "model.weights.h5" in os.listdir(parent / partial)  # killed mid-write
    record = json.loads((parent / f".target.owner-{token}.json").read_text())
    assert record["pid"] == proc.pid and record["process_count"] == 1

    with pytest.warns(StaleStagingWarning) as warned:
        save_sharded_preset(model, str(target))
    (message,) = _messages(warned)
    assert f"removed {str(parent / partial)!r}" in message
    assert f"process {proc.pid} on host" in message and "which no longer runs" in message
    assert os.listdir(parent) == ["target"]
    keras.distribution.set_distribution(None)
    reference = keras_hub.models.Backbone.from_preset(preset)
    _assert_same_weights(reference, keras_hub.models.Backbone.from_preset(str(target)))
    _assert_same_weights(reference, load_sharded_preset(str(target), mesh=(2, 4), verify=True,
                                                        progress=False))


@pytest.mark.parametrize("linux_proc", [True, False], ids=["proc", "psutil"])
def test_a_process_is_told_from_one_with_its_pid_later(monkeypatch, linux_proc):
    monkeypatch.setattr(staging, "_LINUX_PROC", linux_proc)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        running, started = staging._process_start(sleeper.pid)
        assert running and started is not None
        assert staging._process_start(sleeper.pid) == (True, started)  # stable
        assert staging._process_start(os.getpid())[1] not in (None, started)
    finally:
        sleeper.kill()
    os.waitid(os.P_PID, sleeper.pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped
    assert staging._process_start(sleeper.pid)[0] is False  # a zombie: dead
    sleeper.wait()
    assert staging._process_start(sleeper.pid) == (False, None)


def test_a_live_save_is_left_alone_a_reused_pid_is_not(model, tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        live = staging.Owner.of_process(sleeper.pid, TOKENS["live"], 1)
        live_dir = _leftover(tmp_path, "target", TOKENS["live"], live, b"live")
        # The same pid, but the start time of another process (this one).
        this_start = staging.Owner.of_process(os.getpid(), TOKENS["reused"], 1).started
        reused = dataclasses.replace(live, token=TOKENS["reused"], started=this_start)
        reused_dir = _leftover(tmp_path, "target", TOKENS["reused"], reused)
        elsewhere = dataclasses.replace(live, token=TOKENS["elsewhere"], host="node-7.example")
        elsewhere_dir = _leftover(tmp_path, "target", TOKENS["elsewhere"], elsewhere)
        # A record whose directory is gone (killed after publishing).
        dataclasses.replace(staging.Owner.of_process(os.getpid(), TOKENS["dead"], 1),
                            started="ticks:1").write(
            staging.record_path(str(tmp_path), "target", TOKENS["dead"]))

        with pytest.warns(StaleStagingWarning) as warned:
            save_sharded_preset(model, str(tmp_path / "target"))
        (message,) = _messages(warned)
        assert f"removed {reused_dir!r} (its save: process {sleeper.pid} on host" in message
        assert f"pid {sleeper.pid} is another process now" in message
        assert (f"{elsewhere_dir!r} (process {sleeper.pid} on host 'node-7.example': "
                "another host") in message
        assert message.index(LEFT_ALONE) < message.index(elsewhere_dir)
        assert live_dir not in message
        assert sorted(os.listdir(tmp_path)) == sorted([
            os.path.basename(p) for p in (live_dir, elsewhere_dir)
        ] + [f".target.owner-{TOKENS[n]}.json" for n in ("live", "elsewhere")] + ["target"])
        assert pathlib.Path(live_dir, "model.weights.h5").read_bytes() == b"live"
        live_record = staging.record_path(str(tmp_path), "target", TOKENS["live"])
        assert staging.Owner.read(live_record) == live
        assert sleeper.poll() is None  # it was alive all along
    finally:
        sleeper.kill()
        sleeper.wait()
    # Now that it is gone, the next save removes its directory.
    with pytest.warns(StaleStagingWarning, match="which no longer runs"):
        save_sharded_preset(model, str(tmp_path / "target"), overwrite=True)
    assert not os.path.exists(live_dir) and os.path.exists(elsewhere_dir)


def test_directories_without_an_owner_record_are_removed_only_when_old(tmp_path):
    recent = _leftover(tmp_path, "t", "a" * 12)
    old = _leftover(tmp_path, "t", "b" * 12)
    days_ago = time.time() - 2 * 24 * 3600
    for folder, _, files in os.walk(old):
        for path in [folder] + [os.path.join(folder, f) for f in files]:
            os.utime(path, (days_ago, days_ago))
    (tmp_path / ".t.partial-not_a_token").mkdir()  # not one of ours: never touched
    (tmp_path / ".other.partial-" f"{'c' * 12}").mkdir()  # another target's
    report = staging.sweep_stale(str(tmp_path), "t")
    assert f"removed {old!r} (its save: no owner record, and nothing in it changed for 48 h)" in report
    assert f"{LEFT_ALONE}: {recent!r} (no owner record" in report
    assert "unchanged for 24 h" in report
    assert sorted(os.listdir(tmp_path)) == sorted(
        [os.path.basename(recent), ".t.partial-not_a_token", f".other.partial-{'c' * 12}"])
    assert staging.sweep_stale(str(tmp_path / "missing"), "t") is None


@pytest.mark.parametrize("target_exists", [False, True])
def test_a_save_killed_while_replacing_the_target(model, preset, tmp_path, target_exists):
    """Killed between moving the old preset aside and renaming the new one
    in: the old one is the only copy, restored; once the new one is in
    place, the old one is garbage."""
    dead = dataclasses.replace(staging.Owner.of_process(os.getpid(), TOKENS["dead"], 1),
                               started="ticks:1")
    partial = _leftover(tmp_path, "target", TOKENS["dead"], dead, b"new")
    replaced = staging.replaced_path(str(tmp_path), "target", TOKENS["dead"])
    os.mkdir(replaced)
    pathlib.Path(replaced, "config.json").write_text("old")
    if target_exists:
        (tmp_path / "target").mkdir()
        (tmp_path / "target" / "config.json").write_text("new")
    with pytest.warns(StaleStagingWarning) as warned, pytest.raises(SaveError, match="non-empty"):
        save_sharded_preset(model, str(tmp_path / "target"))
    (message,) = _messages(warned)
    if target_exists:
        assert f"removed {replaced!r}" in message
        assert (tmp_path / "target" / "config.json").read_text() == "new"
    else:
        assert (f"restored {str(tmp_path / 'target')!r} from {replaced!r} (its save was killed "
                f"while replacing it: process {os.getpid()}") in message
        assert (tmp_path / "target" / "config.json").read_text() == "old"
    assert f"removed {partial!r}" in message
    assert os.listdir(tmp_path) == ["target"]


def _spy_on_fsync_and_rename(monkeypatch):
    """Records, in order, every fsync (by path), rename and hashing of the
    weights (which follows the processes' agreement that writing is done)."""
    events = []
    real_fsync, real_rename, real_digests = os.fsync, os.rename, saver._local_digests

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(source, destination):
        events.append(("rename", os.fspath(source), os.fspath(destination)))
        return real_rename(source, destination)

    def local_digests(*args, **kwargs):
        events.append(("hash",))
        return real_digests(*args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(saver, "_local_digests", local_digests)
    return events


def _preset_paths(folder):
    """Every file and directory of a preset, relative to it ("." itself)."""
    out = []
    for root, _, files in os.walk(folder):
        out += [os.path.relpath(root, folder)] + [os.path.relpath(os.path.join(root, f), folder)
                                                   for f in files]
    return sorted(out)


def test_durable_flushes_every_file_and_writes_the_same_bytes(preset, tmp_path, monkeypatch):
    lm = load_sharded_preset(preset, mesh=(2, 4), task="causal_lm", progress=False)
    events = _spy_on_fsync_and_rename(monkeypatch)
    save_sharded_preset(lm, str(tmp_path / "plain"))
    assert [e for e in events if e[0] == "fsync"] == []  # off by default

    for target, overwrite in [(tmp_path / "new" / "dir" / "durable", False),
                              (tmp_path / "new" / "dir" / "durable", True)]:
        events.clear()
        save_sharded_preset(lm, str(target), durable=True, overwrite=overwrite)
        parent = str(target.parent)
        (publish,) = [i for i, e in enumerate(events)
                      if e[0] == "rename" and e[2] == str(target)]
        folder = events[publish][1]
        flushed = [e[1] for e in events[:publish] if e[0] == "fsync"]
        paths = _preset_paths(target)
        assert {"tokenizer.json", "task.json", "metadata.json", "model.weights.h5"} <= set(paths)
        missing = [p for p in paths if os.path.normpath(os.path.join(folder, p)) not in flushed]
        assert not missing  # every file and directory, before the rename
        assert parent in flushed and ("fsync", parent) in events[publish + 1:]
        # The weights: by the writing process's own descriptor, before the
        # processes agree to hash and publish.
        weights = os.path.join(folder, "model.weights.h5")
        assert ("fsync", weights) in events[:events.index(("hash",))]
        if not overwrite:  # the parents it created, and the one that was there
            assert {str(tmp_path), str(tmp_path / "new"), parent} <= set(flushed)
        else:  # the old preset moved aside before, removed after the flush
            assert events[publish - 1][:2] == ("rename", str(target))

        assert _preset_paths(target) == _preset_paths(tmp_path / "plain")
        for name in paths:
            a, b = target / name, tmp_path / "plain" / name
            if a.is_dir():
                continue
            if name == "metadata.json":
                meta_a, meta_b = json.loads(a.read_text()), json.loads(b.read_text())
                meta_a.pop("date_saved"), meta_b.pop("date_saved")
                assert meta_a == meta_b
            else:
                assert a.read_bytes() == b.read_bytes(), name
    assert sorted(os.listdir(tmp_path / "new" / "dir")) == ["durable"]


def test_the_hugging_face_export_is_staged_as_the_keras_save(model, tmp_path, monkeypatch):
    """format="huggingface": the same owner record beside its staging
    directory, the same sweep of what a dead save left, the same flushes
    with `durable=True` (`save.staging`, one implementation for both)."""
    dead = dataclasses.replace(staging.Owner.of_process(os.getpid(), TOKENS["dead"], 1),
                               started="ticks:1")
    partial = _leftover(tmp_path, "hf", TOKENS["dead"], dead)
    events = _spy_on_fsync_and_rename(monkeypatch)
    monkeypatch.setattr(hf_export, "_local_digests", saver._local_digests)  # the spy
    beside = []
    publish = staging.publish

    def publishing(folder, target, token, **kwargs):
        beside.extend(sorted(os.listdir(tmp_path)))
        return publish(folder, target, token, **kwargs)

    monkeypatch.setattr(staging, "publish", publishing)
    target = tmp_path / "hf"
    with pytest.warns(StaleStagingWarning) as warned:
        save_sharded_preset(model, str(target), format="huggingface", durable=True, progress=False)
    (message,) = _messages(warned)
    assert f"removed {partial!r}" in message
    (record,) = [n for n in beside if n.startswith(".hf.owner-")]
    token = record[len(".hf.owner-"):-len(".json")]
    assert beside == sorted([record, f".hf.partial-{token}"])
    assert os.listdir(tmp_path) == ["hf"]

    (renamed,) = [i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(target)]
    folder = events[renamed][1]
    flushed = [e[1] for e in events[:renamed] if e[0] == "fsync"]
    paths = _preset_paths(target)
    assert {"config.json", "model.safetensors.index.json", "model-00001-of-00001.safetensors"} <= set(paths)
    assert not [p for p in paths if os.path.normpath(os.path.join(folder, p)) not in flushed]
    assert ("fsync", str(tmp_path)) in events[renamed + 1:]
    weights = os.path.join(folder, "model-00001-of-00001.safetensors")
    assert ("fsync", weights) in events[:events.index(("hash",))]
    keras.distribution.set_distribution(None)
    _assert_same_weights(model, load_sharded_preset(str(target), mesh=(2, 4), verify=True, progress=False))
