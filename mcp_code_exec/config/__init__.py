"""Configuration, below every other layer: ``settings`` (``Config`` and ``load_config``: the file,
the environment, the defaults), ``sections`` (a model per table of the file), ``cluster`` (the
``[cluster]`` section) and ``mounts`` (host directories, checked as they load)."""

from .settings import Config, load_config

__all__ = ["Config", "load_config"]
