"""Save: each process writes its own devices' blocks into one preset.

`write_plan` decides which process writes which block, where (pure,
testable with fake devices); `write_execute` writes them; `saver` saves a
KerasHub preset. `hf_export` saves a Hugging Face checkpoint instead: the
model's mapping to it is `hf_mapping` (KerasHub's exporter and importer,
replayed; `hf_families` for the families KerasHub cannot export), its small
files `hf_files`, and `piece_write` writes blocks through their element
maps. `api` is the public `save_sharded_preset` over both; `staging` owns
the temporary directory every save publishes. Converting one format's files
to the other's is `convert.file_to_file` (it reads as the loader does too).
"""
