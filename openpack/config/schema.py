"""The config machinery of every ``openpack`` command: dataclasses -> flags, YAML and saved config.

A command declares its options as ``@dataclass`` classes whose fields carry a
default and a one-line help string (``arg``). From those alone come the
``--flag`` parser, the ``--config file.yaml`` schema and the ``config.yaml`` a
run saves, so the three cannot drift apart. Precedence is

    dataclass defaults  <  --config file.yaml  <  flags given on the command line

The trade-off: the YAML is flat (keys are field names, unique across one
command's classes) and field types are limited to int, float, str, bool,
``X | None`` and ``list[int | float | str]``. In exchange every key and value is
checked (unknown keys are errors with a difflib suggestion) and a saved config
loads back into equal instances.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import difflib
import functools
import os
import re
import tempfile
import types
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml


class ConfigError(ValueError):
    """A config file, key, flag or value the user must fix; the message says which and how."""


_UNSET = object()  # argparse default, so a flag the user gave is told apart from any value


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The range a number must lie in; every numeric flag of every command is checked against its own here."""

    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    below: float | None = None

    def holds(self, value: float) -> bool:
        return ((self.at_least is None or value >= self.at_least) and (self.above is None or value > self.above)
                and (self.at_most is None or value <= self.at_most) and (self.below is None or value < self.below))

    def __str__(self) -> str:
        parts = [f"{op} {bound:g}" for op, bound in ((">=", self.at_least), (">", self.above), ("<=", self.at_most),
                                                     ("<", self.below)) if bound is not None]
        return " and ".join(parts)


