"""Wire codecs for pseudo-gradients: pure tensor code, no network imports.

- ``base.py``      the ``Codec`` interface (encode a flat fp32 tensor to bytes, decode bytes back)
- ``floating.py``  ``none`` (raw fp32) and ``fp16``
- ``blockwise.py``  ``int8`` and ``int4``: blockwise quantization with per-block scales (bitsandbytes)
- ``huffman.py``    ``int4-huffman``: a uniform int4 grid whose codes are Huffman-coded (zlib), ~2.7-3 bits a value
- ``registry``     below: ``get_codec(name)`` and ``CODECS``, the names ``--compression`` accepts

Every codec decodes deterministically: the same bytes give the same fp32 values on every peer, which
is what lets all members of a group end bit-identical.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _the_standard_library_package():
    """The other ``compression`` on sys.path (Python 3.14's standard library has one), or None before 3.14.

    This folder installs as ``diloco_compression``; it is imported as ``compression`` only where the repository is on
    sys.path ahead of the standard library: ``python -m peer`` or ``python -m pytest`` in the repository, whose folder
    comes first. There it shadowed 3.14's package, and ``import torch`` failed (gzip: "No module named
    'compression._common'"). So under that name this module hands over to the other one."""
    here = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    elsewhere = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != here]
    return importlib.machinery.PathFinder.find_spec(__name__, elsewhere)


if __name__ == "compression" and (_standard := _the_standard_library_package()) is not None:
    sys.modules[__name__] = importlib.util.module_from_spec(_standard)  # what ``import compression`` returns
    _standard.loader.exec_module(sys.modules[__name__])
else:
    from diloco_compression.base import Codec
    from diloco_compression.blockwise import Int4Codec, Int8Codec
    from diloco_compression.floating import Float16Codec, NoneCodec
    from diloco_compression.huffman import Int4HuffmanCodec

    CODECS = {codec.name: codec
              for codec in (NoneCodec(), Float16Codec(), Int8Codec(), Int4Codec(), Int4HuffmanCodec())}

    def get_codec(name: str) -> Codec:
        """Return the codec registered under ``name``; a ValueError lists the valid names."""
        try:
            return CODECS[name]
        except KeyError:
            raise ValueError(f"compression={name!r} is not a known codec; choose one of {sorted(CODECS)}") from None


__all__ = ["CODECS", "Codec", "Float16Codec", "Int4Codec", "Int4HuffmanCodec", "Int8Codec", "NoneCodec", "get_codec"]
