"""NumPy stand-ins that record what a converter does to checkpoint tensors.

KerasHub's Hugging Face converters are plain NumPy code: `np.transpose`,
`np.reshape`, `.T`, `.astype`, `np.stack`, `np.concatenate`, slicing,
arithmetic. Handing them a `LazyArray` instead of a tensor runs that code
unchanged and yields, instead of values, the `TensorSource` that computes
any block of the result (`keras_hub_dist.formats.transforms`). NumPy
dispatches its functions to `__array_function__` and ufuncs to
`__array_ufunc__`, so no converter is edited or re-implemented: KerasHub
stays the single source of truth of every mapping.

An operation with no block-wise form here (`np.empty_like`, masked
assignment, `np.repeat`, ...) yields an `Opaque` value instead of failing,
so the converter runs to its end; `Opaque` remembers which checkpoint
tensors it came from, and the caller decides (a known transform such as
MXFP4 dequantization, the converter's hook applied to the whole tensor, or
a clear error).

Example:

```python
x = LazyArray(view(stored, (8, 16), "q_proj"))
y = np.transpose(np.reshape(x, (2, 4, 16)), (0, 2, 1))
y.source.read(((0, 1), (0, 16), (0, 4)))   # reads only head 0's bytes
```
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from keras_hub_dist.formats import transforms
from keras_hub_dist.formats.base import TensorSource

__all__ = ["LazyArray", "Opaque", "leaves_of"]


def _axis(axis: int, ndim: int) -> int:
    axis = operator.index(axis)
    if not -ndim <= axis < ndim:
        raise np.exceptions.AxisError(axis, ndim)
    return axis % ndim


class Opaque:
    """The result of an operation the loader cannot split into blocks.

    Any further operation on it gives another `Opaque` with the union of
    the inputs, so code that computes through it still runs to its end.
    """

    def __init__(self, inputs: Sequence[Any]) -> None:
        self.leaves: frozenset[str] = frozenset().union(*(leaves_of(i) for i in inputs))

    def _absorb(self, *others: Any) -> Opaque:
        return Opaque([self, *others])

    def __array_function__(self, func, types, args, kwargs):
        return Opaque(_flatten(args) + _flatten(list(kwargs.values())))

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return Opaque(list(inputs))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: Opaque([self, *args])

    def __getitem__(self, key: Any) -> Opaque:
        return Opaque([self, *_flatten([key])])

    def __setitem__(self, key: Any, value: Any) -> None:
        self.leaves = self.leaves | leaves_of(value) | frozenset().union(
            *(leaves_of(k) for k in _flatten([key]))
        )

    def __array__(self, *args, **kwargs):
        raise TypeError("an Opaque checkpoint value has no values until it is loaded")

    for _name in (
        "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or",
        "xor", "lshift", "rshift", "radd", "rsub", "rmul", "rtruediv", "rpow",
        "rand", "ror", "eq", "ne", "lt", "le", "gt", "ge", "matmul", "rmatmul",
    ):
        locals()[f"__{_name}__"] = _absorb
    __neg__ = __invert__ = __abs__ = lambda self: Opaque([self])  # noqa: E731
    del _name


def _flatten(values: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for v in values:
        if isinstance(v, (list, tuple)):
            out += _flatten(v)
        else:
            out.append(v)
    return out


def leaves_of(value: Any) -> frozenset[str]:
    """Names of the checkpoint tensors a traced value depends on."""
    if isinstance(value, Opaque):
        return value.leaves
    if isinstance(value, LazyArray):
        return value.leaves
    return frozenset()


_UFUNC_METHODS = {"__call__"}


class LazyArray:
    """A checkpoint tensor (or a traced transform of one) posing as an array.

    Attributes:
        source: The `TensorSource` computing any block of this value.
        leaves: Names of the checkpoint tensors it reads.
    """

    __array_priority__ = 1000

    def __init__(self, source: TensorSource, leaves: frozenset[str] = frozenset()) -> None:
        self.source = source
        self.leaves = leaves

    # Array attributes.
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.source.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.source.dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, *args, **kwargs):
        raise TypeError(
            "A lazily loaded checkpoint tensor cannot be turned into a NumPy array "
            "while the loader traces a converter."
        )

    def _new(self, source: TensorSource, *others: Any) -> LazyArray:
        leaves = self.leaves.union(*(leaves_of(o) for o in others))
        return LazyArray(source, leaves)

    # Shape operations.
    @property
    def T(self) -> LazyArray:  # noqa: N802 - NumPy's name
        return self.transpose()

    def transpose(self, *axes: Any) -> LazyArray:
        if len(axes) == 1 and (axes[0] is None or isinstance(axes[0], (tuple, list))):
            axes = axes[0]
        perm = tuple(range(self.ndim))[::-1] if not axes else tuple(_axis(a, self.ndim) for a in axes)
        if sorted(perm) != list(range(self.ndim)):
            raise ValueError(f"axes {axes} don't match array of {self.ndim} dimensions")
        if perm == tuple(range(self.ndim)):
            return self
        return self._new(transforms.Transpose(self.source, perm))

    def reshape(self, *shape: Any, order: str = "C") -> LazyArray | Opaque:
        if order != "C":
            return Opaque([self])
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return self._new(transforms.reshape(self.source, [operator.index(d) for d in shape]))

    def squeeze(self, axis: Any = None) -> LazyArray:
        if axis is None:
            drop = {i for i, d in enumerate(self.shape) if d == 1}
        else:
            drop = {_axis(a, self.ndim) for a in (axis if isinstance(axis, (tuple, list)) else (axis,))}
            if any(self.shape[a] != 1 for a in drop):
                raise ValueError("cannot select an axis to squeeze out which has size not equal to one")
        return self.reshape([d for i, d in enumerate(self.shape) if i not in drop])

    def astype(self, dtype: Any, copy: bool = True, **kwargs: Any) -> LazyArray:
        dtype = np.dtype(dtype)
        if dtype == self.dtype:
            return self
        return self._new(transforms.Cast(self.source, dtype))

    def copy(self) -> LazyArray:
        return self

    def __getitem__(self, key: Any) -> LazyArray | Opaque:
        key = key if isinstance(key, tuple) else (key,)
        if any(k is None or isinstance(k, (LazyArray, Opaque, np.ndarray, list)) for k in key):
            return Opaque([self, *key])
        if key.count(Ellipsis) > 1:
            raise IndexError("an index can only have a single ellipsis ('...')")
        if Ellipsis in key:
            at = key.index(Ellipsis)
            key = key[:at] + (slice(None),) * (self.ndim - len(key) + 1) + key[at + 1 :]
        if len(key) > self.ndim:
            raise IndexError(f"too many indices: array is {self.ndim}-dimensional")
        key = key + (slice(None),) * (self.ndim - len(key))
        ranges, drop = [], []
        for i, (k, size) in enumerate(zip(key, self.shape)):
            if isinstance(k, slice):
                start, stop, step = k.indices(size)
                if step != 1:
                    return Opaque([self])
                ranges.append((start, max(start, stop)))
            else:
                k = operator.index(k)
                if not -size <= k < size:
                    raise IndexError(f"index {k} is out of bounds for axis {i} with size {size}")
                ranges.append((k % size, k % size + 1))
                drop.append(i)
        if not drop and all(r == (0, d) for r, d in zip(ranges, self.shape)):
            return self
        return self._new(transforms.Slice(self.source, tuple(ranges), drop))

    # NumPy protocols.
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method not in _UFUNC_METHODS or kwargs.get("out") is not None or ufunc.nout != 1:
            return Opaque(list(inputs))
        operands: list[Any] = []
        shapes = set()
        for x in inputs:
            if isinstance(x, Opaque):
                return Opaque(list(inputs))
            if isinstance(x, LazyArray):
                operands.append(x.source)
                shapes.add(x.shape)
            elif np.ndim(x) == 0:
                operands.append(x)
            else:
                return Opaque(list(inputs))  # broadcasting against an array
        if len(shapes) != 1:
            return Opaque(list(inputs))
        probe = [np.zeros(1, o.dtype) if isinstance(o, TensorSource) else o for o in operands]
        dtype = np.asarray(ufunc(*probe, **kwargs)).dtype
        leaves = frozenset().union(*(leaves_of(x) for x in inputs))
        return LazyArray(transforms.Elementwise(ufunc, operands, kwargs, dtype), leaves)

    def __array_function__(self, func, types, args, kwargs):
        handler = _FUNCTIONS.get(func)
        if handler is None:
            return Opaque(_flatten(list(args)) + _flatten(list(kwargs.values())))
        return handler(*args, **kwargs)

    for _name, _ufunc in {
        "add": np.add, "sub": np.subtract, "mul": np.multiply, "truediv": np.true_divide,
        "floordiv": np.floor_divide, "mod": np.remainder, "pow": np.power,
        "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor,
        "lshift": np.left_shift, "rshift": np.right_shift, "eq": np.equal,
        "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
        "ge": np.greater_equal,
    }.items():
        locals()[f"__{_name}__"] = (lambda u: lambda self, other: u(self, other))(_ufunc)
        if _name not in ("eq", "ne", "lt", "le", "gt", "ge"):
            locals()[f"__r{_name}__"] = (lambda u: lambda self, other: u(other, self))(_ufunc)
    __neg__ = lambda self: np.negative(self)  # noqa: E731
    __invert__ = lambda self: np.invert(self)  # noqa: E731
    __abs__ = lambda self: np.absolute(self)  # noqa: E731
    del _name, _ufunc
    __hash__ = object.__hash__


def _transpose(a: Any, axes: Any = None) -> Any:
    return a.transpose(axes)


def _reshape(a: Any, *args: Any, **kwargs: Any) -> Any:
    shape = kwargs.pop("shape", kwargs.pop("newshape", None))
    if shape is None:
        shape, args = args[0], args[1:]
    order = kwargs.pop("order", args[0] if args else "C")
    return a.reshape(shape if isinstance(shape, (tuple, list)) else (shape,), order=order)


def _joined(kind: type, arrays: Sequence[Any], axis: int, dtype: Any = None, **kwargs: Any) -> Any:
    arrays = list(arrays)
    if kwargs.get("out") is not None or not all(isinstance(a, LazyArray) for a in arrays):
        return Opaque(arrays)
    if kind is transforms.Stack:
        if len({a.shape for a in arrays}) != 1:
            raise ValueError("all input arrays must have the same shape")
        axis = _axis(axis, arrays[0].ndim + 1)
    else:
        axis = _axis(axis, arrays[0].ndim)
        rest = {a.shape[:axis] + a.shape[axis + 1 :] for a in arrays}
        if len(rest) != 1 or len({a.ndim for a in arrays}) != 1:
            raise ValueError(
                "all the input array dimensions except for the concatenation axis must match exactly"
            )
    out_dtype = np.dtype(dtype) if dtype is not None else np.result_type(*(a.dtype for a in arrays))
    sources = [a.source for a in arrays]
    joined = transforms.join(kind, sources, axis, out_dtype)
    return LazyArray(joined, frozenset().union(*(a.leaves for a in arrays)))


def _expand_dims(a: Any, axis: Any) -> Any:
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    ndim = a.ndim + len(axes)
    axes = sorted(_axis(x, ndim) for x in axes)
    shape = list(a.shape)
    for x in axes:
        shape.insert(x, 1)
    return a.reshape(shape)


def _swapaxes(a: Any, axis1: int, axis2: int) -> Any:
    perm = list(range(a.ndim))
    i, j = _axis(axis1, a.ndim), _axis(axis2, a.ndim)
    perm[i], perm[j] = perm[j], perm[i]
    return a.transpose(perm)


def _moveaxis(a: Any, source: Any, destination: Any) -> Any:
    src = [_axis(s, a.ndim) for s in (source if isinstance(source, (tuple, list)) else (source,))]
    dst = [_axis(d, a.ndim) for d in (destination if isinstance(destination, (tuple, list)) else (destination,))]
    order = [n for n in range(a.ndim) if n not in src]
    for d, s in sorted(zip(dst, src)):
        order.insert(d, s)
    return a.transpose(order)


_FUNCTIONS = {
    np.transpose: _transpose,
    np.reshape: _reshape,
    np.squeeze: lambda a, axis=None: a.squeeze(axis),
    np.stack: lambda arrays, axis=0, **kw: _joined(transforms.Stack, arrays, axis, **kw),
    np.concatenate: lambda arrays, axis=0, **kw: _joined(transforms.Concat, arrays, axis, **kw),
    np.expand_dims: _expand_dims,
    np.swapaxes: _swapaxes,
    np.moveaxis: _moveaxis,
    np.ascontiguousarray: lambda a, dtype=None, **kw: a if dtype is None else a.astype(dtype),
    np.copy: lambda a, **kw: a,
    np.shape: lambda a: a.shape,
    np.ndim: lambda a: a.ndim,
    np.size: lambda a, axis=None: a.size if axis is None else a.shape[axis],
}
