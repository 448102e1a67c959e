"""The rollout of one model's versions, as data and pure decisions (no I/O, no clock).

A :class:`Rollout` says where the requests that name no version go:

- the **default** version: the one the management API set, else ``option.default_version``
  of the model folder's ``serving.properties``, else the highest;
- a **canary** (:class:`Share`): a version that takes ``percent`` % of those requests instead
  of the default;
- a **shadow** (:class:`Share`): a version that ``percent`` % of those requests also run on,
  after their answer (:mod:`mmserver.lifecycle.shadow`), to compare the answers.

A request with a routing key falls where a hash of the key puts it (:func:`bucket`: CRC-32,
the same in every process and on every instance of a cluster, so the same caller always sees
the same version); one without, where a random draw puts it. The canary and the shadow hash the
key apart (a salt each), so the canary's callers are not the shadow's.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from mmserver import errors
from mmserver.store.names import version_key

#: The roles a version may take besides the default, and their ``serving.properties`` keys.
ROLES = ("canary", "shadow")
#: Where a setting comes from, as describe shows it.
FROM_STORE, FROM_CONFIG, FROM_MANAGEMENT = "store", "serving.properties", "management"


def bucket(key: str, salt: str = "") -> float:
    """Where the routing key ``key`` falls in [0, 100) for the role ``salt``: a request takes
    the role when this is below its percentage."""
    return zlib.crc32((salt + key).encode("utf-8", "surrogatepass")) % 10_000 / 100


def canary_bucket(key: str) -> float:
    """Where ``key`` falls for the canary."""
    return bucket(key)


def shadow_bucket(key: str) -> float:
    """Where ``key`` falls for the shadow."""
    return bucket(key, "shadow:")


_BUCKETS: dict[str, Callable[[str], float]] = {"canary": canary_bucket, "shadow": shadow_bucket}


@dataclass
class Share:
    """A version taking ``percent`` % (0 to 100) of a model's requests in a role."""

    version: int
    percent: float
    source: str


@dataclass
class Rollout:
    """One model with versions: its versions, and where its requests go."""

    name: str
    versions: tuple[int, ...]
    #: The version requests that name none go to, and where that comes from.
    default: int
    default_from: str = FROM_STORE
    #: Why requests that name no version cannot be routed (a key of serving.properties that
    #: names no version): they are answered this error; those naming a version are served.
    error: errors.ConfigError | None = None
    shares: dict[str, Share] = field(default_factory=dict)

    def key(self, version: int) -> str:
        return version_key(self.name, version)

    @property
    def default_key(self) -> str:
        return version_key(self.name, self.default)

    def share(self, role: str) -> Share | None:
        """The version in ``role`` when it takes some requests (``None``: none does)."""
        share = self.shares.get(role)
        if share is None or share.percent <= 0 or share.version == self.default:
            return None
        return share

    def takes(self, role: str, routing: str | None, draw: Callable[[], float]) -> int | None:
        """The version a request naming none takes in ``role`` (``routing``: its routing key;
        ``draw``: a random number in [0, 1)), or ``None``."""
        share = self.share(role)
        if share is None:
            return None
        point = _BUCKETS[role](routing) if routing is not None else draw() * 100
        return share.version if point < share.percent else None

    def pick(self, routing: str | None, draw: Callable[[], float]) -> str:
        """The key of the version a request naming none goes to: the canary or the default."""
        canary = self.takes("canary", routing, draw)
        return version_key(self.name, self.default if canary is None else canary)


@dataclass
class Saved:
    """What the management API set for one model (``None``: not set): the default, and per
    role ``[version, percent]`` (``[None, 0]``: ended by a call)."""

    default: int | None = None
    canary: list[float | None] | None = None
    shadow: list[float | None] | None = None


def make_rollout(
    name: str, versions: tuple[int, ...], props: Mapping[str, str], saved: Saved | None
) -> Rollout:
    """The rollout of model ``name`` from its versions, its folder's ``serving.properties``
    (``props``) and what the management API set (``saved``, which wins); a key that names no
    version is its :attr:`Rollout.error`."""
    rollout = Rollout(name, versions, versions[-1])
    try:
        text = props.get("option.default_version")
        if text is not None:
            rollout.default = _version_in(name, "option.default_version", text, versions)
            rollout.default_from = FROM_CONFIG
        for role in ROLES:
            text = props.get(f"option.{role}_version")
            if text is not None:
                version = _version_in(name, f"option.{role}_version", text, versions)
                key = f"option.{role}_percent"
                percent = percent_of(
                    props.get(key, "0"), f"model {name}: serving.properties: {key}"
                )
                rollout.shares[role] = Share(version, percent, FROM_CONFIG)
    except errors.ConfigError as exc:
        rollout.error = exc
    if saved is not None:
        if saved.default in versions:
            rollout.default, rollout.default_from, rollout.error = (
                saved.default,
                FROM_MANAGEMENT,
                None,
            )
        for role in ROLES:
            setting = getattr(saved, role)
            if setting is None:
                continue
            version, percent = setting
            if version is None:
                rollout.shares.pop(role, None)
            elif int(version) in versions:
                rollout.shares[role] = Share(int(version), float(percent or 0), FROM_MANAGEMENT)
    return rollout


def _version_in(name: str, key: str, text: str, versions: tuple[int, ...]) -> int:
    stripped = text.strip()
    if stripped.isdigit() and int(stripped) in versions:
        return int(stripped)
    raise errors.ConfigError(
        f"model {name}: serving.properties: {key}={text!r} is not one of its versions "
        f"({', '.join(map(str, versions))})",
        model=name,
    )


def percent_of(value: object, what: str) -> float:
    """``value`` as a share from 0 to 100; :class:`errors.ConfigError` naming ``what``
    otherwise."""
    try:
        percent = float(value) if isinstance(value, (int, float, str)) else -1.0
    except ValueError:
        percent = -1.0
    if isinstance(value, bool) or not 0 <= percent <= 100:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise errors.ConfigError(f"{what}={shown} must be a number from 0 to 100")
    return percent
