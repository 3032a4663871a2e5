"""Keep freed host memory in the process on CPU training runs (glibc malloc).

glibc serves a large allocation (above a threshold that grows to at most 32 MiB) with its own
`mmap` and gives it back to the kernel on free; it also trims the top of the heap once enough of it
is free. The next allocation of that size then touches fresh pages: one page fault and one page
zeroing per 4 KiB. A train step allocates and frees the same large activations, logits and
gradients every micro-batch, and Megatron's layout (the [s, b, h] activations, the DDP gradient
buffer, the distributed optimizer's shards beside the model) makes that churn larger than a plain
loop's: at 1024 tokens per sequence the actor update took about 100k page faults per update
(a plain transformers + AdamW loop in the same process: 25k to 60k), about 6% of its CPU time.

`keep_freed_memory()` turns both off for the process (`mallopt`: no mmap'd chunks, no trimming),
so freed blocks are reused as they are; the process's resident memory then stays at its peak
instead of shrinking between steps, which a training process reaches again at every step anyway.
It applies only where the C library is glibc (on others, and under a preloaded allocator such as
jemalloc or tcmalloc, which do not read these settings, nothing changes) and not when the user
tuned glibc malloc through its environment variables (MALLOC_*_ or GLIBC_TUNABLES), or set
MEGARL_KEEP_FREED_HOST_MEMORY=0.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
NEVER_TRIM = 2**31 - 1  # the largest value mallopt's int takes: bytes of free heap top before trimming

_DONE: bool | None = None


def _user_tuned(env) -> bool:
    return env.get("MEGARL_KEEP_FREED_HOST_MEMORY", "1") == "0" or "GLIBC_TUNABLES" in env or any(
        k.startswith("MALLOC_") and k.endswith("_") for k in env)


def keep_freed_memory(env=None) -> bool:
    """Once per process; True when glibc malloc now keeps freed memory (see module docstring)."""
    global _DONE
    if _DONE is not None:
        return _DONE
    _DONE = False
    env = os.environ if env is None else env
    if _user_tuned(env):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _ = libc.gnu_get_libc_version  # glibc only: another C library's mallopt takes other parameters
    except (OSError, AttributeError):
        return False
    _DONE = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
    return _DONE
