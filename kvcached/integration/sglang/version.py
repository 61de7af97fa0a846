"""Which SGLang versions kvcached's hooks are written for.

The hooks replace classes that SGLang's ``KVCacheConfigurator`` builds the KV pools
from; that module and the allocator package change between patch releases (0.5.15 has
no ``kv_cache_configurator``; 0.5.21 split the radix caches' finished-request call and dropped
``MambaRadixCache``; 0.5.22 replaced their ``cache_unfinished_req`` by ``checkpoint``), so any version
outside the range is refused with an error rather than run without kvcached.
"""

from __future__ import annotations

from kvcached.integration.common import check_range

# The releases whose classes the test job constructs (scripts/dev.sh reads this list: a venv each); the range
# accepted is theirs, their post-releases included. 0.5.17 is the newest SGLang whose wheels pin the torch of the
# project's GPU machine (2.11.0), the one run there; 0.5.18 - 0.5.21 (torch 2.13), 0.5.22 and 0.5.23 (torch 2.14.1)
# only on the CPU (docs/sglang.md).
TESTED_RELEASES = ("0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")
MIN_VERSION = tuple(int(x) for x in TESTED_RELEASES[0].split("."))
_newest = tuple(int(x) for x in TESTED_RELEASES[-1].split("."))
MAX_VERSION_EXCLUSIVE = (*_newest[:-1], _newest[-1] + 1)
SUPPORTED_RANGE = f">={TESTED_RELEASES[0]},<{'.'.join(map(str, MAX_VERSION_EXCLUSIVE))}"


def check_sglang_version(version: str) -> tuple[int, ...]:
    """The release tuple of ``version``; :class:`KVCachedConfigError` unless it is in :data:`SUPPORTED_RANGE`."""
    return check_range("SGLang", "sglang", version, MIN_VERSION, MAX_VERSION_EXCLUSIVE, SUPPORTED_RANGE)


def installed_sglang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:  # a source checkout on sys.path: its own attribute
        import sglang

        return str(getattr(sglang, "__version__", "unknown"))
