"""The Dockerfile's AReaL step, resolved by pip's own resolver against SGLang's pins: no image, no GPU,
no SGLang; PyPI, metadata only (docker/check_resolves.py). CI's CPU base skips the step itself, so this
is what stops a release that cannot install beside SGLang before an image build does. Minutes, cold or
warm: AReaL's tree is ~280 distributions, and pip reads each candidate's metadata with HTTP range
requests that its cache does not keep."""

import importlib.util
import json
import subprocess
import sys

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import ROOT

SCRIPT = ROOT / "docker" / "check_resolves.py"

_spec = importlib.util.spec_from_file_location("check_resolves", SCRIPT)
check_resolves = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_resolves)


def run_check(*args: str, timeout: float) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)
    # Exit 2: the check could not run (PyPI unreachable, pip not bootstrapped). That is a failure
    # here, never a skip: a check that quietly does not run is how the broken image got through.
    assert r.returncode != 2, f"docker/check_resolves.py could not run:\n{r.stderr[-3000:]}"
    return r


def by_name(lines: list[str]) -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, lines)}


def test_base_pins_hold_sglangs_exact_pins_at_the_base_and_let_overrides_replace_them():
    """base-pins.py's rules, as the image applies them: exact pins at the installed version, ranges as
    declared, unversioned and extra-only requirements free, an override in place of its name's pin."""
    requires = ["torch==2.9.1", "openai==2.6.1", "mistral-common>=1.9.0", "uvloop", "Soundfile[x]==0.13.1",
                "flash-attn==2.8 ; extra == 'cuda'", "pywin32==306 ; sys_platform == 'win32'"]
    env = check_resolves.target_environment()
    got = check_resolves.base_pins.constraints(requires, env, ["openai>=2.8.0,<3"],
                                               {"torch": "2.9.1+cu129", "openai": "2.6.1"})
    assert got == ["torch==2.9.1+cu129", "mistral-common>=1.9.0", "soundfile==0.13.1", "openai>=2.8.0,<3"]


def test_check_reads_the_dockerfiles_areal_step_and_the_step_uses_the_overrides():
    """The check resolves what the Dockerfile installs, on the SGLang its base image carries, and the
    Dockerfile's step is the one that lets the overrides in."""
    sglang, reqs = check_resolves.dockerfile_step()
    assert (sglang, reqs) == ("0.5.10.post1", ["areal==1.0.4"])
    text = (ROOT / "Dockerfile").read_text()
    assert "COPY docker/base-pins.py docker/areal-overrides.txt /tmp/" in text
    assert "python3 /tmp/base-pins.py --overrides /tmp/areal-overrides.txt > /tmp/base-pins.txt" in text
    assert check_resolves.base_pins.read_lines(str(check_resolves.OVERRIDES)), "no overrides: see the issue"


@pytest.mark.timeout(660)
@pytest.mark.xdist_group("image")  # network-bound, like the container tests: one worker waits on both
def test_dockerfiles_areal_step_resolves_on_sglangs_pins_with_only_the_overrides_moving(tmp_path):
    """pip resolves areal==1.0.4 under SGLang's pins with AReaL's overrides: every pin it does not
    override holds, and every overridden name moves off SGLang's pin (else the override is not needed)."""
    pins = run_check("pins", timeout=120)
    assert pins.returncode == 0, pins.stderr
    sglang = by_name([ln for ln in pins.stdout.splitlines() if ln and not ln.startswith("#")])
    overrides = by_name(check_resolves.base_pins.read_lines(str(check_resolves.OVERRIDES)))
    assert {"sglang", "torch", "openai"} <= sglang.keys(), pins.stdout

    report = tmp_path / "report.json"
    r = run_check("check", "--report", str(report), timeout=600)
    assert r.returncode == 0, f"the AReaL step does not resolve:\n{r.stderr[-6000:]}"
    got = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
           for i in json.loads(report.read_text())["install"]}
    assert got.get("areal") == "1.0.4" and "litellm" in got and len(got) > 100, sorted(got)
    held = {n: got[n] for n, pin in sglang.items() if n in got and n not in overrides}
    assert "torch" in held and "transformers" in held, held
    broken = {n: (v, str(sglang[n].specifier)) for n, v in held.items()
              if not sglang[n].specifier.contains(v, prereleases=True)}
    assert not broken, f"SGLang pins moved that no override lets move: {broken}"
    for name, over in overrides.items():
        assert name in got, f"{name}: overridden, but not in AReaL's tree: drop the override"
        assert over.specifier.contains(got[name], prereleases=True), (name, got[name], str(over))
        assert not sglang[name].specifier.contains(got[name], prereleases=True), \
            f"{name} {got[name]} fits SGLang's own {sglang[name].specifier}: the override is not needed"


@pytest.mark.timeout(300)
def test_areal_step_without_the_overrides_is_resolution_impossible_on_openai():
    """The conflict of issue 11, live: without the overrides pip refuses, naming SGLang's openai pin.
    litellm is held at areal's floor, 1.81.3: every later release needs openai>=2.8.0 as well, and
    backtracking through all of them would take pip 5 minutes to say the same."""
    _, reqs = check_resolves.dockerfile_step()
    r = run_check("check", "--no-overrides", *reqs, "litellm[proxy]==1.81.3", timeout=270)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ResolutionImpossible" in r.stderr, r.stderr[-3000:]
    assert "litellm 1.81.3 depends on openai>=2.8.0" in r.stderr, r.stderr[-3000:]
    assert "openai==2.6.1" in r.stderr, r.stderr[-3000:]
