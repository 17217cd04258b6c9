"""The ``kvcore`` command line (``kvcore replay``, ``kvcore bench``, ``kvcore --version``).

The parser, the subcommands and :func:`main` are in :mod:`kvcore.cli.app`; ``python -m
kvcore.cli`` runs :func:`main` (:mod:`kvcore.cli.__main__`).
"""

from kvcore.cli.app import build_parser, main, version

__all__ = ["build_parser", "main", "version"]
