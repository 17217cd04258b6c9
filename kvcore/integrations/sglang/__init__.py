"""kvcore as SGLang's prefix cache: a radix-cache backend named ``kvcore`` for SGLang 0.5.23.

Select it with ``--radix-cache-backend kvcore``; the ``kvcore`` entry point of SGLang's
``sglang.srt.plugins`` group (:mod:`~kvcore.integrations.sglang.plugin`) registers it in every
SGLang process.  Its pages are kvcore blocks (:mod:`~kvcore.integrations.sglang.cache`), its
settings come from the environment (:mod:`~kvcore.integrations.sglang.settings`), and what it
does not implement is refused at start (:mod:`~kvcore.integrations.sglang.plugin`).

* :mod:`~kvcore.integrations.sglang.settings`, :mod:`~kvcore.integrations.sglang.hashing`: no
  SGLang import (kvcore's own venv imports them);
* :mod:`~kvcore.integrations.sglang.cache`, :mod:`~kvcore.integrations.sglang.plugin`,
  :mod:`~kvcore.integrations.sglang.replay`: import SGLang, so they run in the SGLang venv only
  (``bash scripts/sglang_venv.sh``).

Importing this package imports nothing of SGLang.
"""

from __future__ import annotations

SUPPORTED_SGLANG = "0.5.23"
"""The SGLang release the backend is written and tested against."""
