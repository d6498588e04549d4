"""Numbers as people read them: bytes, seconds and counts (one copy, used by every layer).

>>> format_bytes(1536), format_bytes(3 * 2**30, digits=2), format_bytes(512)
('1.5 KiB', '3.00 GiB', '512 B')
>>> format_seconds(2.5e-4), format_si(1.5e9)
('250 µs', '1.5G')
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


__all__ = ["format_bytes", "format_seconds", "format_si"]
