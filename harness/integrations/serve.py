"""`python -m harness.integrations.serve [server options]`: the OpenAI server, on the embedded SmolLM2 by default.

systems.server knows nothing of the harness's model assets, so it needs --model; this wrapper supplies the embedded
checkpoint (converted on first use) when --model is not given and passes every other option through.
"""
from __future__ import annotations

import sys

from harness.integrations.assets import AssetError, model_dir
from systems import server


def main(argv: list[str]) -> int:
    if not any(a == "--model" or a.startswith("--model=") for a in argv) and not {"-h", "--help"} & set(argv):
        try:
            argv = ["--model", str(model_dir()), *argv]
        except AssetError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return server.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
