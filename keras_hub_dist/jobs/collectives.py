"""What a compiled program communicates and computes, read from its HLO text.

`read_hlo(compiled.as_text(), mesh_axis_sizes)` walks the partitioned
(per-device) HLO module a compiler produced: every all-gather, all-reduce,
reduce-scatter, all-to-all and collective-permute (the synchronous op or
the `-start` of an asynchronous pair), its bytes and the mesh axes it runs
over (from `replica_groups`), and the FLOPs of every `dot`; an op inside a
`while` loop counts once per trip where the trip count is known (the
compiler's `known_trip_count`, or a condition comparing the counter with
one constant), else once (and the loop is listed as unknown). XLA's own
`cost_analysis()` counts a loop body once; the GPU compiler gives none.

Example:

```python
from keras_hub_dist.jobs.collectives import read_hlo

hlo = read_hlo(compiled.as_text(), {"batch": 1, "model": 8})
hlo.collectives  # (Collective(kind='all-reduce', axes=('model',), count=1, ...), ...)
hlo.dot_flops    # per device
```
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

__all__ = ["Collective", "HloSummary", "read_hlo", "wire_bytes"]

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

_ITEMSIZE = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
    "s64": 8, "u64": 8, "bf16": 2, "f16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_ITEMSIZE, key=len, reverse=True)) + r")\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_CALLS = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    """The collectives of one kind over one set of mesh axes (per device).

    Attributes:
        kind: `"all-gather"`, `"all-reduce"`, ...
        axes: The mesh axes it runs over (`("model",)`), or `("group of N",)`
            where the replica groups name no axis.
        group_size: Devices per group.
        count: Ops executed (loop trips included where known).
        bytes: Their result bytes, summed (per device).
        wire_bytes: Bytes each device sends for them (ring algorithms).
    """

    kind: str
    axes: tuple[str, ...]
    group_size: int
    count: int
    bytes: int
    wire_bytes: float


@dataclasses.dataclass(frozen=True)
class HloSummary:
    """`read_hlo`'s answer.

    Attributes:
        collectives: Per kind and axes.
        dot_flops: FLOPs of the dots (2 x output elements x contraction),
            loop trips included where known.
        unknown_loops: `while` loops whose trip count is not known (their
            bodies counted once).
    """

    collectives: tuple[Collective, ...]
    dot_flops: float
    unknown_loops: int

    @property
    def wire_bytes(self) -> float:
        """All collectives' bytes sent per device."""
        return sum(c.wire_bytes for c in self.collectives)


def _bytes(type_text: str) -> int:
    return int(sum(math.prod(int(d) for d in dims.split(",") if d) * _ITEMSIZE[dtype]
                   for dtype, dims in _ARRAY.findall(type_text)))


def _dims(type_text: str) -> tuple[int, ...]:
    found = _ARRAY.search(type_text)
    return tuple(int(d) for d in found.group(2).split(",") if d) if found else ()


def wire_bytes(kind: str, result_bytes: float, group: int) -> float:
    """Bytes one device sends for one collective by a ring over `group`
    devices: all-gather and all-to-all (n-1)/n of the result, reduce-scatter
    (n-1) x its result (the shard), all-reduce 2(n-1)/n, a permute all."""
    if group <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (group - 1) / group * result_bytes
    if kind == "reduce-scatter":
        return (group - 1) * result_bytes
    if kind == "collective-permute":
        return float(result_bytes)
    return (group - 1) / group * result_bytes


def _group(line: str, sizes: Mapping[str, int]) -> tuple[tuple[str, ...], int]:
    names = list(sizes)
    mesh_form = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if mesh_form:
        axes = re.findall(r"'([^']+)'", mesh_form.group(2))
        declared = {a: int(n) for a, n in re.findall(r"'([^']+)'=(\d+)", mesh_form.group(1))}
        owner = _owners(declared, sizes)
        labels = tuple(dict.fromkeys(owner.get(a, a) for a in axes))
        return labels, math.prod(declared.get(a, 1) for a in axes)
    iota = re.search(r"replica_groups=\[([0-9,]+)\]<=\[", line)
    explicit = re.search(r"replica_groups=\{\{([0-9,\s]*)\}", line)
    if iota:
        size = int(iota.group(1).split(",")[-1])
    elif explicit:
        size = len([d for d in explicit.group(1).split(",") if d.strip()])
    elif "source_target_pairs" in line:
        return ("permute",), 2
    else:  # no groups: all devices
        size = math.prod(sizes.values())
    matches = [n for n in names if sizes[n] == size]
    if size == math.prod(sizes.values()):
        return tuple(n for n in names if sizes[n] > 1) or tuple(names), size
    return ((matches[0],) if len(matches) == 1 else (f"group of {size}",)), size


