#!/usr/bin/env python3
"""Does the Dockerfile's AReaL step resolve on top of SGLang's pins? Asks pip's own resolver, installing
nothing, on a machine that has neither SGLang, the base image nor a GPU (CI).

    check_resolves.py pins                       SGLang's constraints, as docker/base-pins.py makes them
    check_resolves.py check [--no-overrides] [--report FILE] [REQUIREMENT ...]

Both read what they check from the Dockerfile and this folder: the SGLang version from BASE_IMAGE
(lmsysorg/sglang:v<version>), the requirement from the AReaL step (`pip install "areal==..."`), the
overrides from docker/areal-overrides.txt. `pins` applies docker/base-pins.py's own rules to
sglang's wheel metadata on PyPI, for the image's interpreter (CPython 3.12, Linux x86_64); in the
image the exact pins are held at the base's versions, the same ones unless the base deviates.

`check` runs `pip install --dry-run --ignore-installed --report` for the requirements under those
constraints (with the overrides in place of SGLang's pins of the same names, unless --no-overrides),
for the image's interpreter and platform. Exit 0: it resolves (what the constrained names resolve to
goes to stdout). Exit 1: pip's resolver says no (pip's own explanation goes to stderr). Exit 2: the
check could not run (network, usage, a pip that cannot be bootstrapped): the reason on stderr.

Downloads are metadata only: pip >= 25.3 reads a wheel's metadata without downloading it in --dry-run
(PEP 658 files or, with --use-feature=fast-deps, HTTP range requests: PyPI mirrors without the PEP 658
files exist). Older pips download every wheel of the solution (torch and its CUDA libraries: GBs), so
`check` runs its own pip, bootstrapped once into a venv in the cache. Sdist-only requirements
(word2number, ...) cannot be resolved for a foreign --platform: `check` builds each such wheel once
into the cache's wheelhouse and retries, as long as it is pure Python. The cache:
${PODKIT_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/podkit}/check-resolves.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # every pip vendors packaging
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version

HERE = Path(__file__).resolve().parent
DOCKERFILE = HERE.parent / "Dockerfile"
OVERRIDES = HERE / "areal-overrides.txt"
PYTHON = "3.12"  # lmsysorg/sglang images: Ubuntu 24.04's python3.12, glibc 2.39
GLIBC = (2, 39)
PIP_MIN = Version("25.3")
PIP_BOOTSTRAP = "pip==26.3"
MAX_BUILDS = 10
# areal's sdist-only requirements, built before the first resolve: a resolve that meets one unbuilt
# stops there, and starts over once it is built.
SDIST_ONLY = ["word2number", "timeout-decorator"]


def _base_pins():
    """docker/base-pins.py, the image's own rules (its file name is not a module name)."""
    spec = importlib.util.spec_from_file_location("base_pins", HERE / "base-pins.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


base_pins = _base_pins()


class CheckError(Exception):
    """The check could not run (exit 2)."""


def dockerfile_step(path: Path = DOCKERFILE) -> tuple[str, list[str]]:
    """(SGLang's version, the AReaL step's requirements), read from the Dockerfile."""
    text = path.read_text()
    base = re.search(r"^ARG BASE_IMAGE=lmsysorg/sglang:v(\S+?)(?:-\S+)?$", text, re.M)
    reqs = re.findall(r'pip install "(areal[^"]*)" -c /tmp/base-pins\.txt', text)
    if not base or not reqs:
        raise CheckError(f"{path}: no `ARG BASE_IMAGE=lmsysorg/sglang:v<version>` or no AReaL step "
                         '(`pip install "areal==<version>" -c /tmp/base-pins.txt`): was it reworded?')
    return base.group(1), reqs


def target_environment() -> dict[str, str]:
    """Environment markers of the image's interpreter."""
    env = default_environment()
    env.update(python_version=PYTHON, python_full_version=PYTHON + ".3", sys_platform="linux",
               platform_system="Linux", platform_machine="x86_64", os_name="posix",
               implementation_name="cpython", platform_python_implementation="CPython")
    return env


def platform_args() -> list[str]:
    # pip matches --platform literally (no manylinux_2_x fallback), so list every tag glibc 2.39 runs.
    tags = [f"manylinux_{GLIBC[0]}_{m}_x86_64" for m in range(GLIBC[1], 4, -1)]
    tags += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    args = ["--python-version", PYTHON, "--implementation", "cp", "--only-binary=:all:"]
    for t in tags:
        args += ["--platform", t]
    return args


def cache_root() -> Path:
    """Shared with rehearse/env.sh: CI on the same machine reuses it."""
    root = os.environ.get("PODKIT_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or
                                                       Path.home() / ".cache") / "podkit"
    return Path(root) / "check-resolves"


class Pip:
    """A pip new enough for metadata-only dry runs, with the cache's wheelhouse and HTTP cache."""

    def __init__(self, cache: Path, verbose: bool = False):
        self.wheelhouse, self.verbose = cache / "wheels", verbose
        self.env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1",
                        PIP_CACHE_DIR=str(cache / "pip"))
        self.python = ensure_pip(find_python(), cache / ("venv-" + PIP_BOOTSTRAP.replace("==", "-")))
        self.version = Version(self.run(["--version"], check=True).stdout.split()[1])

    def run(self, args: list[str], check: bool = False) -> subprocess.CompletedProcess:
        cmd = [self.python, "-m", "pip", *args]
        if self.verbose:
            print("+", " ".join(cmd), file=sys.stderr)
        r = subprocess.run(cmd, capture_output=True, text=True, env=self.env)
        if check and r.returncode != 0:
            raise CheckError(f"{' '.join(cmd[:5])} ... failed ({r.returncode}):\n{r.stderr[-4000:]}")
        return r

    def dry_run(self, reqs: list[str], report: Path, extra: list[str]) -> subprocess.CompletedProcess:
        self.wheelhouse.mkdir(parents=True, exist_ok=True)
        return self.run(["install", "--dry-run", "--ignore-installed", "--use-feature=fast-deps",
                         "--progress-bar", "off", "--report", str(report),
                         "--find-links", str(self.wheelhouse), *platform_args(), *extra, *reqs])


