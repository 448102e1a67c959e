"""Versions: which version of a model a request goes to, and the rollout of a model's versions.

A model folder of the store may hold numbered versions (``NAME/1/``, ``NAME/2.tar.gz``...).
Each version is a model of its own to the rest of the server, under its key ``NAME/2``: it has
its own record, loads, scales and is evicted on its own, and its series carry
``model="NAME/2"``. This module owns what is per model rather than per version, one
:class:`Rollout` each:

- the versions the store holds, read when the model is first asked for, and again when a
  request names a version not known yet;
- the **default** version, which a request that names none goes to: the one the management
  API set (:meth:`Versions.set_default`), else ``option.default_version`` of the model
  folder's ``serving.properties``, else the highest;
- the **canary**: a version that takes ``canary_percent`` % of the requests that name none
  (``option.canary_version``, ``option.canary_percent``, or the management API). A request
  with a routing key goes by a hash of the key (:func:`canary_bucket`: the same key, the same
  version, on every instance of a cluster); one without, at random.

A request naming a version goes to it; V2's version ``1`` of a model without versions is the
model itself. :meth:`Versions.route` answers at once for a model whose rollout is known (the
request path's one dictionary look-up); :meth:`Versions.resolve` finds out, looking in the store.

What the management API sets is written to ``rollouts.json`` in the server's ``state_dir``
(else its cache folder) and read back at start, so a switch survives a restart; a version the
file names that the store no longer holds is ignored. Only the event loop calls this module
(the file is written in a thread, one write at a time).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import zlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

from mmserver import errors
from mmserver.catalog import Catalog
from mmserver.pool import ModelPool
from mmserver.store import normalize_target, split_version, version_key

log = logging.getLogger(__name__)

#: The file of the rollouts set through the management API.
STATE_FILE = "rollouts.json"


@dataclass
class Saved:
    """What the management API set for one model (``None``: not set)."""

    default: int | None = None
    canary: int | None = None
    canary_percent: float | None = None


def canary_bucket(key: str) -> float:
    """Where the routing key ``key`` falls in [0, 100): a request goes to the canary when this
    is below its percentage. CRC-32, so every process and instance agrees."""
    return zlib.crc32(key.encode("utf-8", "surrogatepass")) % 10_000 / 100


@dataclass
class Rollout:
    """One model with versions: its versions, and where its requests go."""

    name: str
    versions: tuple[int, ...]
    #: The version requests that name none go to.
    default: int
    #: Where :attr:`default` comes from: ``store`` (the highest), ``serving.properties`` or
    #: ``management``.
    default_from: str
    #: Why requests that name no version cannot be routed (a default that names no version):
    #: they are answered this error; those naming a version are served.
    error: errors.ConfigError | None = None
    #: The canary version and the share (%) of the requests naming no version it takes.
    canary: int | None = None
    canary_percent: float = 0.0
    #: Where the canary comes from: ``serving.properties`` or ``management`` (``None``: none).
    canary_from: str | None = None

    @property
    def splits(self) -> bool:
        """Whether some requests naming no version go to the canary."""
        return self.canary is not None and self.canary_percent > 0 and self.canary != self.default

    def pick(self, routing: str | None, draw: Callable[[], float]) -> str:
        """The key of the version a request naming none goes to (``routing``: its routing
        key; ``draw``: a random number in [0, 1))."""
        if self.splits:
            point = canary_bucket(routing) if routing is not None else draw() * 100
            if point < self.canary_percent:
                return version_key(self.name, cast(int, self.canary))
        return version_key(self.name, self.default)

    def key(self, version: int) -> str:
        return version_key(self.name, version)

    @property
    def default_key(self) -> str:
        return version_key(self.name, self.default)


def make_rollout(
    name: str, versions: tuple[int, ...], props: dict[str, str], saved: Saved | None
) -> Rollout:
    """The rollout of model ``name`` from its versions, its folder's ``serving.properties``
    (``props``) and what the management API set (``saved``); a key that names no version is
    its :attr:`Rollout.error`."""
    rollout = Rollout(name, versions, versions[-1], "store")
    text = props.get("option.default_version")
    if text is not None:
        try:
            rollout.default = _version_in(name, "option.default_version", text, versions)
            rollout.default_from = "serving.properties"
        except errors.ConfigError as exc:
            rollout.error = exc
    canary_text = props.get("option.canary_version")
    if canary_text is not None and rollout.error is None:
        try:
            rollout.canary = _version_in(name, "option.canary_version", canary_text, versions)
            rollout.canary_percent = _percent(
                name, "option.canary_percent", props.get("option.canary_percent", "0")
            )
            rollout.canary_from = "serving.properties"
        except errors.ConfigError as exc:
            rollout.error = exc
    if saved is not None and saved.default in versions:
        rollout.default, rollout.default_from, rollout.error = saved.default, "management", None
    if saved is not None and saved.canary_percent is not None:
        if saved.canary is None or saved.canary in versions:
            rollout.canary, rollout.canary_percent = saved.canary, saved.canary_percent
            rollout.canary_from = "management" if saved.canary is not None else None
    return rollout


def _percent(name: str, key: str, text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        value = -1.0
    if 0 <= value <= 100:
        return value
    raise errors.ConfigError(
        f"model {name}: serving.properties: {key}={text!r} must be a number from 0 to 100",
        model=name,
    )


def _version_in(name: str, key: str, text: str, versions: tuple[int, ...]) -> int:
    stripped = text.strip()
    if stripped.isdigit() and int(stripped) in versions:
        return int(stripped)
    raise errors.ConfigError(
        f"model {name}: serving.properties: {key}={text!r} is not one of its versions "
        f"({', '.join(map(str, versions))})",
        model=name,
    )


class Versions:
    """The rollouts of the models with versions (see the module docstring)."""

    def __init__(
        self, catalog: Catalog, loaded: OrderedDict[str, ModelPool], state_dir: Path
    ) -> None:
        self.catalog = catalog
        self._loaded = loaded
        self.state_file = state_dir / STATE_FILE
        #: The models with versions, by name.
        self.rollouts: dict[str, Rollout] = {}
        self._saved: dict[str, Saved] = {}
        self._writing = asyncio.Lock()
        #: Draws the share of a request without a routing key.
        self.random = random.Random()

    async def open(self) -> None:
        """Read what the management API set before the server last stopped."""
        try:
            text = await asyncio.to_thread(self.state_file.read_text)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("the rollouts in %s cannot be read: %s", self.state_file, exc)
            return
        try:
            data = json.loads(text)
            self._saved = {str(k): Saved(**v) for k, v in data["models"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("the rollouts in %s are malformed and ignored: %s", self.state_file, exc)

    # Requests ---------------------------------------------------------------------------------

    def route(self, name: str, routing: str | None = None) -> str | None:
        """The key of the version a request for ``name`` (with the routing key ``routing``)
        goes to, when that is known without a look-up in the store (``None``: it is not)."""
        rollout = self.rollouts.get(name)
        if rollout is not None and rollout.error is None:
            return rollout.pick(routing, self.random.random)
        if name[-2:] == "/1" and name[:-2] in self._loaded:
            return name[:-2]  # V2's version 1 of a loaded model without versions
        return None

    async def resolve(self, name: str, routing: str | None = None) -> str:
        """The key of the model or version a request for ``name`` (any spelling, with or without
        a version) goes to: :class:`errors.ModelNotFound` for a version the model does not
        have. A name the store does not hold comes back as it is (its load answers 404)."""
        key = normalize_target(name)
        base, version = split_version(key)
        rollout = self.rollouts.get(base)
        if rollout is None or (version is not None and version not in rollout.versions):
            rollout = await self._probe(base)
        if rollout is None:
            if version is None or version == 1:
                return base
            raise errors.ModelNotFound(
                f"model {base} has one version, 1; there is no version {str(version)!r}"
            )
        if version is None:
            if rollout.error is not None:
                raise rollout.error
            return rollout.pick(routing, self.random.random)
        if version not in rollout.versions:
            raise errors.ModelNotFound(
                f"model {base} has no version {version}; its versions are "
                f"{', '.join(map(str, rollout.versions))}"
            )
        return key

    async def rollout_of(self, name: str) -> Rollout | None:
        """The rollout of model ``name`` as the store holds it now (``None``: no versions)."""
        return await self._probe(normalize_target(name).partition("/")[0])

    async def _probe(self, base: str) -> Rollout | None:
        """Look in the store whether model ``base`` has versions; its rollout, made or
        updated, or ``None``."""
        record = self.catalog.get(base)
        if record is not None and (
            record.registered is not None or record.pool is not None or record.load is not None
        ):
            return None  # a model of its own files, loaded or loading
        url = self.catalog.index.url(base)
        if url is not None and url.rsplit("/", 1)[-1] != base:
            return None  # listed as an archive: no versions
        # Not noted in the store index unless it has versions: the load that follows looks
        # a model of its own files up where the index says (mmserver.loading).
        entry = await asyncio.to_thread(self.catalog.store.find, base)
        if entry is not None and entry.versions:
            self.catalog.note(base, entry)
        if entry is None or not entry.versions:
            self.rollouts.pop(base, None)
            return None
        known = self.rollouts.get(base)
        if known is not None and known.versions == entry.versions:
            return known
        props = await asyncio.to_thread(self.catalog.store.model_properties, base)
        rollout = make_rollout(base, entry.versions, props, self._saved.get(base))
        if known is not None and known.default_from == "management":
            if known.default in entry.versions:
                rollout.default, rollout.default_from = known.default, known.default_from
                rollout.error = None
        if known is not None and known.canary_from == "management":
            if known.canary in entry.versions:
                rollout.canary, rollout.canary_percent = known.canary, known.canary_percent
                rollout.canary_from = known.canary_from
        self.rollouts[base] = rollout
        return rollout

    # Management -------------------------------------------------------------------------------

    async def switch(
        self,
        name: str,
        version: int,
        load: Callable[[str], Awaitable[ModelPool]],
        canary_percent: float | None = None,
    ) -> Rollout:
        """Send the requests to model ``name`` that name no version to ``version`` from now
        on (with ``canary_percent``: that share of them, as its canary; 0 ends the canary),
        once ``load`` has loaded it (its workers started: no request waits for its load); a
        version that fails to load takes no request (the call fails with the load's error).
        Written down, so it survives a restart."""
        rollout = await self._rollout_named(name, version)
        if canary_percent is not None and canary_percent == 0:
            await self.set_canary(rollout, None, 0.0)
            return rollout
        await load(rollout.key(version))
        if canary_percent is None:
            await self.set_default(rollout, version)
        else:
            await self.set_canary(rollout, version, canary_percent)
        return rollout

    async def _rollout_named(self, name: str, version: int) -> Rollout:
        """The rollout of model ``name``, which must hold ``version``."""
        rollout = await self.rollout_of(name)
        base = normalize_target(name).partition("/")[0]
        if rollout is None:
            raise errors.ModelNotFound(
                f"model {base} has no versions in the model store: a model with versions is a "
                "folder holding 1/, 2.tar.gz..."
            )
        if version not in rollout.versions:
            raise errors.ModelNotFound(
                f"model {base} has no version {version}; its versions are "
                f"{', '.join(map(str, rollout.versions))}"
            )
        return rollout

    async def set_default(self, rollout: Rollout, version: int) -> None:
        """Send the requests that name no version to ``version`` (loaded by the caller first),
        and write it down."""
        rollout.default, rollout.default_from, rollout.error = version, "management", None
        self._saved.setdefault(rollout.name, Saved()).default = version
        await self._save()
        log.info("model %s: requests go to version %d from now on", rollout.name, version)

    async def set_canary(self, rollout: Rollout, version: int | None, percent: float) -> None:
        """Send ``percent`` % of the requests that name no version to ``version`` (loaded by
        the caller first; ``None``: no canary), and write it down."""
        rollout.canary, rollout.canary_percent = version, percent
        rollout.canary_from = "management" if version is not None else None
        saved = self._saved.setdefault(rollout.name, Saved())
        saved.canary, saved.canary_percent = version, percent
        await self._save()
        if version is None:
            log.info("model %s: the canary ended", rollout.name)
        else:
            log.info("model %s: %g%% of requests go to version %d", rollout.name, percent, version)

    async def _save(self) -> None:
        """Write what the management API set (atomically: a reader sees the old file or the
        new one), one write at a time."""
        data: dict[str, Any] = {"models": {k: asdict(v) for k, v in sorted(self._saved.items())}}
        text = json.dumps(data, indent=1) + "\n"
        async with self._writing:
            try:
                await asyncio.to_thread(_write_atomically, self.state_file, text)
            except OSError as exc:
                raise errors.ServiceUnavailable(
                    f"the rollout could not be written to {self.state_file}: {exc}"
                ) from None


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
