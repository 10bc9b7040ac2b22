"""Benchmark: the bytes path of an S3 part upload (issue 30): botocore's
`upload_part` vs `storage.s3_writer.S3Writer.upload_part` (a SigV4-signed
urllib3 PUT of the caller's memoryview through the `RangeClient`).

moto's S3 server runs in a process of its own on loopback (no GIL shared
with the client). For each part size, each client uploads `--parts` parts
of random bytes one after another into one multipart upload (aborted
after); reported: the median wall time per part and the client's CPU time
per part (`time.process_time`, this process only: moto's hashing and
storing is the server's). botocore is given `bytes(view)` (it refuses a
memoryview: that copy is part of its cost); the writer the memoryview.

Usage (run under the machine's heavy-job lock):

    flock /tmp/khd-heavy.lock python benchmarks/bench_part_upload.py [--sizes 16 64] [--parts 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

_SERVER = """
import logging, sys, time
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
print("up", flush=True)
sys.stdin.read()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64], help="part sizes in MiB")
    parser.add_argument("--parts", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="each client this many times, alternating")
    args = parser.parse_args(argv)
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(port)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        endpoint = f"http://127.0.0.1:{port}"
        os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint})
        import boto3

        from keras_hub_dist.storage.s3_writer import S3Writer

        boto = boto3.client("s3", endpoint_url=endpoint)
        boto.create_bucket(Bucket="bench")
        writer = S3Writer("s3://bench/parts")
        for size_mib in args.sizes:
            view = memoryview(bytearray(os.urandom(size_mib << 20)))
            clients = {
                "botocore upload_part": lambda key, uid, n: boto.upload_part(
                    Bucket="bench", Key=key, UploadId=uid, PartNumber=n, Body=bytes(view))["ETag"],
                "S3Writer.upload_part": lambda key, uid, n: writer.upload_part(
                    key.removeprefix("parts/"), uid, n, view),
            }
            for _ in range(args.rounds):
                for label, upload in clients.items():
                    key = "parts/w.bin"
                    uid = boto.create_multipart_upload(Bucket="bench", Key=key)["UploadId"]
                    walls, cpu0 = [], time.process_time()
                    for n in range(1, args.parts + 1):
                        start = time.perf_counter()
                        upload(key, uid, n)
                        walls.append(time.perf_counter() - start)
                    cpu = (time.process_time() - cpu0) / args.parts
                    boto.abort_multipart_upload(Bucket="bench", Key=key, UploadId=uid)
                    wall = statistics.median(walls)
                    print(f"{size_mib:3d} MiB  {label:22s} wall/part {wall * 1e3:6.0f} ms "
                          f"({(size_mib << 20) / wall / 1e6:5.0f} MB/s)  client CPU/part "
                          f"{cpu * 1e3:5.0f} ms", flush=True)
        writer.close()
    finally:
        server.stdin.close()
        server.wait(10)


if __name__ == "__main__":
    main()
