"""Hand-written layout rules for the families whose KerasHub backbone has none.

`layouts.get_layout_map` uses KerasHub's own `get_layout_map` where a
backbone class has one and the rules here otherwise; `extra_rules` adds to
either. Keys are `keras.distribution.LayoutMap` regexes (matched with
`re.fullmatch`, so each variable path must match at most one key); values
are one mesh-axis entry per dimension, or an `ExpertBank` for the stacked
expert weights of a Mixture-of-Experts layer.

Conventions (those of KerasHub's Gemma and Llama maps): every large matrix
puts the model axis on one dimension and the data axis on another (storage
sharding over the batch axis, as KerasHub does); embeddings are split along
the vocabulary; small vectors (biases, per-head scalars, per-head q/k norm scales) stay
replicated, and so do the norm scales of the Llama-convention families;
Gemma's hidden-width norm scales are split on the model axis (below: "The
residual stream"). Per family:

- Gemma 3: Gemma's rules. Gemma 4 (`gemma4`): Gemma's rules plus the
  per-layer embeddings (PLE: a `(vocabulary, layers * width)` table split
  along the vocabulary like the token table, its projection and the per-layer
  gate / up projections split along their wide dimension), the MoE router
  (hidden dimension) and the expert bank of the 26B-A4B, and the named
  presets' image tower (Gemma-style blocks, position table split along
  positions) and audio tower (conformer blocks; every kernel split along
  its wide dimension).
- Qwen 3, Mistral: Llama's rules. Qwen 3.5 (`qwen3_5`): Llama's rules for
  full-attention and FFN layers, plus the Gated DeltaNet layers: the fused
  q/k/v, z, a and b input projections split along their output (head)
  dimension, the output projection along its input, and the depthwise conv
  kernel along its channels (matching `in_proj_qkv`'s output). Qwen 3.5 MoE
  (`qwen3_5_moe`): the same, with the shared expert as a dense FFN and the
  routed experts as an expert bank. Both cover the presets' vision tower
  (fused qkv and fc1 split along their output, proj and fc2 along their
  input, as Megatron-style tensor parallelism does).
- Mixtral (`mixtral`), gpt-oss (`gpt_oss`): Llama's attention rules, the
  router along the hidden dimension, the expert banks (and gpt-oss's
  per-expert biases) along the expert axis (below). gpt-oss's attention sinks and
  q/k/v biases are per-head vectors and stay replicated.
- Qwen 3 MoE (`qwen3_moe`): KerasHub's map, which covers attention, the
  embeddings and (through its `feedforward_gate_dense` key) the router, but
  not the expert banks, which are 97% of the 30B-A3B's weights and would be
  replicated on every device: `extra_rules` adds them.

Attention on heads (measured, not the default). KerasHub's Llama map (and
Llama 3, Qwen 2.5, Qwen MoE, Qwen 3 MoE: the same keys, which the Llama
families here copy) splits the q/k/v kernels `(hidden, heads, head_dim)` on
the hidden dimension `(model, data, None)`. That does not make each device
compute every head's attention: XLA all-reduces the q/k/v projections
(`f32[8, 512, 32, 128]` per device at Llama-3-8B width, fit 8 x 512 on
(1, 8)), then splits the scores on heads (`f32[8, 4, T, T]` per device),
because the output kernel `(model, None, data)` is split on heads; and the
hidden split carries into the residual stream and the norms, so the
activations kept for the backward pass are split 8 ways. Splitting q/k/v on
heads instead (`llama_head_rules`, Megatron-style) leaves the residual
stream replicated: XLA temporaries per device of that fit step 1,519 vs
831 MiB (1.83x KerasHub's); with the norm scales on the model axis too
(which splits the stream again) 887 MiB (1.07x); generate 8 x 2048 1,118
MiB in all three (benchmarks/bench_head_layouts.py, XLA:CPU). So the maps
keep KerasHub's split, and `llama_head_rules` replaces a map's attention
entries for those who want Megatron's communication pattern. Gemma's q/k/v
kernels are `(heads, hidden, head_dim)`: its map splits heads already.

The residual stream (Gemma's norm scales: the default). KerasHub's Gemma
map leaves the RMS norm scales `(hidden,)` replicated, and XLA then keeps
the residual stream `(batch, tokens, hidden)` replicated over the model
axis: each device keeps every activation the backward pass needs in full.
`gemma_residual_rules` (added to the maps of `gemma`, `gemma3` and
`gemma4` by `extra_rules`) puts the pre / post attention and FFN norms, Gemma
4's `post_per_layer_input_norm` and `final_normalization` on the model
axis, which keeps the stream split on its hidden dimension between the
blocks, as KerasHub's Llama map already does through its hidden-split q/k/v
kernels. The per-head q/k norms `(head_dim,)` stay replicated (their axis
is not split). Measured, XLA:CPU, compile only (`plan_memory(...,
stock=True)` against ours; `benchmarks/bench_head_layouts.py --only
stock`): Gemma-7B width, 1 layer, bf16, fit 8 x 512 with Adam on (1, 8):
temporaries 3,290 -> 2,705 MiB per device (0.82x; per layer, 2 layers
minus 1, 869 -> 509 MiB, 0.59x; the rest is the 256k-vocabulary logits);
generate 8 x 2048 1,289 MiB with and without; on (2, 4) and (8, 1) the
same figures with and without (on (2, 4) XLA does not keep the split; on
(8, 1) there is no model axis to split on). The Llama-convention maps get
no such rule: their stream is split already, and the norm scales on the
model axis changed nothing measurable (Llama-3-8B width, fit 1,624 MiB and
generate 741 MiB on (1, 8) either way; fit on (2, 4) 2,732 -> 2,708 MiB).

The vocabulary tables (the default, `vocabulary_rules`). KerasHub's maps
split the token embedding `(vocabulary, hidden)` as `(model, data)` (and
the package split the untied output table `(hidden, vocabulary)` as
`(data, model)`). In a fit step on a mesh whose data axis is over 1, each
device then computes the tables' gradients for its half (or eighth) of the
batch at the size of its model-axis shard, `f32[vocabulary / 4, hidden]`
on (2, 4) where (1, 8) holds `[vocabulary / 8, hidden]`, before they are
reduced over the data axis; on (8, 1) the whole table. Split along the
vocabulary over both axes (a `specs.MergedAxesLayout`: a Keras layout
takes one mesh axis per dimension), each device computes its eighth of
the vocabulary for every token (the batch's hidden states, bf16, are
gathered instead). Measured (`plan_memory`, XLA:CPU, bf16, 2 layers,
total per device, before -> after, (1, 8)): Adam fit 8 x 512 on (2, 4)
Llama-3-8B width 3,416 -> 2,884 MiB (3,090), Gemma-7B 4,964 -> 3,821
(4,172), LoRA r=8 2,758 -> 2,310 (2,248), `remat="full"` 8 x 2048 4,826 ->
4,636 (4,437); on (8, 1) Llama-3-8B 9,769 -> 4,765. `generate` 8 x 1024:
Llama-3-8B on (2, 4) 1,236 -> 1,260 ((1, 8): 1,292), Gemma-7B 1,577 ->
1,546; on (8, 1) 1,804 -> 1,982. Where the mesh does not divide the
vocabulary, a table keeps KerasHub's split (a `LayoutFallback`).

Experts. KerasHub's MoE layers (Mixtral, Qwen 3 / 3.5 MoE, gpt-oss, Gemma 4)
run every expert on every token as batched einsums over stacked weights
(`"th,ehm->etm"`, then `"eti,eih->eth"`) and sum the router-weighted outputs
over the expert axis. An expert bank is therefore split along the expert
axis, over both mesh axes (data-major, a `specs.MergedAxesLayout` as the
vocabulary tables'), every other dimension whole: each device runs its own
experts' gate, up and down matmuls on every token with no communication
but the tokens' gather over the data axis, and the weighted sum over
experts becomes one reduction of the `(tokens, hidden)` output, exactly
like a tensor-parallel dense FFN. No token all-to-all is needed, because
KerasHub does not dispatch tokens; the fused gate/up kernels of Qwen and
gpt-oss (`2 * ffn` wide, split in halves or interleaved inside each
expert) stay whole on their device, and so do gpt-oss's per-expert biases'
rows. Before, the model axis alone split the experts and the data axis the
hidden dimension (Mixtral's: the FFN one): with the batch split over the
data axis, XLA gathered each bank over it, a quarter of the experts whole
on every device of (2, 4) (or resharded it, an all-to-all of a device's
share, to compute it as (1, 8) does), and on (8, 1) every expert whole.
Measured (`plan_memory`, 2 layers, bf16, total per device, before -> now,
(1, 8)): Qwen-3-235B-A22B width, Adam fit 8 x 512 on (2, 4) 14,172 ->
12,249 MiB (13,602), on (8, 1) 33,785 -> 14,264; generate 8 x 1024 on
(2, 4) 6,331 -> 4,039 (5,618); gpt-oss-120b fit on (2, 4) 23,353 -> 18,846
(20,415); Gemma 4 26B-A4B generate 3,422 -> 2,550 (3,242). More in
BENCHMARKS.md.

Where the mesh does not divide the expert count, the model axis alone
splits the experts and the data axis another dimension (`ExpertBank.
otherwise`, a `LayoutFallback`); where the model axis does not divide it
either (Mixtral's 8 experts on 16 devices) the bank moves to the
expert-FFN (intermediate) dimension: each device then holds a slice of
every expert, the gate/up/down matmuls stay local per slice and the down
projection's partial sums need the same single all-reduce, as in
Megatron-style dense tensor parallelism (a fused gate/up kernel is then
split across its gate/up halves, which XLA reshuffles). When the model
axis divides neither, `expert_axes` raises a `LayoutError` naming the
variable and the numbers: replicating an expert bank would put most of the
model on every device.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from keras_hub_dist.errors import LayoutError
from keras_hub_dist.plan import specs

__all__ = [
    "ExpertBank",
    "VocabularyTable",
    "expert_axes",
    "extra_rules",
    "family_rules",
    "hand_written_families",
    "llama_head_rules",
    "vocabulary_rules",
]

Axes = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class ExpertBank:
    """The rule of a stacked expert weight `(experts, ..., ...)`.

    Attributes:
        axes: The requested axes: the experts over both mesh axes
            (data-major), every other dimension whole.
        otherwise: The axes where the mesh does not divide the expert count:
            the model axis on `expert_dim`, the data axis on another
            dimension.
        expert_dim: The dimension indexing experts.
        ffn_dim: The expert-FFN (intermediate) dimension, where the model
            axis moves when it does not divide the expert count either.
    """

    axes: Axes
    otherwise: Axes
    expert_dim: int
    ffn_dim: int


def _expert_bank(model: str, data: str, otherwise: Axes, *, ffn_dim: int) -> ExpertBank:
    """An `ExpertBank` with its experts (dimension 0) over both axes, else
    `otherwise`."""
    both = ((data, model),) + (None,) * (len(otherwise) - 1)
    return ExpertBank(both, otherwise, expert_dim=0, ffn_dim=ffn_dim)


@dataclasses.dataclass(frozen=True)
class VocabularyTable:
    """The rule of a vocabulary table: the token embedding `(vocabulary,
    hidden)` or the untied output table `(hidden, vocabulary)`.

    Attributes:
        axes: The requested axes: the vocabulary over both mesh axes.
        otherwise: The axes where the mesh does not divide the vocabulary
            (KerasHub's: the vocabulary on the model axis, the hidden
            dimension on the data axis).
    """

    axes: Axes
    otherwise: Axes


Rules = dict[str, "Axes | ExpertBank | VocabularyTable"]


def gemma_rules(model: str, data: str) -> Rules:
    # Same keys and axes as `keras_hub.models.GemmaBackbone.get_layout_map`:
    # attention kernels are (heads, hidden, head_dim) / (heads, head_dim,
    # hidden), the FFN kernels (hidden, ffn) / (ffn, hidden).
    return {
        "token_embedding/embeddings": (model, data),
        "decoder_block.*attention.*(query|key|value).kernel": (model, data, None),
        "decoder_block.*attention_output.kernel": (model, None, data),
        "decoder_block.*ffw_gating.kernel": (data, model),
        "decoder_block.*ffw_gating_2.kernel": (data, model),
        "decoder_block.*ffw_linear.kernel": (model, data),
    }


_LLAMA_QKV = "transformer_layer.*self_attention.*(query|key|value).kernel"
_LLAMA_OUTPUT = "transformer_layer.*attention_output.kernel"


def llama_head_rules(model: str, data: str) -> Rules:
    """Llama-convention attention split on heads: an opt-in (module doc).

    q/k/v kernels `(hidden, heads, head_dim)` (Qwen 3.5's query `(hidden,
    heads, 2 * head_dim)`) get `(data, model, None)`, the output kernel
    `(heads, head_dim, hidden)` `(model, None, data)`, and the RMS norm
    scales `(hidden,)` the model axis, which keeps the residual stream split
    on its hidden dimension as KerasHub's map does (without it the stream is
    replicated: 1.8x the temporaries). The keys are KerasHub's Llama keys, so
    `layout_map.update(llama_head_rules("model", "batch"))`-style replacement
    of a map's entries works for every Llama-convention family.
    """
    return {
        _LLAMA_QKV: (data, model, None),
        _LLAMA_OUTPUT: (model, None, data),
        "transformer_layer.*layernorm.*scale": (model,),
        "sequence_output_layernorm.*scale": (model,),
    }


def llama_attention_rules(model: str, data: str) -> Rules:
    # Same keys and axes as `keras_hub.models.LlamaBackbone.get_layout_map`:
    # q/k/v kernels are (hidden, heads, head_dim), the output kernel
    # (heads, head_dim, hidden).
    return {
        "token_embedding/embeddings": (model, data),
        _LLAMA_QKV: (model, data, None),
        _LLAMA_OUTPUT: (model, None, data),
    }


def llama_rules(model: str, data: str) -> Rules:
    return {
        **llama_attention_rules(model, data),
        "transformer_layer.*feedforward_intermediate_dense.kernel": (data, model),
        "transformer_layer.*feedforward_gate_dense.kernel": (data, model),
        "transformer_layer.*feedforward_output_dense.kernel": (model, data),
    }


def _stacked_experts(model: str, data: str, *, data_on_ffn: bool = False) -> Rules:
    # Mixtral, Qwen 3 MoE and Qwen 3.5 MoE: `(E, hidden, ffn)` gate and up
    # kernels (Qwen fuses them into one `(E, hidden, 2 * ffn)`), `(E, ffn,
    # hidden)` down kernel; the experts over both axes, or where the mesh
    # does not divide them the data axis on the hidden dimension, or with
    # `data_on_ffn` on the expert-FFN one.
    hidden, ffn = (None, data) if data_on_ffn else (data, None)
    return {
        "transformer_layer.*experts.expert_feedforward_(gate|intermediate)_dense": (
            _expert_bank(model, data, (model, hidden, ffn), ffn_dim=2)
        ),
        "transformer_layer.*experts.expert_feedforward_output_dense": (
            _expert_bank(model, data, (model, ffn, hidden), ffn_dim=1)
        ),
    }


def gemma4_rules(model: str, data: str) -> Rules:
    return {
        **gemma_rules(model, data),
        # Per-layer embeddings: (vocabulary, layers * width), looked up like
        # the token table; (hidden, layers * width) projection.
        "per_layer_token_embedding/embeddings": (model, data),
        "per_layer_model_projection/kernel": (data, model),
        # (hidden, width) gate and (width, hidden) up projection per layer.
        "decoder_block.*per_layer_input_gate.kernel": (data, model),
        "decoder_block.*per_layer_up_proj.kernel": (model, data),
        # 26B-A4B: (hidden, experts) router, (E, hidden, ffn) gate / up and
        # (E, ffn, hidden) down kernels.
        "decoder_block.*moe_router.proj.kernel": (model, None),
        "decoder_block.*moe_expert_bank.(gate_proj|up_proj)": _expert_bank(
            model, data, (model, data, None), ffn_dim=2
        ),
        "decoder_block.*moe_expert_bank.down_proj": _expert_bank(
            model, data, (model, None, data), ffn_dim=1
        ),
        **_gemma4_vision_rules(model, data),
        **_gemma4_audio_rules(model, data),
    }


def _gemma4_vision_rules(model: str, data: str) -> Rules:
    # The image tower: Gemma-style blocks whose kernels sit in a clipped
    # linear's `dense` sublayer; (2, positions, width) position table.
    block = "image_encoder/encoder_block_\\d+/"
    return {
        "patch_embedder/position_embedding_table": (None, model, data),
        "image_encoder/patch_embedder/input_proj/kernel": (data, model),
        block + "attention/(query|key|value)/dense/kernel": (model, data, None),
        block + "attention/attention_output/dense/kernel": (model, None, data),
        block + "ffw_gating(_2)?/dense/kernel": (data, model),
        block + "ffw_linear/dense/kernel": (model, data),
        "vision_output_encoder/vision_input_projection/kernel": (data, model),
    }


def _gemma4_audio_rules(model: str, data: str) -> Rules:
    # The audio (conformer) tower: KerasHub names its sublayers from the
    # block index, without the tower's name; every kernel is (in, out).
    block = "conformer_\\d+_"
    return {
        "input_proj/kernel": (data, model),
        block + "ffw_(start|end)_ffw_1/.*kernel": (data, model),
        block + "ffw_(start|end)_ffw_2/.*kernel": (model, data),
        block + "attention_attn_(q|k|v)_proj/.*kernel": (data, model),
        block + "attention_out_proj/.*kernel": (model, data),
        "rpe/pos_proj": (data, model),
        block + "lconv_linear_start/.*kernel": (data, model),
        block + "lconv_linear_end/.*kernel": (model, data),
        "output_proj/kernel": (data, model),
        "audio_output_projection/kernel": (data, model),
        # Small convolutions of the subsampler / conformer: replicated.
        "conv/kernel": (None, None, None, None),
        "depthwise_conv/kernel": (None, None, None),
    }


def _qwen3_5_vision_rules(model: str, data: str) -> Rules:
    # (in, out) kernels: fused qkv and fc1 split along their output, proj
    # and fc2 along their input; the merger's two-layer MLP likewise.
    tower = "qwen3_5_vision_encoder[^/]*/"
    return {
        tower + "patch_embed/proj/kernel": (None, None, None, None, model),
        tower + "pos_embed/embeddings": (data, model),
        tower + "blocks_\\d+/attn/qkv/kernel": (data, model),
        tower + "blocks_\\d+/attn/proj/kernel": (model, data),
        tower + "blocks_\\d+/mlp/fc1/kernel": (data, model),
        tower + "blocks_\\d+/mlp/fc2/kernel": (model, data),
        tower + "merger/mlp_0/kernel": (data, model),
        tower + "merger/mlp_[1-9]\\d*/kernel": (model, data),
    }


def _gated_delta_net_rules(model: str, data: str) -> Rules:
    # (hidden, 2 * key_dim + value_dim) fused q/k/v, (hidden, value_dim) z,
    # (hidden, value_heads) a and b, (value_dim, hidden) output projection,
    # (2 * key_dim + value_dim, kernel) depthwise conv over `in_proj_qkv`'s
    # output channels.
    return {
        "transformer_layer.*linear_attn.in_proj_(qkv|z|a|b).kernel": (data, model),
        "transformer_layer.*linear_attn.out_proj.kernel": (model, data),
        "transformer_layer.*linear_attn.conv1d_kernel": (model, None),
    }


def qwen3_5_rules(model: str, data: str) -> Rules:
    return {
        **llama_rules(model, data),
        **_gated_delta_net_rules(model, data),
        **_qwen3_5_vision_rules(model, data),
    }


def qwen3_5_moe_rules(model: str, data: str) -> Rules:
    # Llama's FFN keys match the shared expert's dense kernels
    # (`sparse_moe_block/shared_expert/feedforward_*_dense/kernel`).
    return {
        **qwen3_5_rules(model, data),
        "transformer_layer.*sparse_moe_block.router_gate.kernel": (model, None),
        # (hidden, 1): replicated on purpose (an explicit entry, so that no
        # missing-layout warning is raised for it).
        "transformer_layer.*shared_expert_gate.kernel": (None, None),
        **_stacked_experts(model, data),
    }


def mixtral_rules(model: str, data: str) -> Rules:
    # No dense FFN: Llama's `feedforward_gate_dense` key would also match the
    # router (`sparse_feedforward_gate_dense/kernel`), so it is left out.
    # Separate `(E, hidden, ffn)` gate and up kernels and an `(E, ffn,
    # hidden)` down kernel: where the mesh does not divide the experts, the
    # data axis on the expert-FFN dimension, so a device's gate / up / down
    # matmuls on every batch row stay local and only the down projection's
    # partial sums are reduced (docs/layouts.md).
    return {
        **llama_attention_rules(model, data),
        "transformer_layer.*sparse_feedforward_gate_dense.kernel": (model, None),
        **_stacked_experts(model, data, data_on_ffn=True),
    }


def gpt_oss_rules(model: str, data: str) -> Rules:
    # gate_up_proj is (E, hidden, 2 * ffn) with gate and up interleaved.
    return {
        **llama_attention_rules(model, data),
        "transformer_layer.*router.router_dense.kernel": (model, None),
        "transformer_layer.*experts.gate_up_proj": _expert_bank(
            model, data, (model, data, None), ffn_dim=2
        ),
        "transformer_layer.*experts.down_proj": _expert_bank(
            model, data, (model, None, data), ffn_dim=1
        ),
        # `(E, 2 * ffn)` / `(E, hidden)`: with their experts where the
        # kernels' are.
        "transformer_layer.*experts.(gate_up|down)_proj_bias": _expert_bank(model, data, (model, None), ffn_dim=1),
        # (heads, head_dim) q/k/v biases: small, replicated on purpose.
        "transformer_layer.*self_attention.*(query|key|value).bias": (None, None),
    }


_FAMILY_RULES: dict[str, Callable[[str, str], Rules]] = {
    "gemma3": gemma_rules,
    "gemma4": gemma4_rules,
    "qwen3": llama_rules,
    "mistral": llama_rules,
    "qwen3_5": qwen3_5_rules,
    "qwen3_5_moe": qwen3_5_moe_rules,
    "mixtral": mixtral_rules,
    "gpt_oss": gpt_oss_rules,
}

# Added to KerasHub's own map for these families (see module doc).
_KERAS_HUB_EXTRAS: dict[str, Callable[[str, str], Rules]] = {
    "qwen3_moe": _stacked_experts,
}


def gemma_residual_rules(model: str, data: str) -> Rules:
    """Gemma's hidden-width norm scales on the model axis (module doc).

    The pre / post attention and FFN norms (and Gemma 4's
    `post_per_layer_input_norm`) of every decoder block and the final norm,
    all `(hidden,)`; the per-head q/k norms `(head_dim,)` stay replicated.
    """
    del data
    return {
        "decoder_block_\\d+/(pre|post)_\\w+_norm/scale": (model,),
        "final_normalization/scale": (model,),
    }


# The residual stream's rules, added to the map of every family of a
# convention (see module doc: "The residual stream").
_RESIDUAL_RULES: dict[str, Callable[[str, str], Rules]] = {
    "gemma": gemma_residual_rules,
    "gemma3": gemma_residual_rules,
    "gemma4": gemma_residual_rules,
}


def hand_written_families() -> list[str]:
    """Families whose map comes from this module (no KerasHub map)."""
    return sorted(_FAMILY_RULES)


def family_rules(family: str | None, model: str, data: str) -> Rules | None:
    """The hand-written rules of `family`, or `None` if it has none."""
    rules = _FAMILY_RULES.get(family or "")
    return None if rules is None else rules(model, data)


def extra_rules(family: str | None, model: str, data: str) -> Rules:
    """Rules added to every family's map (and to KerasHub's, where needed).

    The untied output projection `(hidden, vocab)` is as large as the input
    table; KerasHub's maps leave it replicated.
    """
    rules: Rules = {"token_embedding/reverse_embeddings": (data, model)}
    for table in (_RESIDUAL_RULES, _KERAS_HUB_EXTRAS):
        extra = table.get(family or "")
        if extra is not None:
            rules.update(extra(model, data))
    return rules


def vocabulary_rules(model: str, data: str) -> Rules:
    """The vocabulary tables split along the vocabulary over both mesh axes
    (data-major), replacing KerasHub's `(model, data)` for every family.

    On `(1, 8)` that is KerasHub's layout; on `(8, 1)` and `(2, 4)` each
    device holds an eighth of the vocabulary instead of part of every
    token's row (module doc, "The vocabulary tables").
    """
    both = (data, model)
    return {
        "token_embedding/embeddings": VocabularyTable((both, None), (model, data)),
        "token_embedding/reverse_embeddings": VocabularyTable((None, both), (data, model)),
    }


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(2, limit + 1) if n % d == 0]


