"""Which vLLM is installed, and what kvcore does differently for each supported version.

kvcore's adapter speaks the ``KVCacheManager`` surface of vLLM 0.32 and 0.33 (one adapter; the
installed version picks the semantics where the two differ).  The version is read in full
(PEP 440: ``0.33.1``, ``0.32.0+cpu``, ``0.33.1rc1.dev5+g0123abc``) and checked at engine start:

* a release of a supported minor version (``0.32.x``, ``0.33.x``; post releases and local
  labels such as ``+cpu`` included) runs;
* a pre-release or development build (``a``, ``b``, ``rc``, ``.dev``) is refused unless
  ``additional_config["kvcore"]["allow_unreleased_vllm"]`` is true
  (:mod:`~kvcore.integrations.vllm.settings`); allowed, it runs with a
  :class:`VllmVersionWarning` naming the build;
* any other version is compared, by the contract probe
  (:mod:`~kvcore.integrations.vllm.contract`), with what the adapter relies on in the nearest
  supported version (0.33 for a newer vLLM, 0.32 for an older one): if the installed vLLM's
  manager, coordinator, single-type manager, block pool and KV-event surface all match, it runs
  with that version's semantics and one :class:`VllmVersionWarning` naming it; otherwise it is
  refused with an :class:`~kvcore.errors.UnsupportedFeatureError` listing every difference.

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

This module imports vLLM only to read its version (and, for an unlisted version, the probe
reads vLLM's classes).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcore.errors import UnsupportedFeatureError

SUPPORTED: tuple[tuple[int, int], ...] = ((0, 32), (0, 33))
"""The vLLM minor versions kvcore's adapter supports."""

ALLOW_UNRELEASED = "additional_config['kvcore']['allow_unreleased_vllm']"
"""The setting that lets a pre-release or development build of vLLM run."""

# PEP 440 public versions with an optional local label (case-insensitive, as PEP 440 says).
_PEP440 = re.compile(
    r"""^\s*v?(?:(?P<epoch>[0-9]+)!)?(?P<release>[0-9]+(?:\.[0-9]+)*)
    (?P<pre>[-_.]?(?:a|b|c|rc|alpha|beta|pre|preview)[-_.]?[0-9]*)?
    (?P<post>-[0-9]+|[-_.]?(?:post|rev|r)[-_.]?[0-9]*)?
    (?P<dev>[-_.]?dev[-_.]?[0-9]*)?
    (?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?\s*$""", re.IGNORECASE | re.VERBOSE)


class VllmVersionWarning(UserWarning):
    """kvcore runs on a vLLM it does not list as supported: a pre-release or development build
    the settings allow, or a version the contract probe found matching."""


@dataclass(frozen=True)
class VllmVersion:
    """An installed vLLM's version and the adapter semantics it selects.

    ``major`` and ``minor`` pick the semantics (for a version the contract probe accepted, the
    nearest supported one's: the comparisons below give a newer vLLM 0.33's and an older one
    0.32's); ``unreleased`` marks a pre-release or development build; ``probed`` a version
    kvcore does not list, accepted because its contract matched."""

    major: int
    minor: int
    text: str
    unreleased: bool = False
    probed: bool = False

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


def _refuse_unsupported(text: str, detail: str = "") -> UnsupportedFeatureError:
    return UnsupportedFeatureError(
        f"kvcore's vLLM integration supports vLLM {supported_names()}, not vLLM {text}{detail}; "
        f"install one of those, or run vLLM without kvcore")


def nearest_supported(major: int, minor: int) -> tuple[int, int]:
    """The supported minor version whose semantics an unlisted version gets: the newest for a
    newer vLLM, the oldest for an older one."""
    return max(SUPPORTED) if (major, minor) > max(SUPPORTED) else min(SUPPORTED)


Probe = Callable[[tuple[int, int]], Sequence[str]]
"""The contract probe: given the supported version an unlisted vLLM is checked against, the
differences between what the adapter relies on there and what the installed vLLM has (empty
when they match)."""


def parse_version(text: str, *, allow_unreleased: bool = False,
                  probe: Probe | None = None) -> VllmVersion:
    """The vLLM version ``text`` (PEP 440: ``"0.33.0"``, ``"0.32.0+cpu"``,
    ``"0.33.1rc1.dev5+g0123abc"``) if kvcore runs on it (see the module docstring), else
    :class:`~kvcore.errors.UnsupportedFeatureError`: naming the supported versions for text
    that is no version or a version not listed (without ``probe``, or with its differences),
    naming the build and :data:`ALLOW_UNRELEASED` for a pre-release or development build
    without ``allow_unreleased``.  A version accepted that is not a listed release warns
    (:class:`VllmVersionWarning`, once per call)."""
    match = _PEP440.match(text)
    if match is None or match["epoch"] not in (None, "0"):
        raise _refuse_unsupported(text)
    release = [int(p) for p in match["release"].split(".")]
    major, minor = release[0], (release[1] if len(release) > 1 else 0)
    unreleased = match["pre"] is not None or match["dev"] is not None
    if unreleased and not allow_unreleased:
        raise UnsupportedFeatureError(
            f"vLLM {text} is a pre-release or development build, which kvcore's vLLM "
            f"integration runs on only when {ALLOW_UNRELEASED} is true (it then warns); "
            f"set it, install a release of vLLM {supported_names()}, or run vLLM without kvcore")
    notes = []
    if unreleased:
        notes.append(f"a pre-release or development build, allowed by {ALLOW_UNRELEASED}")
    probed = (major, minor) not in SUPPORTED
    if probed:
        if probe is None:
            raise _refuse_unsupported(text)
        near = nearest_supported(major, minor)
        differences = list(probe(near))
        if differences:
            raise _refuse_unsupported(
                text, f", and its manager contract differs from vLLM {near[0]}.{near[1]}'s "
                f"(what kvcore's adapter relies on): {'; '.join(differences)}")
        notes.append(f"not a version kvcore lists ({supported_names()}), accepted because "
                     f"the contract kvcore's adapter relies on matches vLLM {near[0]}."
                     f"{near[1]}'s, whose semantics it runs with")
        major, minor = near
    if notes:
        warnings.warn(f"kvcore runs on vLLM {text}: {'; and '.join(notes)}",
                      VllmVersionWarning, stacklevel=2)
    return VllmVersion(major, minor, text, unreleased=unreleased, probed=probed)


def installed(*, allow_unreleased: bool = False) -> VllmVersion:
    """The installed vLLM's version (see :func:`parse_version`; an unlisted version is checked
    by :func:`kvcore.integrations.vllm.contract.probe_installed`)."""
    from vllm.version import __version__

    from kvcore.integrations.vllm.contract import probe_installed

    return parse_version(str(__version__), allow_unreleased=allow_unreleased,
                         probe=probe_installed)
