"""Benchmark: fuzzing the checkpoint parsers (issue 56), 10,000+ cases each.

The strategies and targets of tests/fuzzing.py (hypothesis, derandomized:
the same cases each run) over the five parsers: the safetensors header
(`validate_header`), the safetensors index (`checkpoint_files`), the Keras
sharded-weights index (`weights_files`), the HDF5 indexer (`read_datasets`
on h5py-written files, some truncated) and the config parser
(`read_config`). Each case must be accepted or refused with a
`PresetError`; per case, a wall-clock bound (`--case-seconds`, by
`SIGALRM`) and an allocation bound (`--case-mb`, tracemalloc's peak: Python
and NumPy allocations, not libhdf5's own heap) are checked.

Printed per parser: cases, seconds, cases/s, accepted, PresetError, other
exceptions, cases over the time bound, cases over the allocation bound,
the largest per-case peak (MB). Exit status 1 if any case broke a rule.

Usage: `python benchmarks/bench_fuzz.py [--cases 10000] [--only hdf5_indexer]`
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import sys
import tempfile
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hypothesis import HealthCheck, given, settings  # noqa: E402

from keras_hub_dist.errors import PresetError  # noqa: E402
from tests.fuzzing import STRATEGIES, TARGETS, Targets  # noqa: E402


class _Hang(BaseException):
    """Raised by the alarm: a case ran past its time bound."""


def _alarm(signum, frame):
    raise _Hang()


def run(name: str, cases: int, targets: Targets, case_seconds: float, case_mb: float) -> dict:
    tally: collections.Counter = collections.Counter()
    examples: dict[str, str] = {}
    peak_mb = 0.0
    target = getattr(targets, name)

    @settings(max_examples=cases, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(STRATEGIES[name])
    def one(case):
        nonlocal peak_mb
        tracemalloc.start()  # around the parser only: generation is not the case's
        signal.setitimer(signal.ITIMER_REAL, case_seconds)
        try:
            tally[target(case)] += 1
        except PresetError:
            tally["refused"] += 1
        except _Hang:
            tally["hang"] += 1
            examples.setdefault("hang", repr(case)[:200])
        except Exception as e:  # a bug: reported, the run goes on
            tally["other"] += 1
            examples.setdefault(f"other {type(e).__name__}", f"{e!s:.100} <- {case!r:.200}")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            mb = tracemalloc.get_traced_memory()[1] / 2**20
            tracemalloc.stop()
        peak_mb = max(peak_mb, mb)
        if mb > case_mb:
            tally["over_memory"] += 1

    start = time.perf_counter()
    one()
    seconds = time.perf_counter() - start
    total = sum(tally[k] for k in ("accepted", "refused", "hang", "other"))
    return dict(name=name, cases=total, seconds=seconds, rate=total / seconds, peak_mb=peak_mb,
                examples=examples, **{k: tally[k] for k in ("accepted", "refused", "other", "hang", "over_memory")})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--only", choices=TARGETS, action="append")
    parser.add_argument("--case-seconds", type=float, default=5.0)
    parser.add_argument("--case-mb", type=float, default=64.0)
    args = parser.parse_args()
    signal.signal(signal.SIGALRM, _alarm)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        targets = Targets(folder)
        for name in args.only or TARGETS:
            rows.append(run(name, args.cases, targets, args.case_seconds, args.case_mb))
            r = rows[-1]
            print(f"{name}: {r['cases']} cases in {r['seconds']:.1f} s", file=sys.stderr)
    print("| parser | cases | s | cases/s | accepted | PresetError | other | over time | over 64 MB | max peak MB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['name']} | {r['cases']} | {r['seconds']:.1f} | {r['rate']:.0f} | {r['accepted']} | "
              f"{r['refused']} | {r['other']} | {r['hang']} | {r['over_memory']} | {r['peak_mb']:.2f} |")
    bad = False
    for r in rows:
        for kind, example in r["examples"].items():
            bad = True
            print(f"{r['name']}: {kind}: {example}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
