"""megarl.platform.host_allocator: after keep_freed_memory() a freed large block is reused without
fresh page faults (glibc); before it, glibc maps every 64 MiB allocation anew (16k faults of 4 KiB)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO
from megarl.platform import host_allocator

PROBE = r"""
import ctypes, importlib.util, resource, sys
# The module file alone (it needs only ctypes): no torch import in this short-lived process.
spec = importlib.util.spec_from_file_location("host_allocator", sys.argv[2])
host_allocator = importlib.util.module_from_spec(spec)
spec.loader.exec_module(host_allocator)
kept = host_allocator.keep_freed_memory() if sys.argv[1] == "keep" else None
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 64 << 20
def touched():
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)
    return p
libc.free(touched())  # the first allocation faults in its pages either way
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
libc.free(touched())
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _second_allocation_faults(mode: str) -> tuple[str, int]:
    env = {"PATH": "/usr/bin:/bin"}  # no MALLOC_* settings of the caller's
    out = subprocess.run([sys.executable, "-c", PROBE, mode, host_allocator.__file__], cwd=REPO, env=env, capture_output=True,
                         text=True, check=True)
    kept, faults = out.stdout.split()
    return kept, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_a_freed_block_is_reused_without_page_faults():
    kept, faults = _second_allocation_faults("keep")
    assert kept == "True" and faults < 1000
    kept, faults = _second_allocation_faults("default")
    assert kept == "None" and faults > 10000  # 64 MiB / 4 KiB = 16384 fresh pages: what the setting removes


def test_a_users_own_malloc_settings_are_left_alone():
    assert host_allocator._user_tuned({"MALLOC_ARENA_MAX_": "2"})
    assert host_allocator._user_tuned({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
    assert host_allocator._user_tuned({"MEGARL_KEEP_FREED_HOST_MEMORY": "0"})
    assert not host_allocator._user_tuned({"PATH": "/usr/bin", "MEGARL_KEEP_FREED_HOST_MEMORY": "1"})
