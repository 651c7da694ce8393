"""Before the first request to the Hugging Face hub (a model or dataset named by its hub id): whether the hub can be
reached at all. huggingface_hub retries a failed connection five times with back-off, about 25 s and a warning line
per attempt, for every file it looks for; on a machine without network a hub id would take a minute of retries
before its one-line error. One connection attempt (a few seconds at most) decides instead: when it fails, this
process goes offline (`HF_HUB_OFFLINE`), so a hub id resolves from the local cache or fails at once."""

from __future__ import annotations

import os
import socket
import sys
import threading
from urllib.parse import urlparse

PROBE_SECONDS = 3.0
_decided: bool | None = None


def _reachable(host: str, port: int) -> bool:
    result: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=PROBE_SECONDS):
                result.append(True)
        except OSError:
            result.append(False)

    # getaddrinfo has no timeout of its own: a resolver that hangs leaves this daemon thread behind.
    t = threading.Thread(target=probe, name="qtool-hub-probe", daemon=True)
    t.start()
    t.join(PROBE_SECONDS + 1)
    return bool(result and result[0])


def go_offline() -> None:
    # Libraries not imported yet read the variable when they are; those imported already keep a copy of it.
    os.environ["HF_HUB_OFFLINE"] = "1"
    for module in ("huggingface_hub.constants", "datasets.config"):
        mod = sys.modules.get(module)
        if mod is not None:
            mod.HF_HUB_OFFLINE = True


def prepare() -> bool:
    """Call before a hub id is resolved; returns whether the hub is used (False: offline, by the environment or
    because it cannot be reached). Decided once per process."""
    global _decided
    if _decided is not None:
        return _decided
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        _decided = False
        return _decided
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = (
        endpoint.hostname or "huggingface.co",
        endpoint.port or (443 if endpoint.scheme != "http" else 80),
    )
    _decided = _reachable(host, port)
    if not _decided:
        go_offline()
    return _decided
