"""Loading under `jax.distributed` with several processes on this machine.

Each process gets a share of 8 simulated CPU devices and joins a job over
loopback (gloo collectives). The checks: every process reads only byte
ranges its own devices hold, nothing twice; over the job every byte of the
weights is read exactly once (blocks held on several processes are read in
parts and exchanged between the devices); the global model is one model, and
a jitted forward pass gives the single-process logits.
"""

import functools
import hashlib
import json
import os
import pathlib
import sys

import keras
import keras_hub
import numpy as np
import pytest

import keras_hub_dist
from conftest import quantize_collecting_once
from keras_hub_dist.formats.keras_h5 import build_index
from tests.multiprocess_jobs import block_byte_ranges, merge_ranges, run_job

WORKER = pathlib.Path(__file__).with_name("multiprocess_worker.py")

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="needs Linux (/proc) and loopback"
)


@pytest.fixture(scope="module")
def tiny_preset(tmp_path_factory):
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=256, num_layers=2, num_query_heads=8,
        num_key_value_heads=4, hidden_dim=64, intermediate_dim=128,
    )
    path = tmp_path_factory.mktemp("mp") / "tiny_llama"
    backbone.save_to_preset(str(path))
    return str(path)


@pytest.fixture(scope="module")
def stock_int8(tiny_preset):
    """Stock, one process: from_preset, then quantize("int8")."""
    keras.distribution.set_distribution(None)
    backbone = keras_hub.models.Backbone.from_preset(tiny_preset)
    quantize_collecting_once(backbone, "int8")
    return {v.path: np.asarray(v.value) for v in backbone.weights}


def _check_quantized(reports, reference, file_bytes, split_over_processes):
    """Every block each process holds is stock's quantized block, bitwise,
    from the file bytes of its own blocks (the statistics of row-split
    kernels came from the other processes through the collective)."""
    seen = {}
    for report in reports:
        for path, blocks in report["quantized_digests"].items():
            for block, digest in blocks.items():
                index = tuple(slice(*map(int, b.split(":"))) for b in block.split(","))
                expected = hashlib.sha256(reference[path][index].tobytes()).hexdigest()
                assert digest == expected, (path, block)
                seen.setdefault(path, set()).add(block)
        if split_over_processes:
            assert report["quantized_read_bytes"] < file_bytes
    assert set(seen) == set(reference)


@pytest.fixture(scope="module")
def hf_preset(tmp_path_factory):
    """A Hugging Face Llama checkpoint in 2 shards, and its tensors."""
    from tests.formats.hf import dense
    from tests.formats.hf.writer import write_hf_checkpoint

    config, tensors = dense.hf_checkpoint("llama", tied=False, dtype="float32", seed=4)
    config["vocab_size"] = 256
    rng = np.random.default_rng(4)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = rng.standard_normal((256, 64), dtype=np.float32) * 0.5
    path = tmp_path_factory.mktemp("mp_hf") / "hf_llama"
    return write_hf_checkpoint(str(path), config, tensors, num_shards=2), tensors


# The jobs: (processes, local devices, mesh) -> whether the Hugging Face
# checkpoint is loaded too, after the KerasHub preset (None: not loaded;
# True: with every kernel transposed on the devices, as large ones are).
# One job per row: each process starts Python, JAX, Keras and KerasHub once.
# A compressed-tensors W4A16 checkpoint (llmcompressor's, tests/data) is
# loaded last by the job of PREQUANTIZED_JOB.
PREQUANTIZED = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "prequantized", "ct_w4a16")
PREQUANTIZED_JOB = (2, 4, "1x8")
JOBS = {(2, 4, "1x8"): False, (2, 4, "2x4"): True, (4, 2, "1x8"): None}


