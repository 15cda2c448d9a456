"""The tables of docs/openrlhf.md, from ``config/openrlhf.py``'s table and ``flags.tsv`` (OpenRLHF's defaults).

``python tests/data/openrlhf_0_11/docs_tables.py`` rewrites the part of docs/openrlhf.md between the two marker
lines; ``tests/unit/test_openrlhf_flags.py`` checks that the page holds what ``tables()`` gives, so the page
cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from openpack.config import commands, openrlhf

HERE = Path(__file__).parent
DOCS = HERE.parents[2] / "docs" / "openrlhf.md"
BEGIN, END = "<!-- tables: written by tests/data/openrlhf_0_11/docs_tables.py -->", "<!-- end of the tables -->"
COMMANDS = {"train_sft": commands.SFT, "train_dpo": commands.DPO, "train_rm": commands.RM,
            "train_ppo_ray": commands.PPO}


def openrlhf_defaults() -> dict[str, dict[str, object]]:
    defaults: dict[str, dict[str, object]] = {}
    for line in (HERE / "flags.tsv").read_text().splitlines():
        if not line.startswith("#"):
            command, flag, _, default = line.split("\t")
            defaults.setdefault(command, {})[flag] = json.loads(default)
    return defaults


def shown(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "none"
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value).replace("\n", "\\n") if str(value) else "''"


def openpack_defaults(command) -> dict[str, object]:
    return {f"--{f.name}": f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            for section in command.run_config.section_classes() for f in dataclasses.fields(section)}


def command_table(name: str, command, defaults: dict[str, object]) -> str:
    table, ours = openrlhf.TABLES[command.name], openpack_defaults(command)
    rows = ["| OpenRLHF 0.11 | its default | openpack | openpack's default |", "|---|---|---|---|"]
    for flag, default in defaults.items():
        twin = table[flag]
        our_default = shown(ours[twin.sets[0]]) if twin.sets else ""
        rows.append(f"| `{flag}` | `{shown(default)}` | {twin.meaning} | {f'`{our_default}`' if twin.sets else ''} |")
    return "\n".join(rows)


def refused() -> str:
    """Each missing feature once, with the flags that ask for it (over the four commands)."""
    features: dict[str, list[str]] = {}
    for command in ("train_sft", "train_dpo", "train_rm", "train_ppo"):
        for twin in openrlhf.TABLES[command].values():
            if twin.kind == "refused":  # "refused: FEATURE; accepted: ..." or "accepted where ...; else refused: F"
                feature = twin.meaning.split("refused: ", 1)[1].split("; accepted: ")[0].split("; ")[0]
                names = features.setdefault(feature, [])
                if twin.name not in names:
                    names.append(twin.name)
    return "\n".join(f"- {feature}: {', '.join(f'`{n}`' for n in names)}" for feature, names in features.items())


def tables() -> str:
    defaults = openrlhf_defaults()
    parts = ["### Refused: what openpack lacks", "", refused()]
    for name, command in COMMANDS.items():
        title = f"`{name}` -> `openpack {command.name}`" + (" (and `train_grpo`)" if name == "train_ppo_ray" else "")
        parts += ["", f"### {title}: {len(defaults[name])} flags", "", command_table(name, command, defaults[name])]
    return "\n".join(parts)


def main() -> None:
    text = DOCS.read_text()
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    DOCS.write_text(f"{head}{BEGIN}\n{tables()}\n{END}{tail}")


if __name__ == "__main__":
    main()