def expert_axes(
    path: str,
    shape: tuple[int, ...],
    bank: ExpertBank,
    sizes: Mapping[str, int],
    model: str,
) -> Axes:
    """The expert bank's axes: its experts over both mesh axes where they
    divide them, else the model axis on experts or on the FFN
    (`bank.otherwise`).

    Only the model axis is decided here; other axes (the data axis) are
    checked and, if needed, moved by the generic fallback afterwards.

    Raises:
        LayoutError: the model axis divides neither the expert count nor the
            expert-FFN width (see module doc: no silent replication).
    """
    experts, ffn = shape[bank.expert_dim], shape[bank.ffn_dim]
    over = specs.entry_axes(bank.axes[bank.expert_dim])
    if experts % math.prod(sizes.get(axis, 1) for axis in over) == 0:
        return tuple(bank.axes) + (None,) * (len(shape) - len(bank.axes))
    parts = sizes.get(model, 1)
    axes = list(bank.otherwise) + [None] * (len(shape) - len(bank.otherwise))
    if parts == 1 or model not in specs.entry_axes(axes[bank.expert_dim]):
        return tuple(axes)
    if experts % parts == 0:
        return tuple(axes)
    if ffn % parts == 0:
        axes[bank.expert_dim] = None
        hidden = next((d for d in range(len(axes)) if d not in (bank.expert_dim, bank.ffn_dim)), None)
        if axes[bank.ffn_dim] is not None and hidden is not None and axes[hidden] is None:
            # The FFN dimension's own axis (Mixtral's data axis) makes room
            # for the model axis on the bank's remaining (hidden) dimension.
            axes[hidden], axes[bank.ffn_dim] = axes[bank.ffn_dim], None
        axes[bank.ffn_dim] = (
            model if axes[bank.ffn_dim] is None
            else specs.entry_axes(axes[bank.ffn_dim]) + (model,)
        )
        return tuple(axes)
    limit = max(16, 2 * parts)
    works = sorted(set(_divisors(experts, limit)) | set(_divisors(ffn, limit)))
    total = math.prod(sizes.values())
    raise LayoutError(
        f"Cannot shard expert bank '{path}' of shape {tuple(shape)}: mesh "
        f"axis '{model}' of size {parts} divides neither its expert count "
        f"({experts}, dimension {bank.expert_dim}) nor its expert FFN width "
        f"({ffn}, dimension {bank.ffn_dim}). Expected a '{model}' axis size "
        f"that divides {experts} or {ffn}, e.g. {works}. Received: mesh axis "
        f"sizes {dict(sizes)}. Replicating the bank would put every expert "
        "on every device, so no fallback is taken. Use a mesh whose "
        f"'{model}' axis divides {experts} or {ffn} (with {total} devices: "
        f"{[d for d in works if total % d == 0] or 'none'}), or pass your own "
        "layout map."
    )
