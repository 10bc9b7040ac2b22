"""Keras's int8 / int4 quantization computed from float blocks, bitwise.

- `quantizer`: `TensorQuantizer`, quantized variables as `TensorSource`s
  whose blocks are computed from the float tensor's blocks;
- `kernels` (compiled loops, `_jit`) and `keras_math` (Keras's own NumPy
  steps, where the kernels do not apply);
- `combine`: statistics of a block split across devices, combined;
- `flat_reshape`: a block of a C-order reshape read block-wise.
"""
