"""A small filesystem of the test's own that a test can fill up (not a test module): the kernel's
own "No space left on device" (ENOSPC) for every process writing to it, the way a full data
disk fails, while the rest of the machine's disks are untouched.

`small_disk(workdir, size_mib)` mounts a size-limited tmpfs on `workdir/mnt` (`mount -t tmpfs
-o size=…`); where the kernel refuses that mount but allows block-device mounts, an ext4
filesystem of that size in an image file, loop-mounted (`mkfs.ext4 -m 0`: no blocks reserved
for root, so that root, which the tests run as, runs out like anyone). Both need the right to
mount (root with CAP_SYS_ADMIN, as CI is); `MountRefused` says why neither worked. Leaving the
context unmounts it (lazily if something still holds it open) and deletes what was in it.

`disk.fill()` writes a ballast file until the filesystem refuses another byte, `disk.free()`
deletes it: the space comes back at once, for every process.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

COMMAND_TIMEOUT_S = 30.0
# Ballast written in chunks getting smaller, so that the last block is filled to the byte.
CHUNKS = (1 << 20, 64 << 10, 4 << 10, 512, 1)


class MountRefused(RuntimeError):
    """No small filesystem could be mounted here (no right to mount)."""


@dataclass
class SmallDisk:
    path: Path  # the mount point
    kind: str  # what it is, for the test's report
    ballast_bytes: int = 0

    @property
    def ballast(self) -> Path:
        return self.path / "ballast"

    def free_bytes(self) -> int:
        stat = os.statvfs(self.path)
        return stat.f_bavail * stat.f_frsize

    def fill(self) -> int:
        """Write the ballast until ENOSPC at every chunk size down to one byte; the bytes
        written. Anything but ENOSPC is raised."""
        fd = os.open(self.ballast, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for size in CHUNKS:
                chunk = b"\0" * size
                while True:
                    try:
                        written = os.write(fd, chunk)
                    except OSError as exc:
                        if exc.errno != errno.ENOSPC:
                            raise
                        break
                    self.ballast_bytes += written
                    if written < size:
                        break
            with suppress(OSError):  # ext4: nothing delayed left to allocate (or ENOSPC)
                os.fsync(fd)
        finally:
            os.close(fd)
        return self.ballast_bytes

    def free(self) -> None:
        self.ballast.unlink(missing_ok=True)
        self.ballast_bytes = 0


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )


def _mount_tmpfs(mnt: Path, size_mib: int) -> str | None:
    """Mount the tmpfs; None, or why not."""
    if shutil.which("mount") is None:
        return "mount not installed (Debian: mount)"
    done = _run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0755", "fleet-chaos", str(mnt)]
    )
    return None if done.returncode == 0 else f"mount -t tmpfs: {done.stderr.strip()}"


def _mount_ext4(mnt: Path, image: Path, size_mib: int) -> str | None:
    """Make and loop-mount the ext4 image; None, or why not."""
    if shutil.which("mkfs.ext4") is None:
        return "mkfs.ext4 not installed (Debian: e2fsprogs)"
    with image.open("wb") as handle:
        handle.truncate(size_mib << 20)
    made = _run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)])
    if made.returncode != 0:
        return f"mkfs.ext4: {made.stderr.strip()}"
    done = _run(["mount", "-o", "loop", str(image), str(mnt)])
    return None if done.returncode == 0 else f"mount -o loop: {done.stderr.strip()}"


@contextmanager
def small_disk(workdir: Path, size_mib: int = 16) -> Iterator[SmallDisk]:
    """See the module docstring; `workdir` is on a disk of its own (the image file lives
    there)."""
    mnt = workdir / "mnt"
    mnt.mkdir(parents=True, exist_ok=True)
    image = workdir / "disk.img"
    problems: list[str] = []
    kind = ""
    if (problem := _mount_tmpfs(mnt, size_mib)) is None:
        kind = f"tmpfs of {size_mib} MiB"
    else:
        problems.append(problem)
        if (problem := _mount_ext4(mnt, image, size_mib)) is None:
            kind = f"ext4 of {size_mib} MiB on a loop device"
        else:
            problems.append(problem)
    if not kind:
        image.unlink(missing_ok=True)
        raise MountRefused("; ".join(problems))
    try:
        yield SmallDisk(mnt, kind)
    finally:
        if _run(["umount", str(mnt)]).returncode != 0:
            _run(["umount", "-l", str(mnt)])  # something still holds it: detach it anyway
        image.unlink(missing_ok=True)
