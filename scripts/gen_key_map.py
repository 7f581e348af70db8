"""Write the key map of docs/coming_from_verl_roll.md (a table per framework) from roll_backend/config/foreign_keys.py.

PYTHONPATH=$PWD .venv/bin/python scripts/gen_key_map.py
"""

from __future__ import annotations

from pathlib import Path

from roll_backend.config.foreign_keys import FRAMEWORKS, KEY_MAP_DOC, key_map

REPO = Path(__file__).resolve().parents[1]
HEADINGS = {"verl": "### verl", "roll": "### ROLL"}


def main() -> None:
    path = REPO / KEY_MAP_DOC
    text = path.read_text()
    for framework in FRAMEWORKS:
        start = text.index("| their key |", text.index(HEADINGS[framework]))
        end = text.find("\n\n", start)
        text = text[:start] + key_map(framework) + (text[end:] if end != -1 else "\n")
    path.write_text(text)


if __name__ == "__main__":
    main()