def find_python() -> str:
    """The image's CPython 3.12 where this machine has one (pip evaluates some markers for the
    interpreter it runs on, whatever --python-version says, and builds sdist-only wheels with it),
    else this one."""
    if f"{sys.version_info[0]}.{sys.version_info[1]}" == PYTHON:
        return sys.executable
    cands = [shutil.which(f"python{PYTHON}")] + sorted(glob.glob(os.path.expanduser(
        f"~/.pyenv/versions/{PYTHON}.*/bin/python{PYTHON}")), reverse=True)
    for c in cands:
        if c and subprocess.run([c, "-c", "import venv, ensurepip"], capture_output=True).returncode == 0:
            return c
    return sys.executable


def ensure_pip(python: str, venv: Path) -> str:
    """`python` where its pip does metadata-only dry runs, else a venv of it with PIP_BOOTSTRAP."""
    r = subprocess.run([python, "-m", "pip", "--version"], capture_output=True, text=True)
    if r.returncode == 0 and Version(r.stdout.split()[1]) >= PIP_MIN:
        return python
    vpy, ready = venv / "bin" / "python", venv / ".ready"
    if not ready.exists():
        for cmd in ([python, "-m", "venv", "--clear", str(venv)],
                    [str(vpy), "-m", "pip", "install", "-q", "--disable-pip-version-check", PIP_BOOTSTRAP]):
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise CheckError(f"bootstrapping {PIP_BOOTSTRAP} into {venv}: {' '.join(cmd)} failed:\n"
                                 f"{r.stderr[-2000:]}")
        ready.touch()
    return str(vpy)


def sglang_pins(pip: Pip, version: str, overrides: list[str], workdir: Path) -> list[str]:
    """sglang==VERSION and docker/base-pins.py's rules applied to its wheel's Requires-Dist, read
    from the same metadata pip's resolver reads."""
    report = workdir / "sglang-metadata.json"
    r = pip.dry_run([f"sglang=={version}"], report, ["--no-deps"])
    if r.returncode != 0:
        raise CheckError(f"could not read sglang=={version}'s metadata:\n{pip_message(r)}")
    (item,) = json.loads(report.read_text())["install"]
    requires = item["metadata"].get("requires_dist", [])
    return [f"sglang=={version}", *base_pins.constraints(requires, target_environment(), overrides)]


NO_DIST = re.compile(r"No matching distribution found for (\S+)")
NOISE = re.compile(r"^\s*(Collecting|Obtaining dependency|Processing|Downloading|Using cached|Looking in|"
                   r"Requirement already|WARNING: pip is using lazily|WARNING: Location)")


