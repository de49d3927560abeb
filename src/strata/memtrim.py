"""Make freed large buffers go back to the OS, so that memory bounds hold in practice.

glibc raises its mmap threshold (up to 32 MiB) each time a large buffer is
freed, so later large buffers come from heaps that keep the memory after it
is freed. A process that moves many 16 MiB batches (a server answering
reads, a commit uploading a big file) then grows with the number of threads
and batches, not with what it holds. A fixed threshold of 1 MiB keeps every
buffer at least that large mapped on its own and unmapped when freed.
"""

from __future__ import annotations

import contextlib


def return_large_buffers_to_the_os() -> None:
    import ctypes
    import ctypes.util
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 1024 * 1024)  # M_MMAP_THRESHOLD (not glibc: no effect)
        # Fixing that threshold also fixes the trim threshold at 128 KiB, so the heap
        # would shrink and grow again around every request body: keep up to 32 MiB.
        libc.mallopt(-1, 32 * 1024 * 1024)  # M_TRIM_THRESHOLD
