"""An indexed binary min-heap over expert keys, shared by the frequency policies (lfu, lfu_decay,
lfu_window). Every operation is O(log n) and allocates nothing.

The heap is three arrays: `heap[:n]` holds keys in heap order, `pos[k]` is key k's index in `heap`
(-1 when k is not in the heap) and `prio[k]` is key k's priority (any numeric dtype: int64 counts,
float64 decayed scores). The caller keeps `n` and changes `prio[k]` itself, then calls `increased`,
`decreased` or `update` to restore the heap order. Order: the smaller priority is nearer the top;
equal priorities put the larger key nearer the top. So for the frequency policies the top is the
victim: the lowest count and, among equal counts, the largest key (the greatest (-count, key)).

Every function is inlined into its caller (numba IR level, `inline="always"`): a policy step, compiled
with `_nrt=False` (see lfu.py), then calls no compiled function that would reference-count its arrays.
numba's on-disk cache does not notice a change to an inlined (or called) function in another file:
after editing this one, delete the cached `*.nbi`/`*.nbc` of the policies in `__pycache__`.
"""

from __future__ import annotations

import numba as nb


@nb.njit(cache=True, inline="always")
def before(prio, a, b):
    """Whether key a sits above key b: a smaller priority, or an equal one and a larger key."""
    pa = prio[a]
    pb = prio[b]
    return pa < pb or (pa == pb and a > b)


@nb.njit(cache=True, inline="always")
def sift_up(heap, pos, prio, i):
    k = heap[i]
    while True:  # not `while i > 0: ... break`: numba could then not prune the callers' refcounts
        if i == 0:
            break
        p = (i - 1) >> 1
        q = heap[p]
        if not before(prio, k, q):
            break
        heap[i] = q
        pos[q] = i
        i = p
    heap[i] = k
    pos[k] = i


@nb.njit(cache=True, inline="always")
def sift_down(heap, pos, prio, n, i):
    k = heap[i]
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        r = c + 1
        if r < n and before(prio, heap[r], heap[c]):
            c = r
        q = heap[c]
        if not before(prio, q, k):
            break
        heap[i] = q
        pos[q] = i
        i = c
    heap[i] = k
    pos[k] = i


@nb.njit(cache=True, inline="always")
def push(heap, pos, prio, n, k):
    """Insert key k (not in the heap); returns the new size."""
    heap[n] = k
    pos[k] = n
    sift_up(heap, pos, prio, n)
    return n + 1


@nb.njit(cache=True, inline="always")
def pop(heap, pos, prio, n):
    """Remove the top key; returns (top, new size). The heap must not be empty."""
    top = heap[0]
    pos[top] = -1
    n -= 1
    if n > 0:
        last = heap[n]
        heap[0] = last
        pos[last] = 0
        sift_down(heap, pos, prio, n, 0)
    return top, n


@nb.njit(cache=True, inline="always")
def replace_top(heap, pos, prio, n, k):
    """Remove the top key and insert key k (not in the heap) in one sift; returns the old top."""
    top = heap[0]
    pos[top] = -1
    heap[0] = k
    pos[k] = 0
    sift_down(heap, pos, prio, n, 0)
    return top


@nb.njit(cache=True, inline="always")
def remove(heap, pos, prio, n, k):
    """Remove key k (in the heap); returns the new size."""
    i = pos[k]
    pos[k] = -1
    n -= 1
    if i < n:
        last = heap[n]
        heap[i] = last
        pos[last] = i
        sift_up(heap, pos, prio, i)
        sift_down(heap, pos, prio, n, pos[last])
    return n


@nb.njit(cache=True, inline="always")
def increased(heap, pos, prio, n, k):
    """Restore the order after prio[k] grew (k in the heap)."""
    sift_down(heap, pos, prio, n, pos[k])


@nb.njit(cache=True, inline="always")
def decreased(heap, pos, prio, k):
    """Restore the order after prio[k] shrank (k in the heap)."""
    sift_up(heap, pos, prio, pos[k])


@nb.njit(cache=True, inline="always")
def update(heap, pos, prio, n, k):
    """Restore the order after prio[k] changed either way (k in the heap)."""
    sift_up(heap, pos, prio, pos[k])
    sift_down(heap, pos, prio, n, pos[k])


@nb.njit(cache=True, inline="always")
def heapify(heap, pos, prio, n):
    """Rebuild the order of heap[:n] after many priorities changed at once."""
    for i in range(n):
        pos[heap[i]] = i
    for i in range(n // 2 - 1, -1, -1):
        sift_down(heap, pos, prio, n, i)
