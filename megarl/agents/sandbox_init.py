"""The sandbox's first process (stdlib only; `megarl.agents.sandbox` passes this file's *text* to
`python -I -S -c`, so nothing of the repository is read once the namespaces exist).

It runs as root, as process 1 of fresh mount, pid, network, IPC and UTS namespaces made by
`unshare --fork --kill-child`, and:
  1. reads the program from stdin (the parent writes it, then closes the pipe);
  2. builds a new root on a small tmpfs: the interpreter's directories bound read-only, nosuid,
     nodev; /dev/null, zero, random, urandom; /sandbox, a size-limited tmpfs that is the only
     writable (and the only non-interpreter readable) place; then makes the root read-only;
  3. forks the program's process, which chroots into the new root, closes every other file,
     drops to the private uid/gid (no groups, no capabilities, no_new_privs), takes the rlimits
     and execs `python -I -B /sandbox/main.py` with a clean environment;
  4. stays as process 1: reaps orphans and exits with the program's status (128 + signal when a
     signal ended it). When it exits, or when `unshare` is killed (parent-death signal), the
     kernel kills everything left in the pid namespace.

argv[1]: JSON {uid, python, binds, links, limits{cpu_s, memory_bytes, processes, open_files,
file_bytes, disk_bytes}, max_code_bytes}.
"""
import ctypes
import json
import os
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
ROOT = "/tmp"  # mount point of the new root inside this mount namespace (the host's /tmp is untouched)
DEVICES = ("null", "zero", "random", "urandom")

libc = ctypes.CDLL(None, use_errno=True)


def fail(message):
    sys.stderr.write(f"megarl sandbox setup: {message}\n")
    sys.stderr.flush()
    os._exit(125)


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        fail(f"mount {source} -> {target}: {os.strerror(ctypes.get_errno())}")


def bind_readonly(path, inside):
    os.makedirs(inside, mode=0o755, exist_ok=True)
    mount(path, inside, None, MS_BIND)  # not MS_REC: mounts below the directory stay out
    mount(None, inside, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def build_root(params, code):
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here propagates to the host
    mount("tmpfs", ROOT, "tmpfs", MS_NOSUID, "size=1m,mode=0755")
    for path in params["binds"]:
        bind_readonly(path, ROOT + path)
    for name, target in params["links"].items():
        os.symlink(target, ROOT + name)
    os.makedirs(ROOT + "/dev", mode=0o755)
    for dev in DEVICES:
        open(f"{ROOT}/dev/{dev}", "w").close()
        mount(f"/dev/{dev}", f"{ROOT}/dev/{dev}", None, MS_BIND)
    uid, limits = params["uid"], params["limits"]
    os.makedirs(ROOT + "/sandbox", mode=0o700)
    mount("tmpfs", ROOT + "/sandbox", "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={limits['disk_bytes']},nr_inodes=1024,mode=0700,uid={uid},gid={uid}")
    with open(ROOT + "/sandbox/main.py", "wb") as f:
        f.write(code)
    os.chown(ROOT + "/sandbox/main.py", uid, uid)
    mount(None, ROOT, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID)


def become_program(params):
    """In the forked child: enter the root, drop everything, exec the program (never returns)."""
    uid, limits = params["uid"], params["limits"]
    os.chroot(ROOT)
    os.chdir("/sandbox")
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.closerange(3, 65536)
    # The CPU hard limit sits one second above the soft one, so the program gets SIGXCPU (a hard
    # limit equal to it would make the kernel send SIGKILL instead) and is killed a second later.
    for kind, soft, hard in ((resource.RLIMIT_CPU, limits["cpu_s"], limits["cpu_s"] + 1),
                             (resource.RLIMIT_AS, limits["memory_bytes"], limits["memory_bytes"]),
                             (resource.RLIMIT_NPROC, limits["processes"], limits["processes"]),
                             (resource.RLIMIT_NOFILE, limits["open_files"], limits["open_files"]),
                             (resource.RLIMIT_FSIZE, limits["file_bytes"], limits["file_bytes"]),
                             (resource.RLIMIT_CORE, 0, 0)):
        resource.setrlimit(kind, (soft, hard))
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # from uid 0 to another: every capability is dropped
    if os.getuid() != uid or os.geteuid() != uid:
        fail("could not drop to the sandbox uid")
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    env = {"PATH": "/usr/bin:/bin", "HOME": "/sandbox", "TMPDIR": "/sandbox", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    os.execve(params["python"], [params["python"], "-I", "-B", "/sandbox/main.py"], env)


def main():
    params = json.loads(sys.argv[1])
    code = sys.stdin.buffer.read(params["max_code_bytes"] + 1)
    if len(code) > params["max_code_bytes"]:
        fail(f"the program is longer than {params['max_code_bytes']} bytes")
    build_root(params, code)
    child = os.fork()
    if child == 0:
        try:
            become_program(params)
        except BaseException as e:  # noqa: BLE001 - any failure here must end the child, not run the program
            fail(f"{type(e).__name__}: {e}")
    status = 0
    while True:  # process 1 reaps every orphan; it ends with the program
        try:
            pid, wait_status = os.wait()
        except ChildProcessError:
            break
        if pid == child:
            status = os.waitstatus_to_exitcode(wait_status)
            break
    os._exit(status if status >= 0 else 128 - status)


main()
