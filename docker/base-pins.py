"""Print pip constraints that hold SGLang and everything it requires at the versions the base image
has, so installing AReaL on top cannot move them (pip enforces only what it is asked to install,
not what is already there). Run by the Dockerfile where SGLang is installed."""

import importlib.metadata as md
import re


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main() -> None:
    wanted = {"sglang", "torch"}
    for req in md.requires("sglang") or []:
        if "extra ==" in req:
            continue
        wanted.add(canonical(re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0]))
    for dist in sorted(md.distributions(), key=lambda d: canonical(d.metadata["Name"])):
        if canonical(dist.metadata["Name"]) in wanted:
            print(f"{dist.metadata['Name']}=={dist.version}")


if __name__ == "__main__":
    main()
