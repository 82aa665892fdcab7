"""Lets lm-eval's own CLI find the adapter: `lm_eval --model kvharness ...`.

lm-eval 0.4 discovers no plugins (its model registry holds only its own models), so `make setup` writes a one-line
.pth file into the environment's site-packages; Python runs it at start-up, and it registers `kvharness` (lazily:
nothing of the harness is imported until lm-eval asks for the model) only when the program is lm-eval's CLI. The
package also declares the `lm_eval.models` entry point, for an lm-eval that reads entry points.
"""
from __future__ import annotations

import site
import sys
from pathlib import Path

PTH_NAME = "kvharness_lmeval.pth"
# the line must start with `import` for site.py to run it; every other program pays one string comparison
PTH_LINE = ("import sys; exec('import harness.integrations.lmeval_hook as _h; _h.register()') "
            "if sys.argv and sys.argv[0].replace('\\\\', '/').rsplit('/', 1)[-1] in ('lm_eval', 'lm-eval') else None\n")
TARGET = "harness.integrations.lmeval:KVHarnessLM"


def register() -> None:
    """Add `kvharness` to lm-eval's model registry as a lazy placeholder (beside lm-eval's own models)."""
    import lm_eval.models  # noqa: F401  (fills the registry first: lm-eval only loads it when it is empty)
    from lm_eval.api.registry import model_registry

    if model_registry.get("kvharness", None) is None:
        model_registry.register("kvharness", target=TARGET)


def install(site_dir: str | Path | None = None) -> Path:
    """Write the .pth hook into `site_dir` (default: this environment's site-packages); returns its path."""
    folder = Path(site_dir) if site_dir is not None else Path(site.getsitepackages()[0])
    path = folder / PTH_NAME
    path.write_text(PTH_LINE)
    return path


if __name__ == "__main__":
    print(install(sys.argv[1] if len(sys.argv) > 1 else None))
