"""The one cattrs converter: every attrs message, event and header crosses a
process or file boundary only through `to_cbor` / `from_cbor`.

CBOR encoding is canonical (sorted map keys, minimal integers), so the same
object always yields the same bytes: the `.kvc` header relies on this to patch
its fixed-width checksum slots in place, and the journal relies on it for
byte-identical replays.
"""

from __future__ import annotations

from typing import Any, TypeVar

import cattrs
import cbor2
from cattrs.preconf.cbor2 import make_converter

from kvcellar.errors import DecodeError

T = TypeVar("T")

# Detailed validation makes structuring several times slower (startup scans
# decode thousands of headers); a malformed record still fails, with a shorter message.
converter = make_converter(detailed_validation=False)

# CBOR already yields ints and strings: a homogeneous tuple of them only needs
# `tuple(...)`, not cattrs' per-element dispatch (hot in header scans).
_PLAIN_TUPLES = frozenset({tuple[int, ...], tuple[str, ...]})
converter.register_structure_hook_func(lambda type_: type_ in _PLAIN_TUPLES, lambda value, _: tuple(value))


def to_cbor(obj: Any) -> bytes:
    """Encode an attrs object (or plain data) as canonical CBOR."""
    return cbor2.dumps(converter.unstructure(obj), canonical=True)


def from_cbor(data: bytes | bytearray | memoryview, cls: type[T]) -> T:
    """Decode CBOR bytes into `cls`; raises `DecodeError` on any malformation."""
    try:
        return converter.structure(cbor2.loads(data), cls)
    except (cbor2.CBORDecodeError, cattrs.BaseValidationError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise DecodeError(f"cannot decode {cls.__name__}: {e}") from e
