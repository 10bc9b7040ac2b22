"""Plan: what a model is and where each of its bytes will live.

Named architectures (`presets`), model families (`families`), mesh parsing
(`mesh`), partition-spec arithmetic (`specs`), byte sizes (`sizes`),
hand-written layout maps (`layouts`, with the rules of the MoE / hybrid
families in `family_rules`), automatic layout planning from the
traced model (`auto_layout`, with `auto_layout_decisions`,
`auto_layout_report` and the trace in `weight_graph`), the layouts of one
model on one mesh (`model_layouts`), builds with no weight values and the
variable specs of a named architecture (`build`), and per-device sizing of
abstract builds (`abstract`). Nothing here reads a checkpoint or allocates a
weight.
"""
