"""Authenticated records in the rendezvous store: every value megarl writes and later trusts is signed.

torch's TCPStore has no authentication: anything that reaches its port can read and write every key.
megarl's control records there (queue address, publish spec/headers/checksums, stop flag and signal,
heartbeats, resume info, retired counts, the SGLang group) go through `SignedStore`, which stores
`value + HMAC-SHA256(run secret, full key name, value)` and checks the tag on every read: a value
written by a process without the secret raises `ForgedStoreValue` naming the key, so it is never
acted on (`check` counts it as absent, `get` raises). The tag covers the key's full name (prefixes included), so a genuine value copied to
another key is refused too. A replayed older value of the *same* key stays possible (the store keeps
no history to compare against); docs/security.md says what that allows.

Process groups (gloo/NCCL rendezvous) take `.raw`: torch's own keys are torch's protocol.
"""
from __future__ import annotations

import hashlib
import hmac
from datetime import timedelta

import torch.distributed as dist

TAG_BYTES = 32


class ForgedStoreValue(RuntimeError):
    """A store value whose tag does not match the run secret: written by a process outside the run."""


class SignedStore:
    def __init__(self, raw: dist.Store, key: bytes, prefix: str = ""):
        self.raw, self._key, self.prefix = raw, key, prefix
        self._reported: set[str] = set()

    def prefixed(self, prefix: str) -> "SignedStore":
        """The same signed view over `prefix` (PrefixStore), the prefix covered by the tags. PrefixStore joins
        prefix and key with "/", and so does the name a tag covers: it is the key's name in `raw`."""
        return SignedStore(dist.PrefixStore(prefix, self.raw), self._key, self.prefix + prefix + "/")

    def _tag(self, name: str, value: bytes) -> bytes:
        full = (self.prefix + name).encode()
        return hmac.new(self._key, b"%d:%s" % (len(full), full) + value, hashlib.sha256).digest()

    def _open(self, name: str, stored: bytes) -> bytes:
        value, tag = stored[:-TAG_BYTES], stored[-TAG_BYTES:]
        if len(stored) < TAG_BYTES or not hmac.compare_digest(self._tag(name, value), tag):
            raise ForgedStoreValue(f"rendezvous store: the value of {self.prefix + name!r} is not signed with this "
                                   f"run's secret (written by a process outside the run?): refused")
        return value

    def unlisted(self, name: str) -> str:
        """`name` plus a suffix only holders of the secret can compute. torch's store cannot list its keys, so a
        process outside the run cannot find such a key to overwrite: a record whose writer must not be drowned
        by a flood of forged writes (a heartbeat) lives under it. ("unlisted:" never starts a value tag's
        input, which starts with a length, so no genuine tag is a key name.)"""
        full = (self.prefix + name).encode()
        return f"{name}/{hmac.new(self._key, b'unlisted:' + full, hashlib.sha256).hexdigest()[:32]}"

    def set(self, name: str, value: str | bytes) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        self.raw.set(name, value + self._tag(name, value))

    def get(self, name: str) -> bytes:
        return self._open(name, self.raw.get(name))

    def multi_get(self, names: list[str]) -> list[bytes]:
        return [self._open(n, v) for n, v in zip(names, self.raw.multi_get(names))]

    def check(self, names: list[str]) -> bool:
        """Whether every key holds a genuine value. A forged one counts as absent (reported once per key), so
        a forged stop flag or header is not acted on and the genuine writer can still overwrite it."""
        if not self.raw.check(names):
            return False
        for name in names:
            try:
                self.get(name)
            except ForgedStoreValue as exc:
                if name not in self._reported:
                    self._reported.add(name)
                    print(f"megarl: {exc}; treated as absent", flush=True)
                return False
        return True

    def wait(self, names: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.raw.wait(names)
        else:
            self.raw.wait(names, timeout)
