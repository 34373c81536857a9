"""The TCPStores megarl hosts listen on exactly the address they are given.

torch's TCPStore server (libuv backend, torch 2.13) listens on every interface whatever host it is
given (`TCPStore("127.0.0.1", 0, is_master=True)` shows as `*:PORT` in `ss -ltn`). Given a socket
already bound and listening (`master_listen_fd`), it serves that one: `tcp_store_server` binds
`host` itself and hands the socket over, so a store meant for this machine is on loopback only.
"""
from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

BACKLOG = 4096


def tcp_store_server(host: str, port: int, timeout: timedelta, world_size: int | None = None,
                     wait_for_workers: bool = False, multi_tenant: bool = False) -> dist.TCPStore:
    """A TCPStore server listening on host:port (port 0: a free one; the store's `.port` says which)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(BACKLOG)
        bound_port = listener.getsockname()[1]
        store = dist.TCPStore(host, bound_port, world_size, True, timeout, wait_for_workers=wait_for_workers,
                              multi_tenant=multi_tenant, master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the descriptor now
    return store
