"""A job's step time, ESTIMATED from the target compiler's program and the chip's peaks.

Nothing runs: the time is a roofline. Compute is the program's FLOPs over
the chip's peak bf16 FLOP/s, memory its HBM bytes over the HBM bandwidth,
communication the bytes each device sends in the collectives of the
compiled HLO (`jobs.collectives`) over half the chip's bidirectional
interconnect bandwidth (one direction). Two bounds: `overlapped` = the
largest of the three (all overlap perfectly), `serial` = their sum (none
overlap). The FLOPs are the dots of the compiled HLO, loop trips included
where known (XLA's `cost_analysis()` counts a loop body once, and XLA:GPU
gives none); the bytes are the TPU compiler's `bytes accessed`, and where
there is none (GPU) the program's arguments and outputs read and written
once, a lower bound. The TPU compiler's own `optimal_seconds` is reported
where it is positive (it came out negative for some programs).

`fit`: one train step; tokens/s/chip and MFU by MaxText's
`calculate_tflops_training_per_device` (its general decoder branch:
6 x weight FLOPs + causal attention, per device; no sliding-window
discount). `generate`: the program is the prompt pass and a decode loop of
unknown length; one decode step is the weights and KV cache read once per
token (the HBM floor; for stock, whose cache XLA lays out, the cache split
as this package splits it) against 2 x parameters x rows FLOPs, and the
prompt pass is the rest of the program (its loops once each, where their
trips are not known).

Example:

```python
plan = keras_hub_dist.plan_memory("llama3_8b_en", (1, 8), target="v6e-8", job="fit")
plan.step_time.overlapped_s, plan.step_time.mfu
```
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from keras_hub_dist.jobs.chips import Chip
from keras_hub_dist.jobs.collectives import Collective, HloSummary

__all__ = ["StepTime", "Roofline", "estimate", "maxtext_training_flops", "roofline"]


@dataclasses.dataclass(frozen=True)
class Roofline:
    """One program part's bounds (seconds) and what they came from.

    Attributes:
        flops: FLOPs per device.
        bytes: HBM bytes per device.
        wire_bytes: Collective bytes each device sends.
        compute_s: `flops` / peak.
        memory_s: `bytes` / HBM bandwidth.
        comms_s: `wire_bytes` / one direction of the interconnect.
        overlapped_s: max of the three.
        serial_s: their sum.
    """

    flops: float
    bytes: float
    wire_bytes: float
    compute_s: float
    memory_s: float
    comms_s: float
    overlapped_s: float
    serial_s: float


def roofline(flops: float, nbytes: float, wire: float, chip: Chip) -> Roofline:
    """The two bounds of a part from its FLOPs, HBM bytes and sent bytes."""
    compute = flops / chip.peak_bf16_flops
    memory = nbytes / chip.hbm_bandwidth
    comms = wire / (chip.interconnect_bandwidth / 2)
    return Roofline(flops, nbytes, wire, compute, memory, comms, max(compute, memory, comms), compute + memory + comms)


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A plan's ESTIMATED time (a roofline, not a measurement).

    Attributes:
        label: What is estimated.
        chip: The chip whose peaks were used.
        step: `fit`: one train step. `generate`: the prompt pass.
        decode: `generate`: one decode step (None for fit).
        tokens_per_s_per_chip: fit: batch x sequence / chips / overlapped
            step; generate: rows / decode step / chips.
        mfu: fit: MaxText's TFLOPs per device / (overlapped step x peak);
            None with LoRA (the formula counts a full fine-tune).
        compiler_optimal_s: libtpu's `optimal_seconds`, when positive.
        flops_source: Where the FLOPs and bytes came from.
        collectives: The compiled program's collectives.
        unknown_loops: Loops whose trips are not known (counted once).
        compiler_optimal_raw_s: libtpu's `optimal_seconds` as it gave it.
    """

    label: str
    chip: str
    step: Roofline
    decode: Roofline | None
    tokens_per_s_per_chip: float | None
    mfu: float | None
    compiler_optimal_s: float | None
    flops_source: str
    collectives: tuple[Collective, ...]
    unknown_loops: int
    compiler_optimal_raw_s: float | None = None

    def lines(self) -> list[str]:
        """The estimate as summary lines."""
        out = [f"ESTIMATED time ({self.label}; {self.chip} peaks; {self.flops_source}):"]
        parts = [("fit step" if self.decode is None else "prompt pass", self.step)]
        if self.decode is not None:
            parts.append(("one decode step", self.decode))
        for name, part in parts:
            out.append(
                f"  {name:<16} overlapped {_ms(part.overlapped_s)}, serial {_ms(part.serial_s)} "
                f"(compute {_ms(part.compute_s)}, HBM {_ms(part.memory_s)}, comms {_ms(part.comms_s)})"
            )
        if self.tokens_per_s_per_chip is not None:
            out.append(f"  tokens/s/chip    {self.tokens_per_s_per_chip:,.1f}" + (f", MFU {self.mfu:.1%} (MaxText's formula)" if self.mfu is not None else ""))
        if self.compiler_optimal_s is not None:
            out.append(f"  libtpu optimal_seconds {_ms(self.compiler_optimal_s)}")
        for c in self.collectives:
            out.append(f"  {c.kind:<18} over {'x'.join(c.axes) + f' ({c.group_size})':<14} x{c.count:<5} {c.bytes / 2**20:>10,.1f} MiB")
        return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms"


