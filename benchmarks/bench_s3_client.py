"""Benchmark: the CPU cost of the botocore client each S3 writer creates.

`storage.s3_writer.S3Writer` takes a fresh botocore session per writer, so
credentials and configuration are read afresh; the sessions share one data
loader (`s3_writer._botocore_session`), which keeps S3's parsed service
models. Side by side in one process: a client from a session of its own
(`botocore.session.get_session()`, what the writer did before) and from a
session with the shared loader. Reported: the median CPU seconds per client
(`time.process_time`) over `--repeats` clients each, after one warm-up
client (imports and the one parse), and the ratio. Nothing is contacted.

Usage:

    python benchmarks/bench_s3_client.py [--repeats 21]
"""

from __future__ import annotations

import argparse
import statistics
import time

import botocore.session

from keras_hub_dist.storage import s3_writer


def _client(session) -> None:
    session.create_client("s3", region_name="us-east-1", endpoint_url="http://127.0.0.1:9")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    cases = {
        "own session (before)": botocore.session.get_session,
        "shared loader (ours)": s3_writer._botocore_session,
    }
    medians = {}
    for name, session in cases.items():
        _client(session())
        times = []
        for _ in range(args.repeats):
            start = time.process_time()
            _client(session())
            times.append(time.process_time() - start)
        medians[name] = statistics.median(times)
        print(f"{name}: median {medians[name]:.4f} CPU-s per client over {args.repeats}")
    before, ours = medians.values()
    print(f"ours / before: {ours / before:.2f}x")


if __name__ == "__main__":
    main()
