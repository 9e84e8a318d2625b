"""Where a submit message's ``input_url`` may point: each tenant at its own inputs only. Every entry of
``BERTH_SUBMIT_INPUT_STORES`` holds ``{tenant}``, filled in from the message's broker user, and the input
must be an object under it (docs/queue.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from storage import ObjectStore, check_key, open_store
from worker.config import ConfigError

PLACEHOLDER = "{tenant}"


@dataclass(frozen=True)
class InputStore:
    """One entry of ``BERTH_SUBMIT_INPUT_STORES``."""

    entry: str  # as configured
    store_url: str  # the store: the URL before the segment holding {tenant}
    key_prefix: str  # the rest, {tenant} in it: "{tenant}", "{tenant}/incoming", "in-{tenant}"
    store: ObjectStore

    def tenant_url(self, tenant: str) -> str:
        """Where the tenant's inputs are (with a ``/`` to end it)."""
        return f"{self.store_url}/{self.key_prefix.replace(PLACEHOLDER, tenant)}/"

    def key_of(self, url: str, tenant: str) -> str | None:
        """The key in ``store`` of the tenant's input ``url``; None when ``url`` is not under the
        tenant's part of this store. The key is not checked yet (``check_key``)."""
        base = self.tenant_url(tenant)
        if not url.startswith(base):
            return None
        return f"{self.key_prefix.replace(PLACEHOLDER, tenant)}/{url[len(base):]}"


def parse_input_stores(entries: list[str]) -> list[InputStore]:
    """The entries as stores, each opened; ``ConfigError`` saying what to write for a bad one."""
    return [_parse(entry) for entry in entries]


def _parse(entry: str) -> InputStore:
    scheme, sep, rest = entry.partition("://")
    at = entry.find(PLACEHOLDER)
    if not sep or at < 0:
        raise ConfigError(f"BERTH_SUBMIT_INPUT_STORES entry {entry!r} has no {PLACEHOLDER}: every tenant could make "
                          "berth read what it holds. Name each tenant's folder or prefix with it, as in "
                          f"file:///srv/berth-inbox/{PLACEHOLDER} or s3://berth-inbox/{PLACEHOLDER}")
    slash = entry.rfind("/", 0, at)
    path_start = len(scheme) + 3
    # the store's own part must be whole: a folder (not the file system's root), or a bucket
    lowest = path_start + rest.find("/") if scheme == "s3" else path_start + 1
    if scheme == "s3" and rest.find("/") < 0 or slash < lowest:
        raise ConfigError(f"BERTH_SUBMIT_INPUT_STORES entry {entry!r}: {PLACEHOLDER} must be in the path below the "
                          f"folder or bucket, as in file:///srv/berth-inbox/{PLACEHOLDER} or "
                          f"s3://berth-inbox/{PLACEHOLDER}/incoming")
    store_url, key_prefix = entry[:slash], entry[slash + 1:].rstrip("/")
    try:
        check_key(key_prefix.replace(PLACEHOLDER, "tenant"))
        if "{" in key_prefix.replace(PLACEHOLDER, "") or "}" in key_prefix.replace(PLACEHOLDER, ""):
            raise ValueError(f"only {PLACEHOLDER} is filled in")
        store = open_store(store_url)
    except ValueError as exc:
        raise ConfigError(f"BERTH_SUBMIT_INPUT_STORES entry {entry!r}: {exc}") from None
    return InputStore(entry, store_url, key_prefix, store)
