"""Every option of every command, in one place: the sections (dataclasses whose fields are the flags, with their
help, defaults and ranges) and the checks beside them. ``schema.py`` is the machinery: a dataclass field -> a
flag, a YAML key and a line of the saved ``config.yaml``.
"""
