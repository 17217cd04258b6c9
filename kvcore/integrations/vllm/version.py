"""Which vLLM is installed, and what kvcore does differently for each supported version.

kvcore's adapter speaks the ``KVCacheManager`` surface of vLLM 0.32 and 0.33 (one adapter; the
installed version picks the semantics where the two differ).  Any other version is refused at
engine start with an :class:`~kvcore.errors.UnsupportedFeatureError` naming the supported ones:
vLLM changes its manager's surface between minor releases, and running on one kvcore was not
checked against could differ from vLLM silently.

Where 0.32 and 0.33 differ (read from both versions' sources):

* 0.33 has lookahead block hashes (``num_hash_lookahead_tokens``; EAGLE/MTP with prefix
  caching and no KV connector): a block's hash covers the next tokens too, so it exists only
  once they do, and ``BlockStored`` events list them (``lookahead_token_ids``);
* the EAGLE last-block drop: 0.32 drops in every group ``is_eagle_group`` flags (all groups when
  the scheduler passes ``use_eagle`` and none is flagged), whether or not ``use_eagle`` was
  passed; 0.33 drops only when ``use_eagle`` is passed (lookahead hashes clear it);
* sparse retention under EAGLE: 0.33 also keeps the sliding-window tail one block below a
  request's shared-prefix junction (kvcore's ``CacheSettings.eagle_junction_tail``);
* ``get_computed_blocks`` and its connector variant take a hit cap (0.33's auxiliary-output
  connector passes one).

This module imports vLLM only to read its version.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcore.errors import UnsupportedFeatureError

SUPPORTED: tuple[tuple[int, int], ...] = ((0, 32), (0, 33))
"""The vLLM minor versions kvcore's adapter supports."""


@dataclass(frozen=True)
class VllmVersion:
    """An installed vLLM's version and the adapter semantics it selects."""

    major: int
    minor: int
    text: str

    @property
    def lookahead_hashes(self) -> bool:
        """Whether vLLM may hash blocks with lookahead tokens (0.33)."""
        return (self.major, self.minor) >= (0, 33)

    @property
    def eagle_drop_needs_use_eagle(self) -> bool:
        """Whether flagged EAGLE groups drop a hit's last block only when the scheduler passes
        ``use_eagle`` (0.33) rather than always (0.32)."""
        return (self.major, self.minor) >= (0, 33)

    @property
    def eagle_junction_tail(self) -> bool:
        """Whether EAGLE sparse retention keeps the window tail below a shared-prefix junction
        too (0.33)."""
        return (self.major, self.minor) >= (0, 33)


    @property
    def mamba_recache_prompt_boundary(self) -> bool:
        """Whether a Mamba "align" chunk ending at the prompt's last block boundary marks the
        state there cached this step again even when cached earlier (0.32)."""
        return (self.major, self.minor) < (0, 33)


def supported_names() -> str:
    return ", ".join(f"{major}.{minor}" for major, minor in SUPPORTED)


def parse_version(text: str) -> VllmVersion:
    """The version ``text`` (``"0.33.0"``, ``"0.32.0+cpu"``, ...) if kvcore supports it, else
    :class:`~kvcore.errors.UnsupportedFeatureError` naming the supported versions."""
    parts = text.split("+", 1)[0].split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        major = minor = -1
    if (major, minor) not in SUPPORTED:
        raise UnsupportedFeatureError(
            f"kvcore's vLLM integration supports vLLM {supported_names()}, not vLLM {text}; "
            f"install one of those, or run vLLM without kvcore")
    return VllmVersion(major, minor, text)


def installed() -> VllmVersion:
    """The installed vLLM's version (see :func:`parse_version`)."""
    from vllm.version import __version__

    return parse_version(str(__version__))
