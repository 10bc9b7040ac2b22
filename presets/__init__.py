"""Named LLM architectures: one JSON data file per KerasHub preset.

Installed as the package `keras_hub_dist._preset_data` (see pyproject.toml) so
a plain, non-editable `pip install` ships the files; read them through
`keras_hub_dist.presets`, never by path. Each file holds the preset's name,
family, KerasHub handle, parameter count (KerasHub's published metadata),
aliases with notes, and the full backbone config as KerasHub's `config.json`
has it.
"""
