"""The tables of docs/openrlhf.md, from ``config/openrlhf.py``'s table and ``flags.tsv`` (OpenRLHF's defaults), and
``differing_defaults``: the OpenRLHF 0.11 flags whose default is not openpack's.

``python tests/data/openrlhf_0_11/docs_tables.py`` rewrites the part of docs/openrlhf.md between the two marker
lines; ``tests/unit/test_openrlhf_flags.py`` checks that the page holds what ``tables()`` gives, so the page
cannot drift from the code, and that ``differing_defaults`` finds exactly the flags ``KEPT_DEFAULTS`` explains.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from openpack.config import commands, openrlhf
from openpack.config.schema import ConfigError, build_parser

HERE = Path(__file__).parent
DOCS = HERE.parents[2] / "docs" / "openrlhf.md"
BEGIN, END = "<!-- tables: written by tests/data/openrlhf_0_11/docs_tables.py -->", "<!-- end of the tables -->"
COMMANDS = {"train_sft": commands.SFT, "train_dpo": commands.DPO, "train_rm": commands.RM,
            "train_ppo_ray": commands.PPO}
RUNS = {"train_sft": commands.SFT, "train_dpo": commands.DPO, "train_rm": commands.RM, "train_ppo": commands.PPO,
        "train_grpo": commands.GRPO}
SOURCE = {"train_sft": "train_sft", "train_dpo": "train_dpo", "train_rm": "train_rm", "train_ppo": "train_ppo_ray",
          "train_grpo": "train_ppo_ray"}  # the OpenRLHF command whose flags and defaults each openpack command takes


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


def field_defaults(command) -> dict[str, dict]:
    """openpack field -> its default and its ``special`` values (a value with a meaning of its own)."""
    return {f.name: {"default": ours, "special": f.metadata.get("special", {})}
            for f, ours in ((f, f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
                            for section in command.run_config.section_classes() for f in dataclasses.fields(section))}


def means(field: dict, value: object) -> bool:
    """Whether openpack's default of none is documented as meaning ``value`` (``--policy_loss_type``'s none: ppo)."""
    return field["default"] is None and field["special"].get(None) == shown(value)


def given_values(command, argv: list[str]) -> dict[str, object]:
    """The fields ``argv`` (openpack's flags) sets, with their values as parsed (not yet checked together)."""
    parser = build_parser("defaults", "", *command.run_config.section_classes(), aliases=command.aliases)
    unset = vars(parser.parse_args([]))
    return {name: value for name, value in vars(parser.parse_args(argv)).items() if value is not unset[name]}


def differing_defaults(command: str, defaults: dict[str, object] | None = None) -> dict[str, tuple[str, str]]:
    """Every OpenRLHF 0.11 flag of openpack ``command`` whose default is not openpack's: flag -> (OpenRLHF's,
    openpack's), as the docs show them. ``defaults``: OpenRLHF's, flag -> value (``flags.tsv``'s when None).

    A flag that sets openpack flags is given OpenRLHF's default, translated by the table (so values keep
    OpenRLHF's meaning: -1 is none); the default differs where that sets any field to other than openpack's
    default (or to a value openpack's none is documented to mean), or where the table refuses the value.
    OpenRLHF's none (not set) equals an openpack default of none or of a value meaning "off"; OpenRLHF's off
    switch equals openpack's where giving the switch changes a field.
    An accepted switch differs where openpack always does what it turns on (``Twin.always``). A refused flag is not
    compared: its feature is missing (docs/openrlhf.md lists it), so its default sets nothing here.
    """
    run, table = RUNS[command], openrlhf.TABLES[command]
    fields = field_defaults(run)
    defaults = openrlhf_defaults()[SOURCE[command]] if defaults is None else defaults
    differ = {}
    for flag, theirs in defaults.items():
        twin = table[flag]
        if twin.kind == "accepted":
            if twin.nargs == "0" and twin.always and theirs is False:
                differ[flag] = (shown(theirs), "on (always)")
            continue
        if twin.kind == "refused":
            continue
        ours = " ".join(f"{name} {shown(fields[name[2:]]['default'])}" for name in twin.sets)
        if theirs is None:
            off = [fields[name[2:]] for name in twin.sets]
            if any(f["default"] is not None and not str(f["special"].get(f["default"], "")).startswith("off")
                   for f in off):
                differ[flag] = (shown(theirs), ours)
            continue
        argv = [flag] if isinstance(theirs, bool) else [flag, *map(str, theirs if isinstance(theirs, list) else
                                                                  [theirs])]
        try:
            given = given_values(run, openrlhf.translate(command, argv).argv)
        except ConfigError:
            differ[flag] = (shown(theirs), ours)
            continue
        changed = any(value != fields[name]["default"] and not means(fields[name], value)
                      for name, value in given.items())
        if changed != (theirs is False):  # a value that moves a field, or an off switch that moves none
            differ[flag] = (shown(theirs), ours)
    return differ


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


def kept_defaults() -> str:
    """Per command, each default that differs from OpenRLHF 0.11's, with why openpack keeps its own."""
    parts = []
    for command in RUNS:
        differ, why = differing_defaults(command), openrlhf.KEPT_DEFAULTS[command]
        if command == "train_grpo":  # train_ppo's, and its own GRPO defaults
            differ = {flag: both for flag, both in differ.items() if flag in openrlhf.WHY_GRPO}
            parts += ["", "`train_grpo`: `train_ppo`'s, and:"]
        else:
            source = SOURCE[command]
            parts += ["", f"`{command}`" + (f" (OpenRLHF's `{source}`)" if source != command else "") + ":"]
        parts += ["", "| OpenRLHF 0.11 | its default | openpack's default | why openpack keeps its own |",
                  "|---|---|---|---|"]
        parts += [f"| `{flag}` | `{theirs}` | `{ours}` | {why[flag]} |" for flag, (theirs, ours) in differ.items()]
    return "\n".join(parts[1:])


def tables() -> str:
    defaults = openrlhf_defaults()
    parts = ["### Defaults that differ", "", kept_defaults(), "", "### Refused: what openpack lacks", "", refused()]
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
