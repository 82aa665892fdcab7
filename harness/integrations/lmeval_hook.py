"""Lets lm-eval's own CLI find the adapter: `lm_eval --model kvharness ...`.

lm-eval 0.4 discovers no plugins (its model registry holds only its own models), so `make setup` writes a one-line
.pth file into the environment's site-packages; Python runs it at start-up, and it registers `kvharness` (lazily:
nothing of the harness is imported until lm-eval asks for the model) only when the program is lm-eval's CLI. The
package also declares the `lm_eval.models` entry point, for an lm-eval that reads entry points.

lm-eval's CLI lets every exception out as a traceback; for a bad model argument (the adapter's `one_line_error`) the
hook's excepthook prints one `error:` line instead, the same line `python -m harness.lmeval` prints. Any other
exception keeps Python's traceback.
"""
from __future__ import annotations

import site
import sys
from pathlib import Path
from types import TracebackType

PTH_NAME = "kvharness_lmeval.pth"
# the line must start with `import` for site.py to run it; every other program pays one string comparison
PTH_LINE = ("import sys; exec('import harness.integrations.lmeval_hook as _h; _h.register()') "
            "if sys.argv and sys.argv[0].replace('\\\\', '/').rsplit('/', 1)[-1] in ('lm_eval', 'lm-eval') else None\n")
TARGET = "harness.integrations.lmeval:KVHarnessLM"


def excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    """One line for an error the user fixes in the command line; Python's traceback for anything else."""
    adapter = sys.modules.get(TARGET.split(":")[0])     # imported only once lm-eval asked for the model
    message = adapter.one_line_error(exc) if adapter is not None else None
    if message is None:
        sys.__excepthook__(kind, exc, tb)
        return
    print(f"error: {message}", file=sys.stderr)


def register() -> None:
    """Add `kvharness` to lm-eval's model registry as a lazy placeholder (beside lm-eval's own models), and print
    the adapter's argument errors as one line."""
    import lm_eval.models  # noqa: F401  (fills the registry first: lm-eval only loads it when it is empty)
    from lm_eval.api.registry import model_registry

    if model_registry.get("kvharness", None) is None:
        model_registry.register("kvharness", target=TARGET)
    sys.excepthook = excepthook


def install(site_dir: str | Path | None = None) -> Path:
    """Write the .pth hook into `site_dir` (default: this environment's site-packages); returns its path."""
    folder = Path(site_dir) if site_dir is not None else Path(site.getsitepackages()[0])
    path = folder / PTH_NAME
    path.write_text(PTH_LINE)
    return path


if __name__ == "__main__":
    print(install(sys.argv[1] if len(sys.argv) > 1 else None))
