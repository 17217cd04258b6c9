"""``Request`` refuses token ids that are not a sequence of ints with kvcore's typed error naming
the value (not Python's "object is not iterable"), and a refused append changes nothing."""

from __future__ import annotations

from typing import Any

import pytest

from kvcore.errors import InvalidArgumentError
from kvcore.request import Request, RequestBlockHasher


@pytest.mark.parametrize("prompt", [5, 1.5, None])
def test_a_prompt_that_is_not_a_sequence_is_refused_by_name(prompt: Any) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"prompt token ids .*got {prompt!r}") as info:
        Request("r", prompt)
    assert type(prompt).__name__ in str(info.value)


@pytest.mark.parametrize("token", [1.5, None, object(), -1, [1, 2.5], True, False,
                                   [3, True]])
def test_a_bad_output_token_is_refused_by_name_and_changes_nothing(token: Any) -> None:
    r = Request("r", [1, 2, 3], block_hasher=RequestBlockHasher(2))
    hashes = list(r.block_hashes)
    shown = repr(token[-1] if isinstance(token, list) else token)
    with pytest.raises(InvalidArgumentError, match="output token ids") as info:
        r.append_output_token_ids(token)
    assert shown in str(info.value)
    assert r.all_token_ids == [1, 2, 3] and r.block_hashes == hashes
    r.append_output_token_ids(4)  # still usable
    assert r.output_token_ids == [4] and len(r.block_hashes) == 2


@pytest.mark.parametrize(("prompt", "bad"), [([True], True), ([1, 2, False], False),
                                             ([5, True, 7], True), ([1.5, True], 1.5)])
def test_a_bool_token_is_refused_as_any_other_non_int(prompt: list[Any], bad: object) -> None:
    """``array("I")`` takes True and False as 1 and 0: a prompt of bools would hash like one of
    ints and share their KV.  Refused with the error other non-int tokens get, naming the
    first bad one (the test runs against whichever build is installed)."""
    with pytest.raises(InvalidArgumentError,
                       match=rf"prompt token ids must be ints in \[0, 2\*\*32\), got {bad!r}$"):
        Request("r", prompt)