@pytest.fixture(scope="module")
def jobs(tiny_preset, hf_preset, tmp_path_factory):
    """Runs a job of `JOBS` on first use: `jobs(num_processes,
    local_devices, mesh)` -> `(out_dir, {load name: reports})`."""
    done = {}

    def run(num_processes, local_devices, mesh):
        key = (num_processes, local_devices, mesh)
        if key not in done:
            loads = [{"name": "keras", "preset": tiny_preset, "extras": True}]
            if JOBS[key] is not None:
                loads.append({"name": "huggingface", "preset": hf_preset[0],
                              "device_transpose_min_bytes": 0 if JOBS[key] else None})
            if key == PREQUANTIZED_JOB:
                loads.append({"name": "prequantized", "preset": PREQUANTIZED})
            out_dir = tmp_path_factory.mktemp(f"mp_{num_processes}_{mesh}")
            reports = run_job(WORKER, num_processes, local_devices,
                              [mesh, out_dir, json.dumps(loads)], out_dir)
            done[key] = out_dir, {
                load["name"]: [{**r, **r["loads"][load["name"]]} for r in reports]
                for load in loads
            }
        return done[key]

    return run


@functools.cache  # one stock build for the three jobs
def _dataset_index(preset):
    return {e.path: e.source.dataset for e in build_index(
        keras_hub.models.Backbone.from_preset(preset),
        os.path.join(preset, "model.weights.h5"),
    ).entries}


def _reference_logits(preset, mesh):
    batch, model = (int(x) for x in mesh.split("x"))
    backbone = keras_hub_dist.load_sharded_preset(preset, mesh=(batch, model),
                                                  progress=False)
    token_ids = (np.arange(16, dtype="int32").reshape(2, 8) * 7) % 64  # every vocabulary here
    outputs = backbone({"token_ids": token_ids, "padding_mask": np.ones_like(token_ids)})
    return np.asarray(outputs)


@pytest.mark.parametrize(
    "num_processes,local_devices,mesh",
    [(2, 4, "1x8"), (2, 4, "2x4"), (4, 2, "1x8")],
)
def test_each_process_reads_only_its_shards(
    tiny_preset, stock_int8, jobs, num_processes, local_devices, mesh
):
    out_dir, reports = jobs(num_processes, local_devices, mesh)
    reports = reports["keras"]
    index = _dataset_index(tiny_preset)
    file_bytes = sum(d.nbytes for d in index.values())
    all_datasets = merge_ranges((d.offset, d.offset + d.nbytes) for d in index.values())
    seen_devices = []
    job_reads = []
    for process_id, report in enumerate(reports):
        assert report["process_index"] == process_id
        assert report["process_count"] == num_processes
        assert report["device_count"] == 8
        assert len(report["local_device_ids"]) == local_devices
        seen_devices += report["local_device_ids"]
        expected = []
        expected_bytes = 0
        for path, held in report["held"].items():
            dataset = index[path]
            for block in held["blocks"]:
                ranges = block_byte_ranges(dataset, block)
                expected += ranges
                expected_bytes += sum(b - a for a, b in ranges)
        read = [(offset, offset + n) for offset, n in report["reads"]]
        job_reads += read
        # Only bytes its own devices hold, none twice, and less than the file.
        held = merge_ranges(expected)
        assert all(any(a <= start and end <= b for a, b in held) for start, end in read), process_id
        assert sum(n for _, n in report["reads"]) == sum(b - a for a, b in merge_ranges(read))
        assert sum(n for _, n in report["reads"]) < file_bytes
    # Over the job, every byte of the weights is read exactly once: blocks
    # that devices of several processes hold (the batch axis of 2x4 spans
    # them; replicated norms everywhere) are read in parts and exchanged.
    assert merge_ranges(job_reads) == all_datasets
    assert sum(b - a for a, b in job_reads) == file_bytes
    assert len(set(seen_devices)) == 8  # disjoint local devices, one global mesh
    _check_quantized(reports, stock_int8, file_bytes, mesh == "1x8")

    reference = _reference_logits(tiny_preset, mesh)
    for process_id in range(num_processes):
        logits = np.load(out_dir / f"logits_keras_{process_id}.npy")
        np.testing.assert_allclose(logits, reference, rtol=1e-5, atol=1e-5)

    # Distributed initializer: each process drew its blocks of the one table,
    # bitwise the single-process draw under the same layout.
    with keras.distribution.distribution().scope():
        table = np.asarray(keras_hub_dist.DistributedVarianceScaling(
            seed=5, path="token_embedding/embeddings")((256, 64)))
    blocks_seen = set()
    for report in reports:
        assert report["table_sharding"] == reports[0]["table_sharding"]
        for block, values in report["table_blocks"].items():
            (r0, r1), (c0, c1) = (map(int, b.split(":")) for b in block.split(","))
            np.testing.assert_array_equal(np.asarray(values, np.float32),
                                          table[r0:r1, c0:c1])
            blocks_seen.add((r0, r1, c0, c1))
    assert sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in blocks_seen) == 256 * 64



