"""The virtual colo's SSH hosts (`fleetctl lab up --ssh`): each lab server's OS is a real sshd.

When a server powers on in SSH mode, after the boot delay the lab starts its HOST instead of its
own agent: `unshare --mount --pid --fork --mount-proc --kill-child` runs `python -m
fleet.lab.ssh_hosts init HOST.json` as PID 1 of a new PID namespace with a private mount
namespace. That init:
- mounts a tmpfs on /run (sshd's /run/sshd, the stand-in's runtime state, /run/systemd/system
  so that Ansible's fact gathering sees "systemd"), then binds the host's own directories
  (`workdir/hosts/<name>/{opt,etc,lib,log,units}`) onto /opt/fleet-agent, /etc/fleet-agent,
  /var/lib/fleet-agent, /var/log/fleet-agent and /etc/systemd/system, and the host's shims
  (`bin/`: systemctl, journalctl, reboot, each exec'ing the STAND-IN in
  fleet/lab/standin_systemd.py) onto /usr/local/sbin, the first directory of root's PATH, and
  over /usr/bin/systemctl and /usr/bin/journalctl where those exist;
- starts the enabled units (the stand-in's `boot`, as systemd would), then `/usr/sbin/sshd -D
  -e` on 127.0.0.1:<the host's port> with its own host key, root login by the lab's client key
  only, sftp built in;
- on SIGTERM (a reboot, the lab going down) stops sshd and the units; when it exits, the kernel
  kills every process left in its PID namespace. A power-off SIGKILLs it at once: a power cut.

The mount points must exist on the real filesystem: the lab creates the missing ones as empty
directories (the only change it makes outside its working directory; the real /etc/ssh,
/root/.ssh and /etc/passwd are never touched). Namespaces and mounts need root: SSH mode says so
in one line otherwise. Keys: one client key pair for the fleet (`workdir/ssh/id_ed25519`, 0600,
kept across runs) and one ed25519 host key per server (`workdir/hosts/<name>/ssh/`, kept, so a
server keeps its fingerprint across lab restarts like a real one).

Stdlib only: the init starts with every host boot.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet.lab import LabError

SSHD = Path("/usr/sbin/sshd")
LISTEN = "127.0.0.1"
CLIENT_KEY = Path("ssh") / "id_ed25519"
AUTHORIZED_KEYS = Path("ssh") / "authorized_keys"
# The host's own directories (under workdir/hosts/<name>/) and where they appear inside it.
HOST_MOUNTS: dict[str, str] = {
    "opt": "/opt/fleet-agent",
    "etc": "/etc/fleet-agent",
    "lib": "/var/lib/fleet-agent",
    "log": "/var/log/fleet-agent",
    "units": "/etc/systemd/system",
}
SHIM_DIR = "/usr/local/sbin"  # first on root's PATH (sshd's superuser path, Debian)
SHIMMED = ("systemctl", "journalctl")  # also bound over /usr/bin/<name> where it exists
ROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
KEYGEN_TIMEOUT_S = 30.0
SSHD_CHECK_TIMEOUT_S = 10.0
INIT_POLL_S = 0.1


def check_ssh_mode() -> None:
    """SSH mode's requirements, as one line naming what is missing."""
    if os.geteuid() != 0:
        raise LabError(
            "the lab's SSH mode needs root (mount and PID namespaces, sshd): run as root"
        )
    missing = [tool for tool in ("unshare", "mount", "ssh-keygen") if shutil.which(tool) is None]
    if not SSHD.is_file():
        missing.append(str(SSHD))
    if missing:
        raise LabError(
            f"the lab's SSH mode needs {', '.join(missing)}: install util-linux and "
            "openssh-server (Debian)"
        )


def fingerprint_of_public(line: str) -> str:
    """`SHA256:<base64, unpadded>` of an OpenSSH public key line, as `ssh-keygen -lf` prints."""
    try:
        blob = base64.b64decode(line.split()[1], validate=True)
    except (IndexError, ValueError):
        raise LabError("not an OpenSSH public key line") from None
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def _keygen(path: Path, comment: str) -> None:
    """An ed25519 key pair at `path` (0600) and `path`.pub, unless one is there already."""
    if path.is_file() and path.with_name(path.name + ".pub").is_file():
        path.chmod(0o600)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in (path, path.with_name(path.name + ".pub")):
        stale.unlink(missing_ok=True)
    done = subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=KEYGEN_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise LabError(f"ssh-keygen could not make {path}: exit {done.returncode}")
    path.chmod(0o600)


