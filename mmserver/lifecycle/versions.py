"""Versions: which version of a model a request goes to, and the rollouts of models' versions.

A model folder of the store may hold numbered versions (``NAME/1/``, ``NAME/2.tar.gz``...).
Each version is a model of its own to the rest of the server, under its key ``NAME/2``: it has
its own record, loads, scales and is evicted on its own, and its series carry
``model="NAME/2"``. This module keeps what is per model rather than per version, one
:class:`~mmserver.policy.rollout.Rollout` each (its default version, canary and shadow: see
:mod:`mmserver.policy.rollout`), made from the versions the store holds (read when the model is
first asked for, when a request names a version not known yet, and when it is described), the model
folder's ``serving.properties`` and what the management API set.

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
import random
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mmserver import errors
from mmserver.lifecycle.catalog import Catalog, ModelListing
from mmserver.ops.statefile import write_atomically
from mmserver.policy.rollout import FROM_MANAGEMENT, Rollout, Saved, Share, make_rollout
from mmserver.serving.pool import ModelPool
from mmserver.store.names import normalize_target, split_version

log = logging.getLogger(__name__)

#: The file of the rollouts set through the management API.
STATE_FILE = "rollouts.json"


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

    def listed(self, rows: list[ModelListing]) -> list[ModelListing]:
        """``rows`` of a listing, a model with versions given its default version's status."""
        rollouts = self.rollouts
        if not rollouts:
            return rows
        records = self.catalog.records
        listed = []
        for row in rows:
            rollout = rollouts.get(row.name)
            record = records.get(rollout.default_key) if rollout is not None else None
            listed.append(row if record is None else row._replace(status=record.status))
        return listed

    def shadow_of(self, name: str, routing: str | None) -> str | None:
        """The key of the shadow version a request for ``name`` (naming no version) also runs
        on, or ``None``."""
        rollout = self.rollouts.get(name)
        if rollout is None or rollout.error is not None:
            return None
        version = rollout.takes("shadow", routing, self.random.random)
        return None if version is None else rollout.key(version)

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
        # a model of its own files up where the index says (mmserver.lifecycle.loading).
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
        if known is not None:  # what a call set since the file was read stays
            if known.default_from == FROM_MANAGEMENT and known.default in entry.versions:
                rollout.default, rollout.default_from = known.default, known.default_from
                rollout.error = None
            for role, share in known.shares.items():
                if share.source == FROM_MANAGEMENT and share.version in entry.versions:
                    rollout.shares[role] = share
        self.rollouts[base] = rollout
        return rollout

    # Management -------------------------------------------------------------------------------

    async def switch(
        self,
        name: str,
        version: int,
        load: Callable[[str], Awaitable[ModelPool]],
        role: str = "default",
        percent: float = 100.0,
    ) -> Rollout:
        """Make ``version`` model ``name``'s default (``role`` ``default``), or give it
        ``percent`` % of the requests that name no version as its canary or shadow (0 ends
        that role), once ``load`` has loaded it (its workers started: no request waits for its
        load); a version that fails to load takes no request (the call fails with the load's
        error). Written down, so it survives a restart."""
        rollout = await self._rollout_named(name, version)
        if role != "default" and percent == 0:
            await self.set_share(rollout, role, None)
            return rollout
        await load(rollout.key(version))
        if role == "default":
            await self.set_default(rollout, version)
        else:
            await self.set_share(rollout, role, Share(version, percent, FROM_MANAGEMENT))
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
        rollout.default, rollout.default_from, rollout.error = version, FROM_MANAGEMENT, None
        self._saved.setdefault(rollout.name, Saved()).default = version
        await self._save()
        log.info("model %s: requests go to version %d from now on", rollout.name, version)

    async def set_share(self, rollout: Rollout, role: str, share: Share | None) -> None:
        """Give ``share`` the role ``role`` (its version loaded by the caller first; ``None``:
        end the role), and write it down."""
        saved = self._saved.setdefault(rollout.name, Saved())
        if share is None:
            rollout.shares.pop(role, None)
            setattr(saved, role, [None, 0.0])
            log.info("model %s: the %s ended", rollout.name, role)
        else:
            rollout.shares[role] = share
            setattr(saved, role, [share.version, share.percent])
            log.info(
                "model %s: version %d is the %s of %g%% of requests",
                rollout.name,
                share.version,
                role,
                share.percent,
            )
        await self._save()

    def saved(self) -> dict[str, Any]:
        """What the management API set, as ``rollouts.json`` holds it."""
        return {"models": {k: asdict(v) for k, v in sorted(self._saved.items())}}

    async def _save(self) -> None:
        """Write what the management API set (atomically: a reader sees the old file or the
        new one), one write at a time."""
        text = json.dumps(self.saved(), indent=1) + "\n"
        async with self._writing:
            try:
                await asyncio.to_thread(write_atomically, self.state_file, text)
            except OSError as exc:
                raise errors.ServiceUnavailable(
                    f"the rollout could not be written to {self.state_file}: {exc}"
                ) from None
