"""Where packed rows are cut: conversations split at turn boundaries, pieces placed best-fit.

Pure integer arithmetic on lengths (no torch); :meth:`data.PackedBatches.from_examples`
turns the placement into token rows.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

__all__ = ["best_fit_decreasing", "split_at_turns"]


def split_at_turns(length: int, cuts: Sequence[int], width: int) -> list[tuple[int, int]]:
    """Cut ``[0, length)`` into pieces of at most ``width`` tokens, at ``cuts`` where possible.

    Each piece ends at the last allowed cut that keeps it within ``width`` tokens; where no
    allowed cut does (one turn longer than a row), the piece is cut at ``width`` tokens.

    Args:
        length: tokens in the conversation.
        cuts: token offsets where a piece may start (turn boundaries), any order.
        width: the most tokens one piece may hold (a row).

    Returns:
        ``[(start, stop), ...]`` covering ``[0, length)`` in order, each ``stop - start <= width``.

    Raises:
        ValueError: if ``width < 1``.
    """
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    allowed = sorted({c for c in cuts if 0 < c < length})
    pieces = []
    start = 0
    while length - start > width:
        # The farthest boundary within reach: fewest pieces, each turn kept whole where it fits.
        k = bisect.bisect_right(allowed, start + width) - 1
        stop = allowed[k] if k >= 0 and allowed[k] > start else start + width
        pieces.append((start, stop))
        start = stop
    if length > start:
        pieces.append((start, length))
    return pieces


def best_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Place items into as few bins of ``capacity`` as best-fit decreasing finds.

    Items are taken longest first (ties: lower index first); each goes into the open bin with
    the least room that still holds it (ties: the older bin), else into a new bin. The result
    depends on ``sizes`` only, and uses at most ``11/9 * optimum + 6/9`` bins.

    Args:
        sizes: item sizes, each in ``[1, capacity]``.
        capacity: the size of a bin.

    Returns:
        Bins in the order they were opened, each the item indices it holds in placement order.

    Raises:
        ValueError: if an item is empty or larger than a bin.
    """
    for i, n in enumerate(sizes):
        if not 1 <= n <= capacity:
            raise ValueError(f"item {i} has size {n}; expected 1 to {capacity}")
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    bins: list[list[int]] = []
    by_room: list[tuple[int, int]] = []  # (room left, bin index), sorted
    for i in order:
        n = sizes[i]
        k = bisect.bisect_left(by_room, (n, -1))
        if k < len(by_room):
            room, b = by_room.pop(k)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if room - n > 0:
            bisect.insort(by_room, (room - n, b))
    return bins