def arg(default: Any, help: str, choices: list | tuple | None = None, *, at_least: float | None = None,
        above: float | None = None, at_most: float | None = None, below: float | None = None,
        special: dict | None = None) -> Any:
    """A dataclass field with a one-line ``help`` for ``build_parser``, optional ``choices`` and a numeric range.

    ``at_least``/``above``/``at_most``/``below`` bound every value (each item of a list); ``None`` is always
    allowed for an optional field. ``special`` maps values with a meaning of their own (``{None: "every
    epoch"}``) to that meaning: it is shown in ``--help`` and logged at start (``special_values``).
    List defaults go through ``default_factory`` so instances never share one list.
    """
    bounds = Bounds(at_least, above, at_most, below)
    metadata = {"help": help, "choices": tuple(choices) if choices else None,
                "bounds": bounds if str(bounds) else None, "special": dict(special or {})}
    if isinstance(default, list):
        return dataclasses.field(default_factory=functools.partial(list, default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


# scalar is int, float, str or bool; is_list for list[scalar]; optional for `X | None`
_Spec = collections.namedtuple("_Spec", "name scalar is_list optional default help choices bounds special")


def _spec(cls: type, f: dataclasses.Field, hint: Any) -> _Spec:
    """Describe one field; raise TypeError for a type or default the parser cannot handle."""
    where = f"{cls.__name__}.{f.name}"
    args = get_args(hint)
    optional = get_origin(hint) in (Union, types.UnionType) and type(None) in args
    if optional:
        hint = next(a for a in args if a is not type(None)) if len(args) == 2 else None
    is_list = get_origin(hint) is list
    scalar = get_args(hint)[0] if is_list and get_args(hint) else hint
    if scalar not in (int, float, str, bool) or (is_list and scalar is bool):
        raise TypeError(f"{where}: unsupported type; use int, float, str, bool, X | None or list[int|float|str]")
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if default is dataclasses.MISSING:
        raise TypeError(f"{where} needs a default; declare it with arg(default, help)")
    bounds = f.metadata.get("bounds")
    if bounds is not None and scalar not in (int, float):
        raise TypeError(f"{where}: a range (at_least, above, ...) needs an int or float field")
    return _Spec(f.name, scalar, is_list, optional, default, f.metadata.get("help", ""), f.metadata.get("choices"),
                 bounds, f.metadata.get("special", {}))


def _specs(config_classes: tuple[type, ...]) -> dict[str, _Spec]:
    """All init fields of the classes by name; a name used twice (or 'config') is an error."""
    specs: dict[str, _Spec] = {}
    owner = {"config": "the built-in --config flag"}
    for cls in config_classes:
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            if f.name in owner:
                raise ValueError(f"field '{f.name}' of {cls.__name__} clashes with {owner[f.name]}; rename one")
            owner[f.name] = cls.__name__
            specs[f.name] = _spec(cls, f, hints[f.name])
    return specs


def _check(value: Any, spec: _Spec, where: str) -> Any:
    """Type-check a YAML (or alias) value against its field; ints widen to float."""
    if value is None and spec.optional:
        return None
    if spec.is_list != isinstance(value, list):
        kind = "a list of {0}; write [x, y]" if spec.is_list else "a single {0}, not a list"
        raise ConfigError(f"{where}: expected {kind.format(spec.scalar.__name__)}, got {value!r}")
    for item in value if spec.is_list else [value]:
        ok = isinstance(item, spec.scalar) and (spec.scalar is bool or not isinstance(item, bool))
        ok = ok or (spec.scalar is float and isinstance(item, int) and not isinstance(item, bool))
        if not ok:
            fix = ("put the value in quotes" if spec.scalar is str else f"write an unquoted {spec.scalar.__name__}"
                   + (f", e.g. the default {spec.default}" if spec.default is not None else ""))
            raise ConfigError(f"{where}: expected {spec.scalar.__name__}, got {item!r} "
                              f"({type(item).__name__}); {fix}")
        if spec.choices and item not in spec.choices:
            raise ConfigError(f"{where}: {item!r} is not one of {', '.join(map(str, spec.choices))}")
    if spec.scalar is float:
        return [float(v) for v in value] if spec.is_list else float(value)
    return value


def _shown(value: Any) -> str:
    """A value as it is typed on the command line (``none`` for None, lists space-separated)."""
    if value is None:
        return "none"
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def _help_text(spec: _Spec) -> str:
    """``help (>= 1; none: every epoch; default: none)``: the range and special values a flag takes."""
    notes = [str(spec.bounds)] if spec.bounds else []
    notes += [f"{_shown(value)}: {meaning}" for value, meaning in spec.special.items()]
    return f"{spec.help} ({'; '.join(notes + [f'default: {_shown(spec.default)}'])})"


def _check_range(value: Any, spec: _Spec) -> None:
    """Every number of a field within its bounds; None (an optional field left unset) always passes."""
    if spec.bounds is None or value is None:
        return
    for item in value if spec.is_list else [value]:
        if not spec.bounds.holds(item):
            special = "".join(f"; {_shown(v)} means {m}" for v, m in spec.special.items())
            raise ConfigError(f"--{spec.name} must be {spec.bounds}, got {_shown(value)} ({spec.help}{special})")


def special_values(*instances: Any) -> list[str]:
    """``--max_steps none: train every epoch`` for each field set to a value with a meaning of its own."""
    lines = []
    for inst in instances:
        for f in dataclasses.fields(inst):
            value, special = getattr(inst, f.name), f.metadata.get("special", {})
            if f.init and not isinstance(value, list) and value in special:
                lines.append(f"--{f.name} {_shown(value)}: {special[value]}")
    return lines


class _BoolFlag(argparse.Action):
    """``--name`` sets True, ``--no_name`` sets False (underscores, like every openpack flag)."""

    def __init__(self, option_strings, dest, **kwargs):
        negatives = ["--no_" + s[2:] for s in option_strings]
        super().__init__(option_strings + negatives, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, not option_string.startswith("--no_"))

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


def _cli_type(spec: _Spec):
    """The argparse ``type`` of a field: its scalar, with 'None'/'null' -> None when optional."""
    def convert(text: str):
        return None if spec.optional and text in ("None", "null") else spec.scalar(text)
    convert.__name__ = spec.scalar.__name__  # argparse says "invalid int value: 'x'"
    return convert


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line naming it and where to look, not the whole usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}; see {self.prog} --help\n")


def build_parser(prog: str, description: str, *config_classes: type,
                 aliases: dict[str, tuple[str, Any]] | None = None, epilog: str | None = None,
                 twins: dict[str, list[str]] | None = None) -> argparse.ArgumentParser:
    """One ``--name`` flag per field of ``config_classes`` (plus ``--config`` and ``aliases``).

    Every flag defaults to a private sentinel, so ``parse_config`` can tell which
    flags the user gave; the help text shows the field's real default, range and
    special values, and the other names that set it (``twins``: field -> OpenRLHF 0.11
    flags, which ``config.openrlhf`` translates before parsing). ``epilog`` is printed
    as written after the flags.
    """
    specs = _specs(config_classes)
    # allow_abbrev=False: a typo like --lr must not silently mean --lr_warmup_ratio
    parser = _Parser(prog=prog, description=description, allow_abbrev=False, epilog=epilog,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="PATH.yaml", default=None,
                        help="YAML file of option values (flat: field name -> value); flags override it")
    for cls in config_classes:
        doc = cls.__doc__ if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "(") else ""
        group = parser.add_argument_group(cls.__name__, doc.strip().split("\n")[0] or None)
        for name in (f.name for f in dataclasses.fields(cls) if f.init):
            s = specs[name]
            help_text = _help_text(s) + (f" (OpenRLHF 0.11: {', '.join(twins[name])})" if name in (twins or {}) else "")
            kw: dict[str, Any] = {"dest": name, "default": _UNSET, "help": help_text.replace("%", "%%")}
            if s.scalar is bool and not s.is_list:
                kw["action"] = _BoolFlag
            else:
                kw.update(type=_cli_type(s), nargs="+" if s.is_list else None)
                if s.choices:
                    kw["choices"] = s.choices + ((None,) if s.optional else ())
            group.add_argument(f"--{name}", **kw)
    if aliases:
        group = parser.add_argument_group("aliases")
        for flag, (name, value) in aliases.items():
            if name not in specs:
                raise ValueError(f"alias {flag} targets unknown field '{name}'")
            value = _check(value, specs[name], f"alias {flag}")
            shown = " ".join(map(str, value)) if isinstance(value, list) else value
            target = f"--{'' if value else 'no_'}{name}" if isinstance(value, bool) else f"--{name} {shown}"
            group.add_argument(flag, dest=name, action="store_const", const=value, default=_UNSET,
                               help=f"alias of {target}")
    return parser