def _owners(declared: Mapping[str, int], sizes: Mapping[str, int]) -> dict[str, str]:
    """The mesh axis each of the compiler's axes is part of: the compiler
    may split an axis (`model`=8 as 2 x 4), in order, so its axes are
    consumed in order until their product is the mesh axis's size."""
    owner: dict[str, str] = {}
    pending = list(declared.items())
    for name, size in sizes.items():
        product = 1
        while pending and (product < size or pending[0][1] == 1 and product == size == 1):
            axis, n = pending.pop(0)
            owner[axis] = name
            product *= n
        if product != size:
            return {}
    return owner


def read_hlo(text: str, mesh_axis_sizes: Mapping[str, int]) -> HloSummary:
    """Reads a compiled (partitioned) HLO module's text; see the module."""
    computations: dict[str, list[str]] = {}
    params: dict[str, dict[str, str]] = {}
    entry = None
    current = None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = header.group(1)
            computations[current] = []
            params[current] = dict(re.findall(r"([\w.\-]+):\s*([^,()]+\[[0-9,]*\][^,()]*|\([^)]*\))", header.group(2)))
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is not None and line.strip() == "}":
            current = None
            continue
        if current is not None:
            computations[current].append(line)
    if entry is None:
        return HloSummary((), 0.0, 0)
    # How many times each computation runs per execution of the program.
    runs: dict[str, float] = {entry: 1.0}
    unknown = 0
    order = [entry]
    seen = {entry}
    while order:
        name = order.pop(0)
        for line in computations.get(name, ()):
            callees = _CALLS.findall(line)
            branches = _BRANCHES.search(line)
            if branches:
                callees += [("branch", b.strip().lstrip("%")) for b in branches.group(1).split(",") if b.strip()]
            if not callees:
                continue
            trips = 1
            if " while(" in line:
                trips = _trip_count(line, computations)
                if trips is None:
                    unknown += 1
                    trips = 1
            for role, callee in callees:
                if callee not in computations:
                    continue
                factor = trips if role in ("body", "condition") else 1
                runs[callee] = runs.get(callee, 0.0) + runs[name] * factor
                if callee not in seen:
                    seen.add(callee)
                    order.append(callee)
    totals: dict[tuple[str, tuple[str, ...], int], list[float]] = {}
    flops = 0.0
    for name, lines in computations.items():
        times = runs.get(name, 0.0)
        if not times:
            continue
        shapes = dict(params.get(name, {}))
        for line in lines:
            found = _INSTRUCTION.match(line)
            if not found:
                continue
            result, type_text, op, rest = found.groups()
            shapes[result] = type_text
            kind = op[:-6] if op.endswith("-start") else op
            if kind in KINDS:
                axes, size = _group(line, mesh_axis_sizes)
                nbytes = _bytes(type_text)
                if op.endswith("-start") and type_text.startswith("("):
                    # An async start's result is (operand, result[, ...]): the result.
                    parts = _ARRAY.findall(type_text)
                    nbytes = _bytes(" ".join(f"{d}[{s}]" for d, s in parts[len(parts) // 2:][:1])) if parts else 0
                entry_totals = totals.setdefault((kind, axes, size), [0, 0, 0.0])
                entry_totals[0] += times
                entry_totals[1] += nbytes * times
                entry_totals[2] += wire_bytes(kind, nbytes, size) * times
            elif op == "convolution":
                # The TPU compiler writes a dot as a convolution: the lhs
                # feature dimension ('f' of dim_labels) is contracted.
                operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
                labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", rest)
                if operands and labels and operands[0] in shapes:
                    lhs = _dims(shapes[operands[0]])
                    position = labels.group(1).find("f")
                    k = lhs[position] if 0 <= position < len(lhs) else 1
                    groups = re.search(r"feature_group_count=(\d+)", rest)
                    k //= int(groups.group(1)) if groups else 1
                    window = re.search(r"window=\{size=([0-9x]+)", rest)
                    k *= math.prod(int(w) for w in window.group(1).split("x")) if window else 1
                    flops += 2.0 * math.prod(_dims(type_text)) * k * times
            elif op == "dot":
                operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
                contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", rest)
                if operands and contracting and operands[0] in shapes:
                    lhs = _dims(shapes[operands[0]])
                    k = math.prod(lhs[int(i)] for i in contracting.group(1).split(",") if i and int(i) < len(lhs))
                    flops += 2.0 * math.prod(_dims(type_text)) * k * times
    collectives = tuple(
        Collective(kind, axes, size, int(count), int(nbytes), wire)
        for (kind, axes, size), (count, nbytes, wire) in sorted(totals.items())
    )
    return HloSummary(collectives, flops, unknown)


def _trip_count(line: str, computations: Mapping[str, list[str]]) -> int | None:
    known = _TRIP.search(line)
    if known:
        return int(known.group(1))
    condition = re.search(r"condition=%([\w.\-]+)", line)
    body = computations.get(condition.group(1), []) if condition else []
    constants = [int(c) for text in body for c in re.findall(r"\bs32\[\]\S*\s+constant\((\d+)\)", text)]
    compares = [text for text in body if " compare(" in text]
    if len(constants) == 1 and len(compares) == 1 and "direction=LT" in compares[0]:
        return constants[0]
    return None
