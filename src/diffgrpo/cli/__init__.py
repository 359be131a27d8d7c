"""The ``diffgrpo`` command line: thin commands that parse, check and call the library (``app`` parses and
dispatches; the modules beside it are what the commands use: flags and recipes, the config docs, the CPU-thread
rule, the hub checks, export and the HTML report)."""
from .app import main

__all__ = ["main"]
