"""sjkvarn: journaled, low-bit KV-cache compression (SJ-KVaRN).

The codec lives in the Rust core; this package is a thin typed layer over ``sjkvarn._core``.
"""

from sjkvarn import codec
from sjkvarn._core import GROUP, CodecError

__all__ = ["GROUP", "CodecError", "codec"]
