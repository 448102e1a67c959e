"""The tenants file (server option ``tenants``): who may call which models, with which
credentials, how often and how many at once.

::

    tenants:
      acme:
        models: ["acme-*"]                       # glob patterns of the models it may invoke
        access_keys: {AKIAACME0001: "secret"}    # SigV4 credentials (boto3's)
        tokens: ["tok-acme"]                     # bearer tokens (curl, tritonclient, gRPC)
        requests_per_second: 50                  # token bucket; burst defaults to the rate
        burst: 100
        max_concurrent: 16                       # requests of this tenant in flight
        priority: normal                         # high, normal or low: who is shed first

YAML (JSON is valid YAML). :func:`parse_tenants` checks all of it and refuses a file with the
line of every fault: an unknown key (with the closest known one), a pattern no model name can
match, a credential given to two tenants or equal to the management token, a number out of
range. Secrets are kept as given (SigV4 needs the secret itself); a token is kept only as its
SHA-256 digest, which the lookup of an offered token compares.
"""

from __future__ import annotations

import difflib
import fnmatch
import hashlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import yaml

from mmserver.errors import ConfigError
from mmserver.serving.jobs import NORMAL, PRIORITY

#: A tenant's name: also the value of the ``tenant`` label on ``mmserver_requests_total``.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: An AWS access key id as botocore sends it (``AKIA...``: upper-case letters and digits).
ACCESS_KEY_ID = re.compile(r"[A-Z0-9]{16,128}")
#: The characters of a model name pattern: a model name's, and fnmatch's ``* ? [ ] !``.
_PATTERN_CHARS = re.compile(r"[A-Za-z0-9._*?\[\]!-]+")
#: A bearer token's characters: printable ASCII without spaces (RFC 6750's b64token and more).
_TOKEN_CHARS = re.compile(r"[\x21-\x7e]+")
#: The shortest bearer token a tenant may have.
MIN_TOKEN = 8
#: The name the management token's requests are counted under: no tenant's.
RESERVED = "management"
_KEYS = (
    "models",
    "access_keys",
    "tokens",
    "requests_per_second",
    "burst",
    "max_concurrent",
    "priority",
)


def token_digest(token: str | bytes) -> bytes:
    """What a token is kept and looked up as."""
    raw = token.encode("utf-8", "surrogateescape") if isinstance(token, str) else token
    return hashlib.sha256(raw).digest()


@dataclass(frozen=True, eq=False)
class Tenant:
    """One tenant of the file."""

    name: str
    #: Glob patterns of the model names it may invoke.
    models: tuple[str, ...]
    #: Its SigV4 secrets by access key id.
    access_keys: dict[str, str] = field(default_factory=dict)
    #: Requests per second (0: no rate) and the bucket's size.
    rate: float = 0.0
    burst: float = 0.0
    #: Requests in flight at most (0: no limit).
    max_concurrent: int = 0
    priority: str = "normal"
    #: Its priority as requests carry it (:data:`~mmserver.serving.jobs.PRIORITY`).
    rank: int = field(default=NORMAL, init=False)
    _match: re.Pattern[str] | None = field(default=None, repr=False)
    #: Whether it may invoke each name a request asked for (:meth:`TenantGate.admit`).
    seen: dict[str, bool] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        joined = "|".join(f"(?:{fnmatch.translate(p)})" for p in self.models)
        object.__setattr__(self, "_match", re.compile(joined) if joined else None)
        object.__setattr__(self, "rank", PRIORITY[self.priority])

    def may_invoke(self, model: str) -> bool:
        """Whether ``model`` (a model's name, without its version) is one of its models."""
        match = self._match
        return match is not None and match.match(model) is not None


@dataclass(frozen=True)
class Tenants:
    """A checked tenants file."""

    by_name: dict[str, Tenant]
    #: The tenant of each token, by the token's digest (:func:`token_digest`).
    by_token: dict[bytes, Tenant]
    #: The tenant of each access key id.
    by_key: dict[str, Tenant]

    def __iter__(self) -> Iterator[Tenant]:
        return iter(self.by_name.values())


