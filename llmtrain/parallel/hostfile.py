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


def world_info(hosts: dict[str, int], node_rank: str) -> str:
    """deepspeed.launcher.launch's --world_info ({host: [slot, ...]}, base64 JSON) for a --no_ssh
    launch of node `node_rank`, which must name a line of the hostfile."""
    import base64
    import json

    if not node_rank.isdigit() or int(node_rank) >= len(hosts):
        raise HostfileError(f"NODE_RANK={node_rank} names no node of the hostfile's {len(hosts)}; "
                            f"use 0..{len(hosts) - 1}")  # fmt: skip
    info = {h: list(range(n)) for h, n in hosts.items()}
    return base64.urlsafe_b64encode(json.dumps(info).encode()).decode()


if __name__ == "__main__":  # launch/train_multinode.sh: --world-info HOSTFILE NODE_RANK
    import sys

    try:
        print(world_info(parse_hostfile(sys.argv[2]), sys.argv[3]))
    except HostfileError as e:
        sys.exit(f"train_multinode.sh: error: {e}")
