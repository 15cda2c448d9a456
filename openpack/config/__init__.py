"""Every option of every command, in one place: the sections (dataclasses whose fields are the flags, with their
help, defaults and ranges), the checks beside them, and how a training command runs from them.

Read it in this order:

1. ``schema.py``      the machinery: a dataclass field -> a flag, a YAML key and a line of the saved ``config.yaml``
2. ``sections.py``    the sections the training commands share (model, data source, train, output, launch)
3. ``sft.py``, ``dpo.py``, ``rm.py``, ``rl.py`` (with ``rl_checks.py``), ``score.py``, ``check_packing.py``:
                      each command's own sections, its run config and its checks across sections
4. ``runner.py``      what every training command's ``main`` does: parse, check, claim the save path, train, exit codes
5. ``commands.py``    the five training commands as values, what each trains, and the demo stages that chain them

The package sits between ``orchestration`` and ``cli``: its checks ask the layers below (which rollout backend
imports, which model families pack exactly, whether an environment file loads) and ``commands.py`` launches
through orchestration, while ``cli/`` holds only the mains.
"""
