"""The wheels an offline GPU node needs besides its image, derived from pyproject.toml.

merit's `[cli]` and `[gpu]` extras and everything they require, transitively, minus what the GPU
node's image already ships (benchmarks/gpu_image_packages.txt, listed once there), each pinned to
the version installed in the environment this runs in (the CPU environment the test suite
passes in). benchmarks/fetch_gpu_wheels.sh downloads exactly this set; a unit test checks that
every module the CLI imports at start comes from the image or from this set.

    python benchmarks/gpu_wheels.py [--python-version 3.12]   # name==version, one a line

A requirement that the running environment does not have installed is an error (exit 1): the
set would then be pinned to something never tested. Requirements of a package the image ships
are the image's business (pip installed them with it) and are not followed.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
IMAGE_LIST = ROOT / "benchmarks" / "gpu_image_packages.txt"
PROJECT = "merit-optim"
EXTRAS = ("cli", "gpu")


def normalize(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path = IMAGE_LIST) -> set[str]:
    """The distributions the GPU image ships: one name a line; '#' starts a comment."""
    names = set()
    for line in path.read_text().splitlines():
        name = line.split("#", 1)[0].strip()
        if name:
            names.add(normalize(name))
    return names


def _environment(python_version: str) -> dict[str, str]:
    """Marker values of the GPU node: CPython `python_version` on x86-64 Linux."""
    return {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
    }


def _applies(req: Requirement, extras: set[str], env: dict[str, str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": extra}) for extra in extras or {""})


def extras_requirements(pyproject: Path = ROOT / "pyproject.toml", extras=EXTRAS) -> list[Requirement]:
    """The requirements of merit's `extras`, with the project's references to its own extras expanded."""
    optional = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    out, todo, seen = [], list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for spec in optional[extra]:
            req = Requirement(spec)
            if normalize(req.name) == PROJECT:
                todo.extend(req.extras)
            else:
                out.append(req)
    return out


def wheel_set(
    python_version: str = "3.12", image: set[str] | None = None, pyproject: Path = ROOT / "pyproject.toml"
) -> tuple[dict[str, str], list[str]]:
    """({name: version installed here} to fetch, [requirements not installed here]) for the node."""
    image = image_packages() if image is None else image
    env = _environment(python_version)
    pins: dict[str, str] = {}
    missing: list[str] = []
    todo = [(req, {""}) for req in extras_requirements(pyproject)]
    done: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req, from_extras = todo.pop()
        if not _applies(req, from_extras, env):
            continue
        name = normalize(req.name)
        key = (name, frozenset(req.extras))
        if name in image or key in done:
            continue
        done.add(key)
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            missing.append(str(req))
            continue
        if not req.specifier.contains(dist.version, prereleases=True):
            missing.append(f"{req} (installed here: {dist.version})")
        pins[name] = dist.version
        extras = set(req.extras) | {""}
        todo.extend((Requirement(spec), extras) for spec in dist.requires or ())
    return dict(sorted(pins.items())), missing


VENV_OWN = {"pip", "setuptools", "wheel"}


def with_requirements(names: set[str]) -> set[str]:
    """`names` and what their versions installed here require, transitively: on the node pip installed
    each image package with its own requirements (which this environment's versions may name
    differently: huggingface-hub 2 needs httpx2, the image's 1.x httpx)."""
    env = {**_environment(f"{sys.version_info[0]}.{sys.version_info[1]}"), "extra": ""}
    out, todo = set(), list(names)
    while todo:
        name = normalize(todo.pop())
        if name in out:
            continue
        out.add(name)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        todo.extend(r.name for r in map(Requirement, dist.requires or ()) if r.marker is None or r.marker.evaluate(env))
    return out


def link_image(site: Path, image: set[str] | None = None) -> list[str]:
    """Mimic the image in `site` (a venv's site-packages): link there every file of each image
    distribution installed in this environment; return the image names not installed here. The
    installers (pip, setuptools, wheel) are the venv's own: linking this environment's pip over
    them would mix two pips' files."""
    absent = []
    for name in sorted(with_requirements(image_packages() if image is None else image) - VENV_OWN):
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            absent.append(name)
            continue
        for file in dist.files or ():
            if file.parts[0] == ".." or "__pycache__" in file.parts:
                continue  # scripts outside site-packages, bytecode caches
            source, target = Path(dist.locate_file(file)), site / file
            if source.is_file() and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.symlink_to(source)
    return absent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-version", default="3.12", help="the GPU node's Python (markers are read for it)")
    parser.add_argument(
        "--link-image", type=Path, metavar="SITE", help="instead: mimic the image in SITE (see link_image)"
    )
    args = parser.parse_args(argv)
    if args.link_image:
        absent = link_image(args.link_image)
        print(f"linked the image's packages into {args.link_image}; not installed here: {', '.join(absent) or 'none'}")
        return 0
    if not re.fullmatch(r"3\.\d+", args.python_version):
        parser.error(f"--python-version takes 3.N, got {args.python_version!r}")
    pins, missing = wheel_set(args.python_version)
    if missing:
        print(
            "error: required but not installed in this environment (install merit-optim[cli,gpu] first):",
            file=sys.stderr,
        )
        for req in missing:
            print(f"  {req}", file=sys.stderr)
        return 1
    for name, version in pins.items():
        print(f"{name}=={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
