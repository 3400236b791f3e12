#!/usr/bin/env python3
"""Print the pip requirements an image installs before the project's sources: the project's dependencies
and its `serve` extra, as pinned in pyproject.toml, less the ones named by --image-provides.

    python3 docker/image_requirements.py pyproject.toml                          # docker/Dockerfile
    python3 docker/image_requirements.py pyproject.toml --image-provides torch   # docker/trtllm/Dockerfile

The GPU image keeps its own torch (the one its TensorRT-LLM was built with); PyPI's torch is another
version and a CUDA 13 build. Standard library only, so it runs on an image's python3 before any install.
tests/unit/test_deploy.py resolves the same list for the image's Python (docker/versions.env).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import tomllib


def requirement_name(requirement: str) -> str:
    """The distribution a requirement names, normalized: "tritonclient[all]==2.73.0" -> "tritonclient"."""
    return re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def requirements(pyproject: Path, image_provides: tuple[str, ...] = ()) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["serve"]]
    provided = {requirement_name(name) for name in image_provides}
    return [r for r in wanted if requirement_name(r) not in provided]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pyproject", type=Path)
    ap.add_argument("--image-provides", nargs="*", default=(), help="distributions the image already has")
    args = ap.parse_args()
    print("\n".join(requirements(args.pyproject, tuple(args.image_provides))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
