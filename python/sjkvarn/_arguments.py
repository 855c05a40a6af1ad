"""Argument checks shared by the public API: every refusal is an sjkvarn error naming the
argument, never a silent coercion (``2.9`` is not the integer 2, ``"0"`` is not layer 0) and
never a bare builtin error from deeper down."""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from sjkvarn.errors import InvalidInputError, SjkvarnError, UnsupportedTypeError

#: The largest count the core takes (its sizes are 64-bit).
MAX_COUNT = 2**63 - 1
#: The largest 32-bit setting (bit widths, balancing passes).
MAX_U32 = 2**32 - 1

F = TypeVar("F", bound=Callable[..., Any])


def integer(name: str, value: Any, *, minimum: int = 0, maximum: int = MAX_COUNT) -> int:
    """``value`` as an int: a Python or numpy integer (not a bool, float or string) in range."""
    if isinstance(value, (bool, np.bool_)) or not hasattr(type(value), "__index__"):
        raise UnsupportedTypeError(f"{name} must be an integer, got {type(value).__name__}")
    i = operator.index(value)
    if i < minimum:
        raise InvalidInputError(f"{name} must be at least {minimum}, got {i}")
    if i > maximum:
        raise InvalidInputError(f"{name} = {i} is out of range (at most {maximum})")
    return i


def optional_integer(name: str, value: Any, *, minimum: int = 0) -> int | None:
    return None if value is None else integer(name, value, minimum=minimum)


def real(name: str, value: Any) -> float:
    """``value`` as a finite float (a Python or numpy real number, not a bool or string)."""
    if isinstance(value, (bool, np.bool_, str, bytes)) or not hasattr(type(value), "__float__"):
        raise UnsupportedTypeError(f"{name} must be a number, got {type(value).__name__}")
    x = float(value)
    if not math.isfinite(x):
        raise InvalidInputError(f"{name} must be finite, got {x}")
    return x


def text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise UnsupportedTypeError(f"{name} must be a string, got {type(value).__name__}")
    return value


def byte_string(name: str, value: Any) -> bytes:
    """``value`` as bytes: bytes, bytearray or a contiguous memoryview (not a str)."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise UnsupportedTypeError(f"{name} must be bytes, got {type(value).__name__}")
    return bytes(value)


def native_array(name: str, value: Any) -> Any:
    """numpy arrays in a form the core reads: native byte order (a big-endian ``>f4`` array is
    converted), object arrays refused. Anything else is passed through unchanged."""
    if not isinstance(value, np.ndarray):
        return value
    if value.dtype.hasobject:
        raise UnsupportedTypeError(f"{name}: a numpy object array cannot hold float tensor data")
    if not value.dtype.isnative:
        return value.astype(value.dtype.newbyteorder("="))
    return value


def library_errors(func: F) -> F:
    """Re-raises a builtin ``TypeError``/``BufferError``/``ValueError``/``OverflowError`` that
    escaped the explicit checks as the matching sjkvarn class, so ``except SjkvarnError``
    catches every refusal of user input."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except SjkvarnError:
            raise
        except (TypeError, BufferError) as e:
            raise UnsupportedTypeError(f"{func.__qualname__}: {e}") from e
        except (ValueError, OverflowError) as e:
            raise InvalidInputError(f"{func.__qualname__}: {e}") from e

    return wrapper  # type: ignore[return-value]