def pip_message(r: subprocess.CompletedProcess) -> str:
    """pip's own explanation: 'The conflict is caused by' goes to stdout, the ERROR lines to stderr;
    the progress lines around them are left out."""
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip() and not NOISE.match(ln)]
    return "\n".join(lines[-80:])


def build_sdist_only(pip: Pip, req: str) -> bool:
    """Build a pure-Python wheel of an sdist-only requirement into the wheelhouse."""
    pip.wheelhouse.mkdir(parents=True, exist_ok=True)
    before = set(pip.wheelhouse.glob("*.whl"))
    r = pip.run(["wheel", "--no-deps", "--no-binary", Requirement(req).name, "-w", str(pip.wheelhouse), req])
    new = set(pip.wheelhouse.glob("*.whl")) - before
    bad = [w for w in new if not re.search(r"-py(2\.py)?3-none-any\.whl$", w.name)]
    for w in bad:
        w.unlink()
    return r.returncode == 0 and bool(new) and not bad


def check(pip: Pip, constraints: list[str], reqs: list[str], report: Path, workdir: Path) -> tuple[int, str]:
    """(0, summary) where pip resolves `reqs` under `constraints`, (1, pip's message) where it cannot."""
    cfile = workdir / "constraints.txt"
    cfile.write_text("\n".join(constraints) + "\n")
    have = {canonicalize_name(w.name.split("-", 1)[0]) for w in pip.wheelhouse.glob("*.whl")}
    for name in SDIST_ONLY:
        if name not in have:
            build_sdist_only(pip, name)  # a failure here shows again in the resolve, with pip's words
    for _ in range(MAX_BUILDS + 1):
        r = pip.dry_run(reqs, report, ["-c", str(cfile)])
        if r.returncode == 0:
            return 0, summarize(report, constraints)
        if "ResolutionImpossible" in r.stderr:
            return 1, pip_message(r)
        m = NO_DIST.search(r.stderr)
        if m and build_sdist_only(pip, m.group(1)):
            continue  # an sdist-only project, now in the wheelhouse
        if m:
            return 1, pip_message(r)
        raise CheckError(pip_message(r))
    raise CheckError(f"more than {MAX_BUILDS} sdist-only projects")


def summarize(report: Path, constraints: list[str]) -> str:
    got = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
           for i in json.loads(report.read_text())["install"]}
    lines = [f"resolves: {len(got)} distributions; the constrained ones:"]
    for c in constraints:
        req = Requirement(c)
        if canonicalize_name(req.name) in got:
            lines.append(f"  {req.name}=={got[canonicalize_name(req.name)]}  (constraint {req.specifier})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["pins", "check"])
    ap.add_argument("requirements", nargs="*", help="default: the Dockerfile's AReaL step's")
    ap.add_argument("--no-overrides", action="store_true", help="SGLang's pins as they are (a conflict)")
    ap.add_argument("--report", help="keep pip's --report JSON here")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_intermixed_args(argv)

    t0 = time.monotonic()
    try:
        sglang, step = dockerfile_step()
        reqs = a.requirements or step
        overrides = [] if a.no_overrides or a.command == "pins" else base_pins.read_lines(str(OVERRIDES))
        pip = Pip(cache_root(), a.verbose)
        with tempfile.TemporaryDirectory(prefix="check-resolves-") as tmp:
            work = Path(tmp)
            pins = sglang_pins(pip, sglang, overrides, work)
            if a.command == "pins":
                print(f"# sglang=={sglang}'s constraints for CPython {PYTHON} on Linux x86_64, from its wheel's "
                      "metadata (docker/check_resolves.py pins)")
                print("\n".join(pins))
                return 0
            report = Path(a.report) if a.report else work / "report.json"
            rc, text = check(pip, pins, reqs, report, work)
    except CheckError as e:
        print(f"check_resolves: could not check: {e}", file=sys.stderr)
        return 2
    what = f"{' '.join(reqs)} on sglang=={sglang}'s pins {'without' if a.no_overrides else 'with'} overrides"
    took = f"({time.monotonic() - t0:.0f} s, pip {pip.version})"
    if rc == 0:
        print(f"{text}\n{what}: resolves {took}")
    else:
        print(f"{text}\ncheck_resolves: {what}: does not resolve {took}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
