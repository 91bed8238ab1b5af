"""Run a command so that it can write only inside one folder, and dies with its grading.

    python -m labkit.grading.sandbox --scratch DIR [--hide PATH ...] -- CMD ...      (inside `command()`)

`command()` wraps CMD in util-linux's `unshare`, which ships with every Debian/Ubuntu image (no
root needed where unprivileged user namespaces are enabled, the default on Debian 11+ and on
Ubuntu before 24.04): a user namespace, a mount namespace and a PID namespace. Inside, this module
runs as PID 1 and, before starting CMD:
  - remounts every filesystem read-only except DIR (the graded copy) and a private /dev/shm;
  - covers each --hide path (the reference solutions) with an empty read-only tmpfs;
  - drops every capability, so CMD cannot undo a mount (the mounts are locked in any namespace it
    creates itself).
When CMD ends, PID 1 returns and the kernel kills every process left in the namespace; when the
grader kills `unshare` (a timeout), `--kill-child` takes PID 1 and so the namespace down with it.
"""

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 38, 24
# statvfs flag -> mount flag; a remount must repeat the flags the outer namespace locked.
_KEEP = {
    os.ST_NOSUID: MS_NOSUID,
    os.ST_NODEV: MS_NODEV,
    os.ST_NOEXEC: MS_NOEXEC,
    os.ST_NOATIME: MS_NOATIME,
    os.ST_NODIRATIME: MS_NODIRATIME,
    os.ST_RELATIME: MS_RELATIME,
}
UNSHARE = ["unshare", "--user", "--map-root-user", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc"]


def unavailable() -> str | None:
    """Why the sandbox cannot run here, or None when it can."""
    if shutil.which("unshare") is None:
        return "`unshare` (util-linux) is not installed"
    probe = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`unshare` cannot create user/mount/PID namespaces here: {probe.stderr.strip()}"
    return None


def command(cmd: list[str], scratch: Path, hide: list[Path]) -> list[str]:
    """`cmd` wrapped so that it runs sandboxed with `scratch` as its only writable folder."""
    hidden = [arg for p in hide for arg in ("--hide", str(p))]
    return [*UNSHARE, sys.executable, "-m", "labkit.grading.sandbox", "--scratch", str(scratch), *hidden, "--", *cmd]


def _mount(source, target, fstype, flags, data=None) -> None:
    enc = [None if a is None else str(a).encode() for a in (source, target, fstype, data)]
    if _libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _mount_points() -> list[str]:
    with open("/proc/self/mountinfo") as f:  # field 5 is the mount point, octal-escaped
        points = [line.split()[4].encode().decode("unicode_escape") for line in f]
    return sorted(set(points), key=len)


def seal(scratch: Path, hide: list[Path]) -> None:
    """Make everything but `scratch` read-only, give /dev/shm a private tmpfs, cover `hide`."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    _mount(scratch, scratch, None, MS_BIND | MS_REC)
    for point in _mount_points():
        if point == str(scratch) or point.startswith(("/proc", "/sys", "/dev")):
            continue
        flags = sum(ms for st, ms in _KEEP.items() if os.statvfs(point).f_flag & st)
        try:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
        except PermissionError:
            # A mount the outer namespace locked in a way this remount cannot express: it is
            # not writable here either (read-only or not owned), so leaving it is safe.
            continue
    if Path("/dev/shm").is_dir():
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV)
    for path in hide:
        if path.is_dir():
            _mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k")


def _drop_privileges() -> None:
    """In the child before exec: no capability survives, so no mount can be undone."""
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != 22:  # EINVAL: no such cap
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Run CMD with only SCRATCH writable (used inside unshare).")
    ap.add_argument("--scratch", type=Path, required=True)
    ap.add_argument("--hide", type=Path, action="append", default=[])
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    seal(args.scratch.resolve(), args.hide)
    keep = [int(fd) for fd in os.environ.get("LABKIT_PASS_FDS", "").split(",") if fd]
    child = subprocess.Popen(cmd, pass_fds=keep, preexec_fn=_drop_privileges)
    for fd in keep:  # only CMD holds the outcome pipe: no copy here for the graded code to find
        os.close(fd)
    return child.wait()  # returning ends PID 1: the kernel kills whatever CMD left behind


if __name__ == "__main__":
    sys.exit(main())
