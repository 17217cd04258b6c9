"""The ``kvcore`` command line (``kvcore replay``, ``kvcore bench``, ``kvcore --version``).

The parser, the subcommands and :func:`main` are in :mod:`kvcore.cli.app`; ``python -m
kvcore.cli`` runs :func:`main` (:mod:`kvcore.cli.__main__`).
"""

from kvcore import _moved
from kvcore.cli.app import build_parser, main, version

__all__ = ["build_parser", "main", "version"]

# Names kvcore/cli.py exported before it became this package: served one release, with a
# DeprecationWarning.
__getattr__ = _moved.former_names("kvcore.cli", {
    "DEFAULT_MAX_MODEL_LEN": "kvcore.cli.app", "MAIN_EPILOG": "kvcore.cli.app",
    "cmd_replay": "kvcore.cli.replay"})