def _backbone_figures(backbone: Any) -> dict[str, float]:
    """Matmul parameters (the embedding once, as the logits' projection;
    an MoE's experts by top-k / experts), layers, query heads, head size."""
    experts = getattr(backbone, "num_experts", None) or 0
    top_k = getattr(backbone, "top_k", None) or getattr(backbone, "num_experts_per_tok", None) or experts
    params = 0.0
    embedded = False
    for weight in backbone.weights:
        shape = tuple(int(d) for d in weight.shape)
        if len(shape) < 2 or "lora" in weight.path:
            continue
        if "embedding" in weight.path and "token" in weight.path:
            if embedded:
                continue
            embedded = True
        size = math.prod(shape)
        if experts > 1 and shape[0] == experts and len(shape) >= 3:
            size = size * top_k / experts
        params += size
    heads = backbone.num_query_heads
    head_dim = getattr(backbone, "head_dim", None) or backbone.hidden_dim // heads
    return {"params": params, "layers": backbone.num_layers, "heads": heads, "head_dim": head_dim}


def maxtext_training_flops(backbone: Any, batch_size: int, sequence_length: int, devices: int) -> float:
    """MaxText's `calculate_tflops_training_per_device` (general decoder
    branch), in FLOPs per device: 3 x (2 x tokens x matmul parameters) +
    3 x layers x causal attention (4 x B x S^2 x heads x head_dim / 2)."""
    figures = _backbone_figures(backbone)
    rows = batch_size / devices
    weights = 6 * rows * sequence_length * figures["params"]
    attention = 3 * figures["layers"] * 4 * rows * sequence_length**2 * figures["heads"] * figures["head_dim"] / 2
    return weights + attention


def estimate(
    job: str, chip: Chip, hlo: HloSummary, cost: Mapping[str, float] | None, memory: Mapping[str, int],
    *, backbone: Any, batch_size: int, sequence_length: int, devices: int,
    weights_bytes: int, kv_cache_bytes: int | None,
) -> StepTime:
    """The estimate of one compiled job's program (see the module)."""
    if cost and cost.get("bytes accessed"):
        nbytes, source = float(cost["bytes accessed"]), "FLOPs: the compiled HLO's dots; bytes: libtpu's cost_analysis"
    else:
        nbytes = float(memory.get("argument_bytes", 0) + memory.get("output_bytes", 0))
        source = "FLOPs: the compiled HLO's dots; bytes: arguments + outputs once (no cost_analysis: a lower bound)"
    raw = cost.get("optimal_seconds") if cost else None
    optimal = raw if raw is not None and raw > 0 else None
    if job == "fit":
        step = roofline(hlo.dot_flops, nbytes, hlo.wire_bytes, chip)
        model_flops = maxtext_training_flops(backbone, batch_size, sequence_length, devices)
        lora = any("lora" in w.path for w in backbone.weights)
        # MaxText's formula counts a full fine-tune's 6 N: with LoRA the
        # frozen weights get no gradient, and an MFU by it would overstate.
        mfu = model_flops / (step.overlapped_s * chip.peak_bf16_flops) if step.overlapped_s and not lora else None
        tokens = batch_size * sequence_length / devices / step.overlapped_s if step.overlapped_s else None
        return StepTime("fit: one train step", chip.name, step, None, tokens, mfu, optimal, source, hlo.collectives, hlo.unknown_loops, raw)
    figures = _backbone_figures(backbone)
    decode_flops = 2 * figures["params"] * batch_size / devices
    decode_bytes = weights_bytes + (kv_cache_bytes or 0)
    decode = roofline(decode_flops, decode_bytes, 0.0, chip)
    prompt = roofline(max(hlo.dot_flops - decode_flops, 0.0), max(nbytes - decode_bytes, 0.0), hlo.wire_bytes, chip)
    tokens = batch_size / devices / decode.overlapped_s if decode.overlapped_s else None
    label = "generate: prompt pass (program less one decode step); decode step: weights + KV cache read once"
    return StepTime(label, chip.name, prompt, decode, tokens, None, optimal, source, hlo.collectives, hlo.unknown_loops, raw)
