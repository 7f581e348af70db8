"""Write docs/configuration.md from the config schema (roll_backend/config/reference_doc.py).

PYTHONPATH=$PWD .venv/bin/python scripts/gen_config_docs.py          # regenerate
PYTHONPATH=$PWD .venv/bin/python scripts/gen_config_docs.py --check  # exit 1 if the file is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from roll_backend.config.reference_doc import DOC_PATH, REGENERATE, render

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when the file is out of date")
    args = parser.parse_args()
    path = REPO / DOC_PATH
    text = render()
    if args.check:
        if not path.is_file() or path.read_text() != text:
            print(f"{DOC_PATH} is out of date; regenerate it with: {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