def ensure_client_key(workdir: Path | str) -> Path:
    """The lab's client key for the fleet (and Ansible): `workdir/ssh/id_ed25519` (0600), made
    once; its public half is what every lab host authorizes for root."""
    workdir = Path(workdir).resolve()
    key = workdir / CLIENT_KEY
    key.parent.mkdir(parents=True, exist_ok=True)
    key.parent.chmod(0o700)
    _keygen(key, "fleet-lab-client")
    pub = key.with_name(key.name + ".pub").read_text().strip()
    (workdir / AUTHORIZED_KEYS).write_text(pub + "\n")
    return key


@dataclass
class SshHost:
    """One server's OS in SSH mode: its directories, keys, sshd config and init settings."""

    name: str
    dir: Path  # workdir/hosts/<name>
    port: int  # sshd on 127.0.0.1
    authorized_keys: Path
    stop_grace_s: float = 3.0
    fingerprint: str = ""

    @property
    def host_key(self) -> Path:
        return self.dir / "ssh" / "ssh_host_ed25519_key"

    @property
    def config(self) -> Path:
        return self.dir / "host.json"

    @property
    def console(self) -> Path:
        """The host's console: its init's and sshd's output."""
        return self.dir / "console.log"

    @property
    def reboot_request(self) -> Path:
        from fleet.lab.standin_systemd import REBOOT_REQUEST

        return self.dir / REBOOT_REQUEST

    @property
    def journal(self) -> Path:
        from fleet.lab.standin_systemd import JOURNAL_DIR

        return self.dir / JOURNAL_DIR

    def public_key_line(self) -> str:
        return self.host_key.with_name(self.host_key.name + ".pub").read_text().strip()

    def known_hosts_line(self) -> str:
        kind, blob = self.public_key_line().split()[:2]
        return f"[{LISTEN}]:{self.port} {kind} {blob}"

    def prepare(self) -> None:
        """Directories, host key, sshd config, shims and the init's settings (idempotent)."""
        for sub in (*HOST_MOUNTS, "bin", "ssh", "journal"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        (self.dir / "ssh").chmod(0o700)
        _keygen(self.host_key, f"fleet-lab-host-{self.name}")
        self.fingerprint = fingerprint_of_public(self.public_key_line())
        sshd_config = self.dir / "ssh" / "sshd_config"
        sshd_config.write_text(
            "\n".join(
                [
                    f"ListenAddress {LISTEN}",
                    f"Port {self.port}",
                    f"HostKey {self.host_key}",
                    f"AuthorizedKeysFile {self.authorized_keys}",
                    "PermitRootLogin prohibit-password",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    # The lab's files live under a working directory that may sit in /tmp.
                    "StrictModes no",
                    "PidFile none",
                    "UseDNS no",
                    "PrintMotd no",
                    "MaxStartups 100:30:200",
                    "MaxSessions 64",
                    "Subsystem sftp internal-sftp",
                    f"SetEnv PATH={ROOT_PATH}",
                    "AcceptEnv LANG LC_*",
                    "",
                ]
            )
        )
        base = shlex.join(
            [
                sys.executable,
                "-P",
                "-m",
                "fleet.lab.standin_systemd",
                "--host-dir",
                str(self.dir),
                "--hostname",
                self.name,
            ]
        )
        for program in ("systemctl", "journalctl", "reboot"):
            shim = self.dir / "bin" / program
            shim.write_text(
                "#!/bin/sh\n"
                "# The lab's STAND-IN (fleet/lab/standin_systemd.py): no systemd runs here.\n"
                f'exec {base} {program} "$@"\n'
            )
            shim.chmod(0o755)
        settings = {
            "name": self.name,
            "dir": str(self.dir),
            "sshd_config": str(sshd_config),
            "mounts": [[str(self.dir / sub), dst] for sub, dst in HOST_MOUNTS.items()],
            "shim_dir": str(self.dir / "bin"),
            "stop_grace_s": self.stop_grace_s,
        }
        self.config.write_text(json.dumps(settings, indent=1))
        for target in (*HOST_MOUNTS.values(), SHIM_DIR):
            # Mount points must exist on the real filesystem: empty directories if missing.
            Path(target).mkdir(parents=True, exist_ok=True)

    def command(self) -> list[str]:
        """The argv that boots this host (see the module doc)."""
        return [
            "unshare",
            "--mount",
            "--pid",
            "--fork",
            "--mount-proc",
            "--propagation",
            "private",
            "--kill-child=SIGKILL",
            "--",
            sys.executable,
            "-P",
            "-m",
            "fleet.lab.ssh_hosts",
            "init",
            str(self.config),
        ]


def check_sshd_config(host: SshHost) -> None:
    """`sshd -t` on the host's config: a bad one is a one-line LabError before any boot."""
    # In a throwaway mount namespace with its own /run: sshd -t wants /run/sshd, which the
    # real machine need not have (the hosts get theirs on their own tmpfs).
    script = 'mount -t tmpfs tmpfs /run && mkdir /run/sshd && exec "$0" -t -f "$1"'
    done = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            script,
            str(SSHD),
            str(host.dir / "ssh" / "sshd_config"),
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=SSHD_CHECK_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()
        raise LabError(f"{host.name}: sshd refuses its config: {why[-1] if why else 'no reason'}")


# ---------------------------------------------------------------------------------------------
# The host's init (PID 1 of its namespace)


def _say(message: str) -> None:
    sys.stderr.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} lab-init: {message}\n")
    sys.stderr.flush()


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, check=False, timeout=30)
    if done.returncode != 0:
        raise LabError(f"mount {' '.join(args)}: {done.stderr.decode(errors='replace').strip()}")


