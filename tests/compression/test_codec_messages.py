"""A misspelt codec or parameter says what would be right."""

from __future__ import annotations

import re

import pytest

from swarmavg.compression import get_codec


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("fp16", "unknown codec 'fp16' (did you mean 'float16'?); known: "),
        ("zstd+fp16", "(did you mean 'zstd+float16'?)"),
        ("uint8-blokwise", "(did you mean 'uint8-blockwise'?)"),
        ("uint8-blockwise:blok=64", "does not take parameters ['blok']: it takes block"),
        ("float16:block=64", "codec 'float16' does not take parameters ['block']: it takes none"),
    ],
)
def test_near_misses_name_the_right_spelling(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        get_codec(name)


def test_a_name_far_from_every_codec_gets_no_guess() -> None:
    with pytest.raises(ValueError, match="unknown codec 'qwerty'; known: ") as info:
        get_codec("qwerty")
    assert "did you mean" not in str(info.value)
