"""Where every element of a transformed tensor comes from: affine pieces.

The transforms between a Keras variable and a Hugging Face tensor only move
elements (reshape into heads, transpose, slice an expert out of a bank,
stack or concatenate projections), so the whole correspondence is a list of
*pieces*, each an affine bijection between a box of a leaf tensor and a set
of elements of the output:

    out_flat[out_base + sum(a_i * out_step_i)] = leaf_flat[leaf_base + sum(a_i * leaf_step_i)]

for every multi-index `a` over the piece's atoms (`Atom(size, leaf_step,
out_step)`), flat indices being C-order element indices. A reshape changes
no flat index at all, so it costs nothing; a transpose, slice, stack or
concatenation relabels the atoms by the dimensions they run along
(`_label`), splitting an atom that spans several. A piece read the other way
round (`invert`) maps the output back to the leaf: the same description
serves loading (file tensor -> variable) and saving (variable -> file tensor).

`pieces_of(source)` computes them from a `formats.transforms` tree (the tree
KerasHub's converters are traced into, or the one its exporters are replayed
into), and `block_writes` turns the part of a piece that one block of the
leaf covers into a strided view of the block plus the file's byte runs, which
is all a positioned write needs: a device's block of a variable lands in the
file at its own offsets, transposed on the host if the file's order differs.

Example:

```python
# HF q_proj (H*D, hidden) = transpose(reshape(kernel, (hidden, H*D)))
source = Transpose(view(kernel_leaf, (hidden, H * D)), (1, 0))
(piece,) = pieces_of(source)   # one piece: kernel elements -> q_proj elements
```
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from keras_hub_dist.formats.base import ByteRuns, Index, StoredTensorSource, TensorSource
from keras_hub_dist.formats.transforms import Cast, Concat, Reshape, Slice, Stack, Transpose

__all__ = [
    "Atom",
    "BlockWrite",
    "NotAffine",
    "Piece",
    "block_writes",
    "canonical",
    "identity",
    "invert",
    "pieces_of",
    "value_boxes",
]


class NotAffine(ValueError):
    """A transform that does not only move elements (or moves them in a way
    these pieces cannot describe)."""


@dataclass(frozen=True)
class Atom:
    """One axis of a piece: `size` steps of `leaf_step` elements in the leaf
    and `out_step` elements in the output."""

    size: int
    leaf_step: int
    out_step: int


@dataclass(frozen=True)
class Piece:
    """An affine bijection between part of a leaf tensor and part of the
    output (see the module docstring).

    Attributes:
        leaf: The leaf's `(file, offset)` (its `StoredTensor`'s place).
        leaf_base: Flat element index in the leaf of atom index 0.
        out_base: Flat element index in the output of atom index 0.
        atoms: The axes, in no particular order.
    """

    leaf: Any
    leaf_base: int
    out_base: int
    atoms: tuple[Atom, ...]

    @property
    def size(self) -> int:
        return math.prod(a.size for a in self.atoms)


def _c_strides(shape: Sequence[int]) -> list[int]:
    return [math.prod(shape[i + 1 :]) for i in range(len(shape))]


def _unravel(flat: int, shape: Sequence[int]) -> list[int]:
    out = []
    for stride in _c_strides(shape):
        q, flat = divmod(flat, stride) if stride else (0, flat)
        out.append(q)
    return out


def _ravel(index: Sequence[int], shape: Sequence[int]) -> int:
    return sum(i * s for i, s in zip(index, _c_strides(shape)))


def _merge(atoms: Sequence[Atom]) -> tuple[Atom, ...]:
    """Drops size-1 atoms and merges an atom into the next outer one where
    both sides are contiguous across them; outermost (largest out step)
    first."""
    ordered = sorted((a for a in atoms if a.size > 1), key=lambda a: (-a.out_step, -a.leaf_step))
    merged: list[Atom] = []
    for atom in reversed(ordered):  # innermost first
        if merged:
            inner = merged[-1]
            if atom.out_step == inner.size * inner.out_step and atom.leaf_step == inner.size * inner.leaf_step:
                merged[-1] = Atom(atom.size * inner.size, inner.leaf_step, inner.out_step)
                continue
        merged.append(atom)
    return tuple(reversed(merged))


def identity(leaf: Any, shape: Sequence[int]) -> Piece:
    """The piece of a tensor that is its leaf as it is."""
    size = math.prod(shape)
    return Piece(leaf, 0, 0, (Atom(size, 1, 1),) if size > 1 else ())


def invert(piece: Piece, leaf: Any) -> Piece:
    """The same bijection read the other way: the output becomes the leaf
    (named `leaf`) and the leaf the output."""
    atoms = tuple(Atom(a.size, a.out_step, a.leaf_step) for a in piece.atoms)
    return Piece(leaf, piece.out_base, piece.leaf_base, _merge(atoms))


def canonical(piece: Piece) -> Piece:
    """A normal form: equal bijections given by one piece compare equal."""
    return replace(piece, atoms=_merge(piece.atoms))


def _label(
    piece: Piece, shape: Sequence[int], side: str
) -> tuple[list[int], list[tuple[Atom, int, int]]]:
    """Labels each atom by the dimension of `shape` it runs along on `side`
    (`"out"` or `"leaf"`): `(origin multi-index, [(atom, dim, step in that
    dim)])`, splitting atoms that span several dimensions.

    Raises:
        NotAffine: An atom straddles dimensions unevenly, or the piece
            carries over a dimension's end.
    """
    strides = _c_strides(shape)
    base = piece.out_base if side == "out" else piece.leaf_base
    origin = _unravel(base, shape)
    labeled: list[tuple[Atom, int, int]] = []
    pending = list(piece.atoms)
    while pending:
        atom = pending.pop()
        if atom.size == 1:
            continue
        step = atom.out_step if side == "out" else atom.leaf_step
        dims = [j for j in range(len(shape)) if strides[j] <= step and shape[j] > 1]
        if not dims or step % strides[dims[0]]:
            raise NotAffine(f"an atom of step {step} does not run along one dimension of {tuple(shape)}")
        j = dims[0]
        k = step // strides[j]
        if (atom.size - 1) * k >= shape[j]:
            if shape[j] % k or atom.size % (shape[j] // k):
                raise NotAffine(f"an atom of {atom.size} x {step} straddles dimensions of {tuple(shape)}")
            m = shape[j] // k
            outer = Atom(atom.size // m, atom.leaf_step * m, atom.out_step * m)
            pending += [outer, Atom(m, atom.leaf_step, atom.out_step)]
            continue
        labeled.append((atom, j, k))
    for j, size in enumerate(shape):
        reach = origin[j] + sum((a.size - 1) * k for a, d, k in labeled if d == j)
        if reach >= size:
            raise NotAffine(f"a piece runs past the end of dimension {j} of {tuple(shape)}")
    return origin, labeled


def _relabel(
    piece: Piece, origin: Sequence[int], labeled: Sequence[tuple[Atom, int, int]], shape: Sequence[int], side: str
) -> Piece:
    """The piece with its `side` flat indices in `shape`, from labeled atoms."""
    strides = _c_strides(shape)
    atoms = []
    for atom, j, k in labeled:
        step = k * strides[j]
        atoms.append(Atom(atom.size, atom.leaf_step, step) if side == "out" else Atom(atom.size, step, atom.out_step))
    base = _ravel(origin, shape)
    if side == "out":
        return Piece(piece.leaf, piece.leaf_base, base, _merge(atoms))
    return Piece(piece.leaf, base, piece.out_base, _merge(atoms))


def value_boxes(
    start: int, stop: int, sizes: Sequence[int], steps: Sequence[int]
) -> list[tuple[tuple[int, int], ...]]:
    """The digit tuples `a` (`0 <= a_i < sizes[i]`) with `sum(a_i * steps[i])`
    in `start:stop`, as a few boxes of digit ranges.

    `steps` decrease and each exceeds the largest sum of the digits inside
    it (nested, possibly with gaps, as a slice of a reshaped dimension
    leaves them); a plain mixed radix is the gapless case.
    """
    if not sizes:
        return [()] if start <= 0 < stop else []
    step, size = steps[0], sizes[0]
    extent = sum((n - 1) * k for n, k in zip(sizes[1:], steps[1:]))
    first = max(0, -(-(start - extent) // step))  # any overlap
    last = min(size, -(-stop // step))
    inside_lo = max(first, -(-start // step))  # whole inner range inside
    inside_hi = min(last, (stop - 1 - extent) // step + 1)
    boxes = []
    for a in range(first, last):
        if inside_lo <= a < inside_hi:
            continue
        boxes += [((a, a + 1), *b) for b in value_boxes(start - a * step, stop - a * step, sizes[1:], steps[1:])]
    if inside_hi > inside_lo:
        boxes.append(((inside_lo, inside_hi), *((0, n) for n in sizes[1:])))
    return sorted(boxes)


def _restrict(
    piece: Piece,
    origin: list[int],
    labeled: list[tuple[Atom, int, int]],
    dim: int,
    start: int,
    stop: int,
    side: str,
) -> list[tuple[Piece, list[int], list[tuple[Atom, int, int]]]]:
    """A labeled piece restricted to `start:stop` along `dim` of its
    labeled `side`: one labeled piece per box of the range (none if the
    piece misses it)."""
    mine = sorted((x for x in labeled if x[1] == dim), key=lambda x: -x[2])
    rest = [x for x in labeled if x[1] != dim]
    o = origin[dim]
    if not mine:
        return [(piece, origin, labeled)] if start <= o < stop else []
    steps = [k for _, _, k in mine]
    sizes = [a.size for a, _, _ in mine]
    if any(steps[i] <= sum((n - 1) * k for n, k in zip(sizes[i + 1 :], steps[i + 1 :])) for i in range(len(mine))):
        raise NotAffine("a block or slice of a dimension that a piece covers in interleaved steps")
    out = []
    for box in value_boxes(start - o, stop - o, sizes, steps):
        new_origin = list(origin)
        atoms = []
        leaf_shift = out_shift = 0
        for (atom, _, k), (a, b) in zip(mine, box):
            new_origin[dim] += a * k
            leaf_shift += a * atom.leaf_step
            out_shift += a * atom.out_step
            atoms.append((Atom(b - a, atom.leaf_step, atom.out_step), dim, k))
        # The labeled side's base is rebuilt from the origin; the other's moves.
        if side == "out":
            moved = replace(piece, leaf_base=piece.leaf_base + leaf_shift)
        else:
            moved = replace(piece, out_base=piece.out_base + out_shift)
        out.append((moved, new_origin, rest + atoms))
    return out


def _sliced(piece: Piece, shape: Sequence[int], ranges: Sequence[tuple[int, int]], side: str) -> list[Piece]:
    """`piece` restricted to the box `ranges` of its `side` (indices in
    `shape`)."""
    parts = [(piece, *_label(piece, shape, side))]
    for dim, (start, stop) in enumerate(ranges):
        if (start, stop) != (0, shape[dim]):
            parts = [r for p in parts for r in _restrict(*p, dim, start, stop, side)]
    return [_relabel(p, o, labeled, shape, side) for p, o, labeled in parts]


def pieces_of(source: TensorSource) -> list[Piece]:
    """The pieces of a transform tree: every element of `source`'s output
    with the leaf element it is.

    Leaves are `StoredTensorSource`s (their `(file, offset)` names the
    leaf); `Transpose`, `Slice`, `Stack`, `Concat` and `Cast` are followed
    (a cast changes values, not places).

    Raises:
        NotAffine: Another operation (element-wise arithmetic, a fallback,
            a dequantization), or one these pieces cannot describe.
    """
    if isinstance(source, StoredTensorSource):
        stored = source.stored
        total = math.prod(stored.shape)
        atoms = (Atom(total, 1, 1),) if total > 1 else ()
        return [Piece((stored.file, stored.offset), 0, 0, atoms)] if total else []
    if isinstance(source, (Cast, Reshape)):
        return pieces_of(source.child)
    if isinstance(source, Transpose):
        child_shape = source.child.shape
        out = []
        for piece in pieces_of(source.child):
            origin, labeled = _label(piece, child_shape, "out")
            position = {p: i for i, p in enumerate(source.perm)}
            new_origin = [origin[p] for p in source.perm]
            new_labeled = [(a, position[j], k) for a, j, k in labeled]
            out.append(_relabel(piece, new_origin, new_labeled, source.shape, "out"))
        return out
    if isinstance(source, Slice):
        out = []
        child_shape = source.child.shape
        kept = [i for i in range(len(child_shape)) if i not in source.drop]
        for piece in pieces_of(source.child):
            for part in _sliced(piece, child_shape, source.ranges, "out"):
                origin, labeled = _label(part, child_shape, "out")
                new_origin = [origin[i] - source.ranges[i][0] for i in kept]
                new_labeled = [(a, kept.index(j), k) for a, j, k in labeled]
                out.append(_relabel(part, new_origin, new_labeled, source.shape, "out"))
        return out
    if isinstance(source, (Stack, Concat)):
        out = []
        for child, (a, _) in zip(source.children, source.spans):
            for piece in pieces_of(child):
                origin, labeled = _label(piece, child.shape, "out")
                if isinstance(source, Stack):
                    new_origin = origin[: source.axis] + [a] + origin[source.axis :]
                    new_labeled = [(x, j + (j >= source.axis), k) for x, j, k in labeled]
                else:
                    new_origin = list(origin)
                    new_origin[source.axis] += a
                    new_labeled = list(labeled)
                out.append(_relabel(piece, new_origin, new_labeled, source.shape, "out"))
        return out
    raise NotAffine(f"{type(source).__name__} of {source.description} does not only move elements")


@dataclass(frozen=True)
class BlockWrite:
    """What one block of a leaf writes of one piece: the elements of the
    block at `start + sum(a_i * steps_i along dims_i)`, in file order
    (`shape`, outermost first), go to bytes `file_offset +
    sum(a_i * file_steps_i)`.

    Attributes:
        start: Where, in the block, the first element is.
        shape: The atoms' sizes, outermost (in the file) first.
        dims: The block dimension each atom runs along.
        steps: Each atom's step along its dimension.
        file_offset: Byte offset of the first element in the file.
        file_steps: Each atom's step in the file, in bytes.
        itemsize: Bytes per element in the file.
    """

    start: tuple[int, ...]
    shape: tuple[int, ...]
    dims: tuple[int, ...]
    steps: tuple[int, ...]
    file_offset: int
    file_steps: tuple[int, ...]
    itemsize: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def runs(self, first: int = 0, stop: int | None = None) -> ByteRuns:
        """The file byte runs of outermost indices `first:stop` (all by
        default), in the order of the values' C order."""
        sizes = list(self.shape)
        offset = self.file_offset
        if sizes:
            stop = sizes[0] if stop is None else stop
            offset += first * self.file_steps[0]
            sizes[0] = stop - first
        run = self.itemsize
        i = len(sizes)
        while i > 0 and self.file_steps[i - 1] == run:
            run *= sizes[i - 1]
            i -= 1
        return ByteRuns(offset, run, tuple(sizes[:i]), tuple(self.file_steps[:i]))

    def values(self, block: np.ndarray) -> np.ndarray:
        """The elements of `block` (the leaf's block, any strides) that this
        write puts in the file, in file order: a read-only view."""
        first = block[tuple(slice(s, None) for s in self.start)]
        strides = tuple(k * block.strides[j] for j, k in zip(self.dims, self.steps))
        return np.lib.stride_tricks.as_strided(first, self.shape, strides, writeable=False)