@pytest.mark.parametrize("mesh,device_transposes", [("1x8", False), ("2x4", True)])
def test_hugging_face_checkpoint_each_process_reads_only_its_share(
    hf_preset, jobs, mesh, device_transposes
):
    """The same guarantees for a Hugging Face checkpoint: each process reads
    only bytes of the blocks its devices hold (transposed kernels included),
    the job every byte once, and the model computes the single-process
    logits. On 2x4 every block is held on both processes (exchanged), and
    every kernel is transposed on the devices, as large ones are."""
    assert JOBS[2, 4, mesh] is device_transposes
    preset, tensors = hf_preset
    out_dir, reports = jobs(2, 4, mesh)
    reports = reports["huggingface"]
    file_bytes = sum(t.nbytes for t in tensors.values())
    header_bytes = 0
    for name in os.listdir(preset):
        if name.endswith(".safetensors"):
            with open(os.path.join(preset, name), "rb") as f:
                header_bytes += 8 + int.from_bytes(f.read(8), "little")
    total = 0
    for report in reports:
        held_bytes = sum(
            int(np.prod([b - a for a, b in block])) * 4
            for held in report["held"].values()
            for block in held["blocks"]
        )
        read_bytes = sum(n for _, n in report["reads"])
        assert read_bytes <= held_bytes  # its own blocks (or parts of them)
        assert read_bytes < file_bytes
        # ... and each file's header once: its length, then the JSON.
        assert sum(n for _, n in report["header_reads"]) == header_bytes
        total += read_bytes
    assert total == file_bytes  # every byte once over the job, norms included
    reference = _reference_logits(preset, mesh)
    for process_id in range(2):
        logits = np.load(out_dir / f"logits_huggingface_{process_id}.npy")
        np.testing.assert_allclose(logits, reference, rtol=1e-5, atol=1e-5)


def test_prequantized_checkpoint_each_process_reads_only_its_share(jobs):
    """A pre-quantized (int4, compressed-tensors) checkpoint over 2
    processes: each reads less than the file and under half of it plus
    the group scales some of its blocks share with the other's, the job
    reads each tensor byte once (a group's scales at most twice), and both
    compute the single-process logits, int4 layers and all."""
    out_dir, reports = jobs(*PREQUANTIZED_JOB)
    reports = reports["prequantized"]
    with open(os.path.join(PREQUANTIZED, "model.safetensors"), "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    # Every tensor but compressed-tensors' `weight_shape` records (the
    # config's shapes say the same).
    data_bytes = sum(
        end - start for name, t in header.items() if name != "__metadata__"
        and not name.endswith("weight_shape") for start, end in [t["data_offsets"]]
    )
    read = [sum(n for _, n in report["reads"]) for report in reports]
    assert all(r < 0.75 * data_bytes for r in read), (read, data_bytes)
    job_reads = [(o, o + n) for report in reports for o, n in report["reads"]]
    assert sum(b - a for a, b in merge_ranges(job_reads)) == data_bytes, (merge_ranges(job_reads), data_bytes)
    assert data_bytes <= sum(read) <= 1.01 * data_bytes, (read, data_bytes)
    reference = _reference_logits(PREQUANTIZED, PREQUANTIZED_JOB[2])
    for process_id in range(2):
        logits = np.load(out_dir / f"logits_prequantized_{process_id}.npy")
        np.testing.assert_allclose(logits, reference, rtol=1e-5, atol=1e-5)
