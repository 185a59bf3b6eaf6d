"""How quantities read wherever bulkinfer shows them (terminal, HTML)."""

from __future__ import annotations

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: float) -> str:
    """Bytes in binary units with three significant digits at most:
    ``5996930048`` -> ``"5.59 GiB"``, ``1536`` -> ``"1.50 KiB"``, ``512`` -> ``"512 B"``.
    A negative count keeps its sign."""
    size = abs(float(n))
    unit = 0
    while size >= 1024 and unit < len(_BINARY_UNITS) - 1:
        size /= 1024
        unit += 1
    sign = "-" if n < 0 else ""
    if unit == 0:
        return f"{sign}{size:.0f} B"
    digits = 2 if size < 10 else 1 if size < 100 else 0
    return f"{sign}{size:.{digits}f} {_BINARY_UNITS[unit]}"