# PyYAML follows YAML 1.1, which reads `lr: 1e-5` (no dot) as the string "1e-5"
# (yaml/pyyaml#173). Read it as a float, as YAML 1.2 does; the dumper shares the
# rule, so a str that looks like one is quoted on save and still round-trips.
_Loader = type("_Loader", (yaml.SafeLoader,), {})
_Dumper = type("_Dumper", (yaml.SafeDumper,), {})
for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float",
                               re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                               list("-+0123456789"))


def _load_yaml(path: str, specs: dict[str, _Spec]) -> dict[str, Any]:
    """Checked values of a flat YAML config file, by field name."""
    try:
        with open(path) as f:
            data = yaml.load(f, Loader=_Loader)
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror}); check the path") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML; fix the syntax:\n{e}") from e
    if not isinstance(data, dict | None):
        raise ConfigError(f"{path}: expected a mapping 'field_name: value', got a {type(data).__name__}")
    values = {}
    for key, value in (data or {}).items():
        if key not in specs:
            close = difflib.get_close_matches(str(key), list(specs), n=1)
            fix = f"did you mean '{close[0]}'?" if close else "see --help for the valid keys"
            raise ConfigError(f"{path}: unknown key '{key}'; {fix}")
        values[key] = _check(value, specs[key], f"{path}: key '{key}'")
    return values


def parse_config(argv: list[str] | None, prog: str, description: str, *config_classes: type,
                 aliases: dict[str, tuple[str, Any]] | None = None, epilog: str | None = None,
                 twins: dict[str, list[str]] | None = None) -> tuple:
    """Parse ``argv`` into one instance per class (same order), then call each ``validate()``.

    Defaults < ``--config`` YAML < flags given. Bad YAML, a number out of its field's range and
    ``validate`` failures raise ``ConfigError``; bad flags exit through argparse (status 2), as usual.
    """
    parser = build_parser(prog, description, *config_classes, aliases=aliases, epilog=epilog, twins=twins)
    specs = _specs(config_classes)
    ns = parser.parse_args(argv)
    values = _load_yaml(ns.config, specs) if ns.config else {}
    for name, spec in specs.items():
        given = getattr(ns, name)
        if given is _UNSET:
            continue
        if spec.is_list and None in given:  # optional list: `--name None` alone means None
            if given != [None]:
                parser.error(f"--{name}: None must be given alone, e.g. `--{name} None`")
            given = None
        values[name] = given
    instances = tuple(cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})
                      for cls in config_classes)
    for instance in instances:  # ranges first, so validate() sees only numbers in range
        for f in dataclasses.fields(instance):
            if f.init:
                _check_range(getattr(instance, f.name), specs[f.name])
    for instance in instances:
        if callable(getattr(instance, "validate", None)):
            instance.validate()
    return instances


def config_to_dict(*instances: Any) -> dict[str, Any]:
    """Flat ``{field_name: value}`` of all init fields, in class then field order."""
    return {f.name: (list(v) if isinstance(v := getattr(inst, f.name), list) else v)
            for inst in instances for f in dataclasses.fields(inst) if f.init}


def save_config(path: str | os.PathLike, *instances: Any) -> None:
    """Write ``config_to_dict(*instances)`` as YAML, atomically: temp file in the same folder, then rename.

    The file loads back with ``--config`` into equal instances.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".config-", suffix=".yaml.tmp")
    try:
        with os.fdopen(fd, "w") as f:
            yaml.dump(config_to_dict(*instances), f, Dumper=_Dumper, sort_keys=False)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a run's config is meant to be read
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class RunConfig:
    """A command's whole configuration as one object: a dataclass whose fields are its sections, in flag-group order.

    Each command declares one, e.g. ``SFTRunConfig(model, data, train, output, launch)``, typed by the section
    classes; from those types come the flags (``build_parser``), and the sections flatten back into the same flat
    ``config.yaml`` as before the sections existed (``save``): field names stay unique across one command's
    sections. Workers take the run config; the functions under them take the section they need.
    """

    @classmethod
    def section_classes(cls) -> tuple[type, ...]:
        hints = get_type_hints(cls)
        return tuple(hints[f.name] for f in dataclasses.fields(cls))

    @classmethod
    def parse(cls, argv: list[str] | None, prog: str, description: str, **kwargs) -> "RunConfig":
        """``parse_config`` over the sections' classes, the result as one instance of ``cls``."""
        return cls(*parse_config(argv, prog, description, *cls.section_classes(), **kwargs))

    def sections(self) -> tuple:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def save(self, path: str | os.PathLike) -> None:
        """``config.yaml``: every section's fields, flat, in section order (``save_config``)."""
        save_config(path, *self.sections())
