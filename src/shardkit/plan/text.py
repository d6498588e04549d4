"""Numbers as people read them: bytes, seconds and counts (one copy, used by every layer).

>>> format_bytes(1536), format_bytes(3 * 2**30, digits=2), format_bytes(512)
('1.5 KiB', '3.00 GiB', '512 B')
>>> format_seconds(2.5e-4), format_si(1.5e9)
('250 µs', '1.5G')
>>> parse_bytes("2GB"), parse_bytes("1.5 GiB"), parse_bytes(4096)
(2000000000, 1610612736, 4096)
"""

from __future__ import annotations

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: float, digits: int = 1) -> str:
    """``n`` bytes in the largest binary unit below 1024 of it, with ``digits`` decimals (bytes: none)."""
    power = 0
    while abs(n) >= 1024 and power < len(_BYTE_UNITS) - 1:
        n /= 1024
        power += 1
    return f"{n:.0f} B" if power == 0 else f"{n:.{digits}f} {_BYTE_UNITS[power]}"


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(size: str | int) -> int:
    """A size as people write it (``"2GB"``, ``"500 MiB"``, ``1024``) in bytes: KB/MB/GB are
    powers of 1000 and KiB/MiB/GiB of 1024, as HuggingFace's ``max_shard_size`` reads them.
    Anything else (a negative or zero size, an unknown unit) is a ValueError naming it."""
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ValueError(f"a size must be a whole number of bytes or a string like '2GB', got {size!r}")
    if isinstance(size, int):
        number, unit = float(size), ""
    else:
        text = size.strip().upper()
        cut = len(text) - len(text.lstrip("0123456789."))
        number_text, unit = text[:cut], text[cut:].strip()
        try:
            number = float(number_text)
        except ValueError:
            number = -1.0
    if number <= 0 or unit not in _SIZE_UNITS or number * _SIZE_UNITS[unit] < 1:
        raise ValueError(f"size {size!r} is not a positive size like 2GB, 500MB or 1GiB")
    return int(number * _SIZE_UNITS[unit])


def format_seconds(t: float) -> str:
    """``t`` seconds in s, ms, µs or ns, three significant digits."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if t >= scale:
            return f"{t / scale:.3g} {unit}"
    return f"{t / 1e-9:.3g} ns"


def format_si(n: float) -> str:
    """``n`` with a K/M/G/T/P suffix, three significant digits (small integers as they are)."""
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.0f}" if unit == "" else f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}P"


__all__ = ["format_bytes", "format_seconds", "format_si", "parse_bytes"]
