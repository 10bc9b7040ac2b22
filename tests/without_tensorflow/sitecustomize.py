"""Imported at the start of every Python process of the validation
command's end-to-end tests (on PYTHONPATH: tests/validate): TensorFlow
hidden, as on a machine without it. `import keras_hub` imports TensorFlow
and tensorflow_text when installed (for its tf.data preprocessing), 5.5 of
the 8.6 s a process spent importing (the command and each case process it
starts); none of them runs a preprocessor. The multi-process workers hide
it the same way (tests/multiprocess_jobs.simulate_cpu_devices)."""

import sys

sys.modules.setdefault("tensorflow", None)  # `import tensorflow` raises ImportError
