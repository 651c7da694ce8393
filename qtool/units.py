"""Sizes and memory: the size strings recipes and flags take (`5GB`, `512 MB`), the size strings qtool prints, and
the host memory available now."""

from __future__ import annotations

import os
import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    m = _SIZE.match(text)
    if not m:
        raise ValueError(text)
    unit = (m.group(2) or "B").upper()
    return int(float(m.group(1)) * {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}[unit])


def format_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def available_host() -> int:
    """Host memory available to this process now (MemAvailable), or all of it when /proc/meminfo is unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