def block_writes(
    piece: Piece,
    leaf_shape: Sequence[int],
    block: Index,
    out_offset: int,
    itemsize: int,
) -> list[BlockWrite]:
    """The writes that block `block` of the leaf makes of `piece`.

    Args:
        piece: A piece whose leaf has shape `leaf_shape`.
        leaf_shape: The leaf's shape.
        block: The block of the leaf, `((start, stop), ...)`.
        out_offset: Byte offset of the output's element 0 in its file.
        itemsize: Bytes per element in the file.

    Returns:
        One `BlockWrite` per box of the part of the piece the block covers.
    """
    out = []
    for part in _sliced(piece, leaf_shape, block, "leaf"):
        origin, labeled = _label(part, leaf_shape, "leaf")
        ordered = sorted(labeled, key=lambda x: -x[0].out_step)
        out.append(
            BlockWrite(
                start=tuple(o - a for o, (a, _) in zip(origin, block)),
                shape=tuple(atom.size for atom, _, _ in ordered),
                dims=tuple(j for _, j, _ in ordered),
                steps=tuple(k for _, _, k in ordered),
                file_offset=out_offset + part.out_base * itemsize,
                file_steps=tuple(atom.out_step * itemsize for atom, _, _ in ordered),
                itemsize=itemsize,
            )
        )
    return out
