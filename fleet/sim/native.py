"""The simulator's hot modules compiled with mypyc: the same source, 4–8× faster (bench/sim.py).

A simulated request spends its time in six modules: the engine (fleet/sim/engine.py), the
loop (fleet/sim/core.py) and the router's strategy, pool, estimates and admission queue that
the loop imports (fleet/router/). mypyc compiles exactly those files, as they are and as mypy
checks them, to C extensions; nothing is re-implemented, and the results are the same to the
bit (tests/e2e/test_sim_native.py compares every request's times, compiled against pure Python).

The build goes to a cache directory named by a key over the six sources, the Python and the
mypy version (`FLEET_SIM_NATIVE_DIR`, else $XDG_CACHE_HOME/fleet/sim-native): an edited source
has a new key, so a stale build is never loaded, and the source tree stays free of `.so`
files (which Python would import before the `.py` beside them).

`enable()` puts a finder in front of the import system that loads the six modules (and the
shared library mypyc makes for them) from the build of the current key. It must run before any
of them is imported: a compiled pool handed a pure-Python replica would be two different
classes. Only the simulator (`fleetctl simulate`, bench/sim.py) calls it; the router serves
with the pure-Python modules. `FLEET_SIM_NATIVE=off` keeps the simulator in Python (the test
suite sets it, so that an in-process `fleetctl simulate` leaves later tests' imports alone).

Building needs a C compiler, Python's headers (Debian: gcc, python3-dev), mypy and setuptools
(the `native` extra); it takes about a minute.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

HOT_MODULES = (
    "fleet.router.admission",
    "fleet.router.estimates",
    "fleet.router.strategy",
    "fleet.router.pool",
    "fleet.sim.engine",
    "fleet.sim.core",
)
_ROOT = Path(__file__).resolve().parents[2]  # the directory that holds the fleet package
_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
_DONE = "built"  # marks a complete build (written last)
_BUILD = """
import sys
from setuptools import setup
from mypyc.build import mypycify

paths, target, lib, temp = sys.argv[1:-3], *sys.argv[-3:]
setup(
    name="fleet-sim-native",
    ext_modules=mypycify(paths, opt_level="3", target_dir=target, group_name="fleet_sim_native"),
    script_args=["-q", "build_ext", "--build-lib", lib, "--build-temp", temp],
)
"""


class NativeError(RuntimeError):
    """The compiled simulator could not be built; the message says why and what to install."""


def sources() -> list[Path]:
    return [_ROOT.joinpath(*name.split(".")).with_suffix(".py") for name in HOT_MODULES]


def _mypy_version() -> str | None:
    try:
        from mypy.version import __version__
    except ImportError:
        return None
    return __version__


def key() -> str:
    """Names the build of these sources for this Python and this mypy."""
    digest = hashlib.sha256()
    for path in sources():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(f"{sys.version}\0{_SUFFIX}\0{_mypy_version()}".encode())
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    explicit = os.environ.get("FLEET_SIM_NATIVE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "fleet" / "sim-native"


def build_dir() -> Path:
    return cache_root() / key()


def is_built() -> bool:
    return (build_dir() / _DONE).is_file()


def build(*, force: bool = False) -> Path:
    """Compile the hot modules into `build_dir()` (nothing to do when already built); returns
    the directory. Raises NativeError (one line; the compiler's output goes to a log beside
    the builds) when it fails."""
    target = build_dir()
    if is_built() and not force:
        return target
    if _mypy_version() is None or importlib.util.find_spec("setuptools") is None:
        raise NativeError("mypyc and setuptools compile the simulator: pip install 'fleet[native]'")
    if shutil.which(os.environ.get("CC", "gcc")) is None and shutil.which("cc") is None:
        raise NativeError("a C compiler is needed to compile the simulator (Debian: gcc)")
    include = sysconfig.get_paths()["include"]
    if not Path(include, "Python.h").is_file():
        raise NativeError(f"Python's headers are missing ({include}; Debian: python3-dev)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fleet-sim-native-") as tmp:
        work = Path(tmp)
        lib = work / "lib"
        argv = [str(p) for p in sources()] + [str(work / "c"), str(lib), str(work / "o")]
        env = {**os.environ, "MYPY_CACHE_DIR": str(work / "mypy-cache")}
        done = subprocess.run(
            [sys.executable, "-c", _BUILD, *argv],
            cwd=_ROOT,  # mypy reads the project's settings and finds its packages here
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        if done.returncode != 0:
            log = target.parent / "failed-build.log"
            log.write_text(done.stdout + done.stderr)
            last = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["no output"]
            raise NativeError(f"compiling the simulator failed ({last[0][:200]}); see {log}")
        (lib / _DONE).write_text(" ".join(HOT_MODULES) + "\n")
        # Into place in one rename: a concurrent build or an interrupted one leaves no half.
        staged = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        shutil.copytree(lib, staged, dirs_exist_ok=True)
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            staged.rename(target)
        except OSError:  # another build got there first: the same key, the same build
            shutil.rmtree(staged, ignore_errors=True)
    return target


class _Finder(importlib.abc.MetaPathFinder):
    """Loads the modules of one build (by full name) from their extension files."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        file = self.files.get(fullname)
        if file is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(file))
        return importlib.util.spec_from_file_location(fullname, file, loader=loader)


def _modules(root: Path) -> dict[str, Path]:
    """Module name → extension file, for every extension under `root`."""
    found = {}
    for file in root.rglob(f"*{_SUFFIX}"):
        name = file.relative_to(root).as_posix()[: -len(_SUFFIX)].replace("/", ".")
        found[name] = file
    return found


def enabled() -> bool:
    return any(isinstance(f, _Finder) for f in sys.meta_path)


def enable() -> str | None:
    """Import the hot modules compiled from now on. Returns None when they will be, else why
    not (one line: not built, or one of them is already imported as Python)."""
    if enabled():
        return None
    if os.environ.get("FLEET_SIM_NATIVE", "auto").lower() in {"off", "0", "false", "no"}:
        return "FLEET_SIM_NATIVE is off"
    if not is_built():
        return "not compiled for these sources (fleetctl simulate-compile)"
    loaded = [name for name in HOT_MODULES if name in sys.modules]
    if loaded:
        return f"{loaded[0]} is already imported as Python"
    files = _modules(build_dir())
    missing = [name for name in HOT_MODULES if name not in files]
    if missing:
        return f"the build in {build_dir()} lacks {missing[0]}"
    sys.meta_path.insert(0, _Finder(files))
    return None


def active() -> bool:
    """The simulator in this process runs compiled (fleet.sim.core came from a build)."""
    core = sys.modules.get("fleet.sim.core")
    return core is not None and str(getattr(core, "__file__", "")).endswith(_SUFFIX)
