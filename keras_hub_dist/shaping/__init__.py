"""Shaping: how `fit` and `generate` run on the mesh.

What the builders apply to a model so that its steps run well sharded
(`apply`: `build_shaped`, `shape_model`): the batch kept on the mesh's data
axis between and inside the decoder blocks (`batch_axis`), each block's
weights gathered when it runs (`block_gathers`), `generate`'s blocks
computing with their weights where they are stored (`stationary_weights`),
rematerialization of the decoder blocks (`remat`); `generate`'s prompt pass
in chunks and its KV cache's layout (`generate`: `shard_generate`,
`lower_generate`), and the task built around a backbone (`tasks`). Where
each weight lives is `plan`'s; the plan of a whole job (its programs and
memory per device) is `jobs`'.
"""
