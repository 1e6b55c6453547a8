"""Wire codecs for pseudo-gradients: pure tensor code, no network imports.

- ``base.py``      the ``Codec`` interface (encode a flat fp32 tensor to bytes, decode bytes back)
- ``floating.py``  ``none`` (raw fp32) and ``fp16``
- ``blockwise.py``  ``int8`` and ``int4``: blockwise quantization with per-block scales (bitsandbytes)
- ``huffman.py``    ``int4-huffman``: a uniform int4 grid whose codes are Huffman-coded (zlib), ~2.7-3 bits a value
- ``registry``     below: ``get_codec(name)`` and ``CODECS``, the names ``--compression`` accepts

Every codec decodes deterministically: the same bytes give the same fp32 values on every peer, which
is what lets all members of a group end bit-identical.
"""

from diloco_compression.base import Codec
from diloco_compression.blockwise import Int4Codec, Int8Codec
from diloco_compression.floating import Float16Codec, NoneCodec
from diloco_compression.huffman import Int4HuffmanCodec

CODECS = {codec.name: codec for codec in (NoneCodec(), Float16Codec(), Int8Codec(), Int4Codec(), Int4HuffmanCodec())}


def get_codec(name: str) -> Codec:
    """Return the codec registered under ``name``; a ValueError lists the valid names."""
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"compression={name!r} is not a known codec; choose one of {sorted(CODECS)}") from None


__all__ = ["CODECS", "Codec", "Float16Codec", "Int4Codec", "Int4HuffmanCodec", "Int8Codec", "NoneCodec", "get_codec"]
