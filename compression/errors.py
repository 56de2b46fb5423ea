"""Exceptions raised by codecs."""

from __future__ import annotations

__all__ = ["CodecError"]


class CodecError(ValueError):
    """A tensor could not be encoded or a message could not be decoded.

    Raised for malformed network input (unknown codec, truncated buffer, a size that
    does not match the declared shape, a bad codebook, a decode that would yield NaN or
    Inf, absurd shapes) and for inputs a codec cannot represent (NaN/Inf, unsupported
    dtype). The message always names the problem. Derives from ``ValueError`` so that a
    caller validating peer input can catch one type.
    """
