"""Print the pip constraints the Dockerfile's AReaL step installs under, so that installing AReaL on top
of SGLang's image cannot move SGLang's stack (pip enforces the requirements of what it is asked to
install, not those of what is already there). Rules, in order (later wins):

1. sglang and torch at the base's versions (torch: the base's CUDA build);
2. each of SGLang's own requirements that names versions, for this interpreter and platform: an exact
   pin (FlashInfer, transformers, openai, soundfile, ...) at the base's version (where the base
   deviates from SGLang's pin, the base wins), a range as SGLang declares it; requirements that name
   no version are left free, as pip would leave them if it installed SGLang and AReaL together;
3. each line of --overrides (docker/areal-overrides.txt) in place of rule 2's line for the same name:
   the pins of SGLang's that AReaL's own packaging overrides as well.

Run by the Dockerfile where SGLang is installed. docker/check_resolves.py applies rules 2 and 3 (this
file's `constraints`) to sglang's wheel on PyPI and runs pip's resolver on them, without the image
(tests/house/test_image_resolves.py)."""

import argparse
import importlib.metadata as md

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # every pip vendors packaging
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name


def constraints(requires: list[str], env: dict[str, str], overrides: list[str],
                installed: dict[str, str] | None = None) -> list[str]:
    """Rules 2 and 3: SGLang's Requires-Dist (`requires`) as constraints for the environment `env`
    (environment-marker names), exact pins at their `installed` versions (canonical name: version)
    where there are any, each overridden name's line replaced by its override."""
    installed = installed or {}
    over = {canonicalize_name(Requirement(o).name): o for o in overrides}
    out = []
    for line in requires:
        req = Requirement(line)
        if req.marker and not req.marker.evaluate({**env, "extra": ""}):
            continue  # an extra's requirement, or another platform's
        name = canonicalize_name(req.name)
        if not str(req.specifier) or name in over:
            continue
        exact = len(req.specifier) == 1 and next(iter(req.specifier)).operator in ("==", "===")
        if exact and name in installed:
            out.append(f"{name}=={installed[name]}")
        else:
            out.append(f"{name}{req.specifier}")  # no extras, no marker: pip's constraints take neither
    return out + list(over.values())


def read_lines(path: str) -> list[str]:
    """A requirements-style file's requirements, without comments and blank lines."""
    with open(path) as f:
        return [ln.split("#", 1)[0].strip() for ln in f if ln.split("#", 1)[0].strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--overrides", help="requirements that replace SGLang's own, one a line (rule 3)")
    a = ap.parse_args()
    overrides = read_lines(a.overrides) if a.overrides else []
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in md.distributions() if d.metadata["Name"]}
    for name in ("sglang", "torch"):
        print(f"{name}=={installed[name]}")
    env = default_environment()
    print("\n".join(constraints(md.requires("sglang") or [], env, overrides, installed)))


if __name__ == "__main__":
    main()