class _Faults:
    """The faults of a file, each with its line."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.lines: list[tuple[int, str]] = []

    def add(self, node: yaml.Node, message: str) -> None:
        self.lines.append((node.start_mark.line + 1, message))

    def text(self) -> str:
        return "\n  ".join(
            f"{self.source}, line {line}: {message}" if line else f"{self.source}: {message}"
            for line, message in sorted(self.lines, key=lambda fault: fault[0])
        )


def _closest(word: str, choices: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; the keys are {', '.join(choices)}"


def _scalar(node: yaml.Node) -> object:
    return yaml.SafeLoader("").construct_object(node, deep=True)


def _pairs(node: yaml.MappingNode, faults: _Faults, what: str) -> list[tuple[str, yaml.Node]]:
    """The keys (strings, each once) and value nodes of a mapping."""
    out: list[tuple[str, yaml.Node]] = []
    seen: set[str] = set()
    for key_node, value in node.value:
        key = _scalar(key_node) if isinstance(key_node, yaml.ScalarNode) else None
        if not isinstance(key, str):
            faults.add(key_node, f"{what}: a key must be a string")
            continue
        if key in seen:
            faults.add(key_node, f"{what}: {key!r} is given twice")
            continue
        seen.add(key)
        out.append((key, value))
    return out


def _strings(node: yaml.Node, faults: _Faults, what: str) -> list[tuple[str, yaml.Node]]:
    if not isinstance(node, yaml.SequenceNode):
        faults.add(node, f"{what} must be a list of strings")
        return []
    out = []
    for item in node.value:
        value = _scalar(item) if isinstance(item, yaml.ScalarNode) else None
        if not isinstance(value, str) or not value:
            faults.add(item, f"{what}: each must be a non-empty string")
            continue
        out.append((value, item))
    return out


def _number(node: yaml.Node, faults: _Faults, what: str, *, whole: bool = False) -> float:
    value = _scalar(node) if isinstance(node, yaml.ScalarNode) else None
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok and whole and not isinstance(value, int):
        ok = False
    if not ok or not math.isfinite(float(value)) or float(value) <= 0:  # type: ignore[arg-type]
        kind = "a whole number" if whole else "a number"
        faults.add(node, f"{what} must be {kind} above 0, not {_shown(node)}")
        return 0.0
    return float(value)  # type: ignore[arg-type]


def _shown(node: yaml.Node) -> str:
    if isinstance(node, yaml.ScalarNode):
        return repr(node.value)[:60]
    return "a list" if isinstance(node, yaml.SequenceNode) else "a mapping"


def _pattern_fault(pattern: str) -> str | None:
    """Why ``pattern`` cannot be a model name pattern (``None``: it can)."""
    if not _PATTERN_CHARS.fullmatch(pattern):
        return "holds a character no model name has"
    depth = 0
    for char in pattern:
        if char == "[":
            if depth:
                return "opens a [ inside another"
            depth = 1
        elif char == "]":
            if not depth:
                return "closes a ] it did not open"
            depth = 0
    if depth:
        return "leaves a [ open"
    return None


def parse_tenants(text: str, source: str, management_token: str = "") -> Tenants:
    """The tenants of a file's ``text`` (``source`` names it in the faults); raises
    :class:`ConfigError` with every fault found, each with its line."""
    faults = _Faults(source)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{source}{where}: not valid YAML: {problem}") from None
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(f"{source}: must be a mapping with the key 'tenants'")
    tenants_node: yaml.Node | None = None
    for key, value in _pairs(root, faults, "the file"):
        if key == "tenants":
            tenants_node = value
        else:
            faults.add(value, f"unknown key {key!r}{_closest(key, ('tenants',))}")
    by_name: dict[str, Tenant] = {}
    by_token: dict[bytes, Tenant] = {}
    by_key: dict[str, Tenant] = {}
    if tenants_node is None:
        faults.lines.append((0, "has no 'tenants' mapping"))
    elif not isinstance(tenants_node, yaml.MappingNode):
        faults.add(tenants_node, "'tenants' must be a mapping of tenant names")
    else:
        token_of: dict[bytes, str] = {}
        for name, node in _pairs(tenants_node, faults, "tenants"):
            tenant, tokens = _tenant(name, node, faults, management_token)
            if tenant is None:
                continue
            by_name[name] = tenant
            for digest, token_node in tokens:
                other = token_of.setdefault(digest, name)
                if other != name:
                    faults.add(token_node, f"tenant {name}: a token of tenant {other} too")
                by_token[digest] = tenant
            for key_id in tenant.access_keys:
                if key_id in by_key and by_key[key_id] is not tenant:
                    faults.add(
                        node,
                        f"tenant {name}: access key {key_id} is tenant {by_key[key_id].name}'s too",
                    )
                by_key[key_id] = tenant
    if faults.lines:
        raise ConfigError("the tenants file is refused:\n  " + faults.text())
    return Tenants(by_name, by_token, by_key)


def _tenant(
    name: str, node: yaml.Node, faults: _Faults, management_token: str
) -> tuple[Tenant | None, list[tuple[bytes, yaml.Node]]]:
    what = f"tenant {name}"
    if not TENANT_NAME.fullmatch(name):
        faults.add(node, f"{what}: a tenant name is 1 to 64 letters, digits, '.', '_', '-'")
        return None, []
    if name == RESERVED:
        faults.add(node, f"{what}: the name is the management token's caller's")
        return None, []
    if not isinstance(node, yaml.MappingNode):
        faults.add(node, f"{what} must be a mapping of {', '.join(_KEYS)}")
        return None, []
    models: list[str] = []
    keys: dict[str, str] = {}
    tokens: list[tuple[bytes, yaml.Node]] = []
    rate = burst = 0.0
    concurrent = 0
    priority = "normal"
    burst_node: yaml.Node | None = None
    for key, value in _pairs(node, faults, what):
        if key == "models":
            for pattern, item in _strings(value, faults, f"{what}: models"):
                why = _pattern_fault(pattern)
                if why is not None:
                    faults.add(item, f"{what}: model pattern {pattern!r} {why}")
                else:
                    models.append(pattern)
        elif key == "access_keys":
            if not isinstance(value, yaml.MappingNode):
                faults.add(value, f"{what}: access_keys must map access key ids to secrets")
                continue
            for key_id, secret in _pairs(value, faults, f"{what}: access_keys"):
                plain = _scalar(secret) if isinstance(secret, yaml.ScalarNode) else None
                if not ACCESS_KEY_ID.fullmatch(key_id):
                    faults.add(
                        secret,
                        f"{what}: access key id {key_id[:40]!r} is not 16 to "
                        "128 upper-case letters and digits",
                    )
                elif not isinstance(plain, str) or not plain:
                    faults.add(secret, f"{what}: the secret of {key_id} must be a string")
                else:
                    keys[key_id] = plain
        elif key == "tokens":
            for token, item in _strings(value, faults, f"{what}: tokens"):
                if len(token) < MIN_TOKEN or not _TOKEN_CHARS.fullmatch(token):
                    faults.add(
                        item,
                        f"{what}: a token is at least {MIN_TOKEN} printable "
                        "ASCII characters, without spaces",
                    )
                elif management_token and token == management_token:
                    faults.add(item, f"{what}: a token may not be the management token")
                else:
                    tokens.append((token_digest(token), item))
        elif key == "requests_per_second":
            rate = _number(value, faults, f"{what}: requests_per_second")
        elif key == "burst":
            burst = _number(value, faults, f"{what}: burst")
            burst_node = value
        elif key == "max_concurrent":
            concurrent = int(_number(value, faults, f"{what}: max_concurrent", whole=True))
        elif key == "priority":
            plain = _scalar(value) if isinstance(value, yaml.ScalarNode) else None
            if plain not in PRIORITY:
                faults.add(
                    value,
                    f"{what}: priority must be one of {', '.join(PRIORITY)}, not {_shown(value)}",
                )
            else:
                priority = str(plain)
        else:
            faults.add(value, f"{what}: unknown key {key!r}{_closest(key, _KEYS)}")
    if burst_node is not None and not rate:
        faults.add(burst_node, f"{what}: burst needs requests_per_second")
    if not models:
        faults.add(node, f"{what}: has no models (glob patterns of the models it may invoke)")
    if not keys and not tokens:
        faults.add(node, f"{what}: has neither access_keys nor tokens: nobody could call as it")
    tenant = Tenant(
        name,
        tuple(models),
        keys,
        rate=rate,
        burst=max(burst or rate, 1.0) if rate else 0.0,
        max_concurrent=concurrent,
        priority=priority,
    )
    return tenant, tokens
