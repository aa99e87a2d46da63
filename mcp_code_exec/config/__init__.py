"""Configuration, below every other layer: ``settings`` (the file, the environment, the defaults),
``cluster`` (the ``[cluster]`` section) and ``mounts`` (host directories, checked as they load)."""

from .settings import Config, load_config

__all__ = ["Config", "load_config"]
