"""The process's malloc settings, for the benchmarks that time calls into fresh buffers.

JAX allocates every output of a call anew. glibc's malloc serves blocks above its mmap
threshold (128 KiB, raised on the fly up to 32 MiB) with fresh mappings and returns them to
the system when freed, so a call writing large outputs page-faults all of them in again,
and on a VM that can cost more than the kernel itself. Raising the mmap and trim thresholds
keeps freed blocks for reuse; the README gives the same settings as environment variables
(MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_) for a training loop's process.
"""

from __future__ import annotations

import ctypes
import os

# mallopt's parameter numbers (glibc malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def environment() -> str:
    """The malloc settings in this process's environment, as 'NAME=value ...' ('none set'
    when there are none)."""
    names = sorted(n for n in os.environ
                   if n.startswith("MALLOC_") or n in ("GLIBC_TUNABLES", "LD_PRELOAD"))
    return " ".join(f"{n}={os.environ[n]}" for n in names) or "none set"


def keep_freed_memory(limit_bytes: int = 256 << 20) -> bool:
    """Makes malloc serve blocks up to `limit_bytes` from its heap and keep up to that much
    freed memory for reuse (mallopt M_MMAP_THRESHOLD and M_TRIM_THRESHOLD) from now on, for
    the rest of the process. False where the C library has no mallopt or refuses it."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # no C library to open, or no mallopt in it
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return all(mallopt(p, limit_bytes) == 1 for p in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD))
