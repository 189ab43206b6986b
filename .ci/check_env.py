"""Check a tox test env before its tests run, and print what it holds (tox.ini: commands_pre).

Fails when torch is not the CPU build pinned in the constraints file, when any CUDA package (nvidia-*, triton)
got installed, or when transformers is not the release the env name promises (py311-tf426 -> 4.26.x).
Usage: python .ci/check_env.py CONSTRAINTS_FILE
"""

from __future__ import annotations

import os
import re
import sys
from importlib import metadata


def pinned(constraints: str, name: str) -> str:
    with open(constraints, encoding="utf-8") as file:
        for line in file:
            match = re.fullmatch(rf"{name}==(\S+)", line.split("#")[0].strip())
            if match:
                return match.group(1)
    raise SystemExit(f"check_env: {constraints} pins no {name}==VERSION")


def main(constraints: str) -> int:
    env = os.environ.get("TOX_ENV_NAME", "?")
    errors = []

    torch_version = metadata.version("torch")
    torch_pin = pinned(constraints, "torch")
    if torch_version != torch_pin:
        errors.append(f"torch {torch_version} is installed, {constraints} pins {torch_pin}")
    cuda = sorted(
        f"{dist.metadata['Name']} {dist.version}"
        for dist in metadata.distributions()
        if re.match(r"(nvidia[-_]|triton$)", dist.metadata["Name"].lower())
    )
    if cuda:
        errors.append("CUDA packages got installed: " + ", ".join(cuda))

    transformers_version = metadata.version("transformers")
    factor = re.search(r"(?:^|-)tf(\d)(\d+)(?:-|$)", env)
    if factor:
        expected = f"{factor.group(1)}.{int(factor.group(2))}."
        if not transformers_version.startswith(expected):
            errors.append(f"env {env} should test transformers {expected}x, but {transformers_version} is installed")

    neofix = metadata.distribution("transformers-neofix")  # imported as neofix
    print(
        f"{env}: python {sys.version.split()[0]}, torch {torch_version}, transformers {transformers_version}, "
        f"neofix {neofix.version} from {neofix.locate_file('')}"
    )
    for error in errors:
        print(f"check_env: ERROR: {error}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python .ci/check_env.py CONSTRAINTS_FILE")
    sys.exit(main(sys.argv[1]))
