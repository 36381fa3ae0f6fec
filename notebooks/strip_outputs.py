"""Strips outputs from notebooks before they are committed.

    python notebooks/strip_outputs.py            # every notebooks/*.ipynb, in place
    python notebooks/strip_outputs.py --check    # only report; exit 1 if any has outputs

Clears every code cell's outputs and execution count and the per-cell execution
metadata (timings) that Jupyter adds; everything else is kept. The file is written
the way nbformat writes it (sorted keys, indent 1), so a clean notebook is unchanged.
tests/test_notebooks.py checks that the committed notebooks are clean.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent


def strip(notebook: dict) -> dict:
    for cell in notebook["cells"]:
        cell.get("metadata", {}).pop("execution", None)
        if cell["cell_type"] == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
    return notebook


def dumps(notebook: dict) -> str:
    return json.dumps(notebook, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=pathlib.Path,
                        help="notebooks (default: notebooks/*.ipynb)")
    parser.add_argument("--check", action="store_true", help="report only; exit 1 if unclean")
    args = parser.parse_args(argv)
    unclean = []
    for path in args.paths or sorted(HERE.glob("*.ipynb")):
        text = path.read_text(encoding="utf-8")
        clean = dumps(strip(json.loads(text)))
        if clean != text:
            unclean.append(path)
            if not args.check:
                path.write_text(clean, encoding="utf-8")
    verb = "has outputs" if args.check else "stripped"
    for path in unclean:
        print(f"{path}: {verb}")
    return 1 if args.check and unclean else 0


if __name__ == "__main__":
    sys.exit(main())
