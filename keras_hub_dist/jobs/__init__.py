"""The job around the checkpoint: fine-tune and generate planned per device.

`plan_memory` (`memory_plan`) lowers the very programs a job runs — Keras's
JAX train step, KerasHub's generate — on abstract values (`abstract_job`:
the task built with no weight allocated, every variable in its final
sharding) and reads XLA's memory analysis of each device's program
(`programs`), before any weight exists.
"""