def init_main(config_path: str) -> int:
    """PID 1 of a lab host: mounts, the enabled units, sshd; SIGTERM stops it all."""
    from fleet.lab import standin_systemd as standin

    settings: dict[str, Any] = json.loads(Path(config_path).read_text())
    if os.getpid() != 1:
        _say("not PID 1 of a PID namespace: refusing to mount anything")
        return 2
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _: stopping.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _: stopping.append(signum))
    try:
        _mount("-t", "tmpfs", "-o", "mode=0755,nosuid,nodev,size=64m", "tmpfs", "/run")
        os.makedirs("/run/sshd", 0o755, exist_ok=True)
        os.makedirs("/run/systemd/system", 0o755, exist_ok=True)
        for source, target in settings["mounts"]:
            _mount("--bind", source, target)
        _mount("--bind", settings["shim_dir"], SHIM_DIR)
        for program in SHIMMED:
            real = Path("/usr/bin") / program
            if real.is_file():
                _mount("--bind", str(Path(settings["shim_dir"]) / program), str(real))
    except LabError as exc:
        _say(str(exc))
        return 1
    os.environ["PATH"] = ROOT_PATH
    os.chdir("/")
    paths = standin.Paths(Path(settings["dir"]), settings["name"])
    started = standin.boot(paths)
    _say(f"boot: started {', '.join(started) or 'no units'}")
    sshd = subprocess.Popen(
        [str(SSHD), "-D", "-e", "-f", settings["sshd_config"]], stdin=subprocess.DEVNULL
    )
    _say(f"sshd pid {sshd.pid}")
    code = 0
    while not stopping:
        # PID 1 reaps every orphan of the namespace.
        with contextlib.suppress(ChildProcessError):
            while True:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                if pid == sshd.pid:
                    sshd.returncode = os.waitstatus_to_exitcode(status)
        if sshd.returncode is not None:
            _say(f"sshd exited with status {sshd.returncode}: the host goes down")
            code = 1
            break
        time.sleep(INIT_POLL_S)
    _say("shutting down: sshd, then the units")
    if sshd.returncode is None:
        sshd.terminate()
    grace = float(settings.get("stop_grace_s", 3.0))
    standin.shutdown(paths, max(0.5, grace - 0.5))
    return code  # PID 1 exits: the kernel kills whatever is left in the namespace


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "init":
        return init_main(argv[1])
    sys.stderr.write("usage: python -m fleet.lab.ssh_hosts init HOST.json\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
