"""Save: each process writes its own devices' blocks into one preset.

`write_plan` decides which process writes which block, where (pure,
testable with fake devices); `write_execute` writes them; `saver` is the
public `save_sharded_preset`.
"""
