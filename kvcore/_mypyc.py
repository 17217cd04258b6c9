"""``mypyc_attr`` for the optional compiled build, with no runtime dependency on mypy_extensions.

mypyc reads the decorator while compiling (it needs mypy_extensions then, as mypy does); at run
time, where mypy_extensions may be missing, the decorator changes nothing.  This module is never
compiled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mypy_extensions import mypyc_attr
else:
    try:
        from mypy_extensions import mypyc_attr
    except ImportError:  # the pure-Python package does not depend on mypy_extensions

        def mypyc_attr(*attrs, **kwattrs):
            return lambda cls: cls

__all__ = ["mypyc_attr"]
