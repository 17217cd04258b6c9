"""The argument parser every kvcore command uses: errors are one line with exit status 2."""

from __future__ import annotations

import argparse
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line with exit status 2 (argparse would print
    the usage too); every kvcore command uses it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")
