"""Hostfiles as the deepspeed launcher reads them (`hostname slots=N` per line), checked early."""

from __future__ import annotations

import re
from pathlib import Path

from llmtrain.errors import LlmtrainError

_LINE = re.compile(r"^(?P<host>[A-Za-z0-9_.\-]+)\s+slots=(?P<slots>\d+)$")


class HostfileError(LlmtrainError, ValueError):
    pass


def parse_hostfile(path: str | Path) -> dict[str, int]:
    """{host: slots}; a bad line raises with its number and the expected form."""
    p = Path(path)
    if p.is_dir():
        raise HostfileError(f"hostfile {p} is a directory; give the hostfile itself")
    if not p.is_file():
        raise HostfileError(f"hostfile {p} does not exist; check the path")
    hosts: dict[str, int] = {}
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise HostfileError(
            f"hostfile {p} is not UTF-8 text; write 'hostname slots=N' lines"
        ) from e
    for i, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _LINE.match(line)
        if not m:
            raise HostfileError(f"{p}:{i}: {raw.strip()!r} is not 'hostname slots=N'")
        host, slots = m.group("host"), int(m.group("slots"))
        if slots < 1:
            raise HostfileError(f"{p}:{i}: slots must be >= 1")
        if host in hosts:
            raise HostfileError(f"{p}:{i}: host {host} is listed twice")
        hosts[host] = slots
    if not hosts:
        raise HostfileError(f"hostfile {p} lists no hosts")
    return hosts
