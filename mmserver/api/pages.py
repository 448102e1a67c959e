"""Pages for people, on the API's port: the API described in OpenAPI 3.1 (``GET /openapi.json``,
``OPTIONS /``), Swagger UI over it (``GET /docs``), a model's own document and page where it can
be called (``GET /v2/models/{model}/openapi.json`` and ``/docs``), and the operators' status page
(``GET /status``, refreshed from ``GET /status.json``).

Swagger UI's files come from the ``swagger-ui-py`` distribution, served from the package's folder
under ``/docs/``: a page makes no request to another host. A model's page follows the listing
rules (with tenants, a tenant's token shows its own models only; the page sends the token the
browser was given). The status page, like the management calls, needs the management token off
loopback and on a server with tenants: the page asks for it when ``/status.json`` answers 401,
and keeps it for the browser's session.

The status page reads what the server keeps anyway: the loaded models' pools (state, lane,
workers, memory, queue), each model's answers and failures since it loaded and its answer times
over the last minute (:mod:`mmserver.ops.recent`), the load and eviction counters (their change
over the last five minutes, from the readings of earlier calls), and the backend processes' CPU
time and resident memory (``psutil``). A call walks one page of the loaded models (at most
:data:`PAGE` of them, filtered by name), so it costs the same for a store of 100,000 models.
"""

from __future__ import annotations

import collections
import functools
import html
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import psutil
from aiohttp import hdrs, web

from mmserver import __version__
from mmserver.api import openapi
from mmserver.api.access import check_visible, viewer
from mmserver.api.middleware import Handler, answers_errors, authorize
from mmserver.api.repository import metadata_of_loaded
from mmserver.api.state import ApiState
from mmserver.api.web import STATE
from mmserver.errors import InvalidInput, NotFound
from mmserver.store.names import normalize_name

#: Loaded models on one page of the status page.
PAGE = 200
#: Seconds of load and eviction counts the status page shows.
RECENT_S = 300.0
#: The fewest seconds between two readings kept for it.
_READING_GAP_S = 5.0

_HTML = "text/html"
_ASSETS = {
    "swagger-ui.css": "text/css",
    "swagger-ui-bundle.js": "application/javascript",
    "swagger-ui-standalone-preset.js": "application/javascript",
    "favicon-32x32.png": "image/png",
    "favicon-16x16.png": "image/png",
}


@functools.cache
def _swagger_folder() -> Path | None:
    """Swagger UI's files, from the installed ``swagger-ui-py`` (found once, not imported)."""
    spec = importlib.util.find_spec("swagger_ui")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "static"
    return folder if (folder / "swagger-ui-bundle.js").is_file() else None


_SWAGGER_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<link rel="icon" href="/docs/favicon-32x32.png">
<link rel="stylesheet" href="/docs/swagger-ui.css">
<style>body {{ margin: 0; }} .topbar {{ display: none; }}</style>
</head>
<body>
<div id="swagger-ui"></div>
<script src="/docs/swagger-ui-bundle.js"></script>
<script>
window.ui = SwaggerUIBundle({{
  url: {url},
  dom_id: "#swagger-ui",
  deepLinking: true,
  tryItOutEnabled: {try_it},
  validatorUrl: null,
  displayRequestDuration: true,
  persistAuthorization: true,
}});
</script>
</body>
</html>
"""


def _swagger(title: str, url: str, try_it: bool) -> web.Response:
    if _swagger_folder() is None:
        raise NotFound(
            "the documentation page needs the swagger-ui-py package (pip install swagger-ui-py); "
            "the API's description is at /openapi.json"
        )
    page = _SWAGGER_PAGE.format(
        title=html.escape(title), url=json.dumps(url), try_it="true" if try_it else "false"
    )
    return web.Response(text=page, content_type=_HTML)


async def openapi_document(request: web.Request) -> web.Response:
    """``GET /openapi.json`` and ``OPTIONS /``: every route the server answers."""
    return web.json_response(openapi.document())


async def docs(request: web.Request) -> web.Response:
    """``GET /docs``: Swagger UI over ``/openapi.json``."""
    return _swagger("mmserver API", "/openapi.json", try_it=False)


async def docs_asset(request: web.Request) -> web.StreamResponse:
    """``GET /docs/{asset}``: one of Swagger UI's files."""
    asset = request.match_info["asset"]
    folder = _swagger_folder()
    kind = _ASSETS.get(asset)
    if folder is None or kind is None:
        raise NotFound(f"/docs/{asset[:60]} is not a file of the documentation page")
    return web.FileResponse(folder / asset, headers={hdrs.CONTENT_TYPE: kind})


async def _model_view(request: web.Request) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The model the path names (visible to the caller), its V2 metadata and what its load
    told of it (loading it if needed)."""
    state = request.app[STATE]
    name = normalize_name(request.match_info["model"])
    check_visible(
        state.tenants, viewer(state.tenants, request.headers.get(hdrs.AUTHORIZATION)), name
    )
    wlm = state.wlm
    key = await wlm.ready(name)
    signature = wlm.signature(key)
    return name, await metadata_of_loaded(wlm, key, signature), signature or {}


async def model_openapi(request: web.Request) -> web.Response:
    """``GET /v2/models/{model}/openapi.json``: the model's inference calls, with its input
    and an example."""
    name, metadata, signature = await _model_view(request)
    return web.json_response(openapi.model_document(name, metadata, signature))


async def model_docs(request: web.Request) -> web.Response:
    """``GET /v2/models/{model}/docs``: Swagger UI over the model's document, "Try it out" on."""
    name, _, _ = await _model_view(request)
    return _swagger(f"mmserver: model {name}", f"/v2/models/{name}/openapi.json", try_it=True)


# ------------------------------------------------------------------------------------------------
# The status page
# ------------------------------------------------------------------------------------------------


class StatusBoard:
    """What the status page remembers between two calls: readings of the load and eviction
    counters (to tell those of the last minutes) and of the backend processes' CPU time (to
    tell their CPU use)."""

    def __init__(self) -> None:
        #: When the server's process started (the counters' zero), on the wall clock.
        self.started = psutil.Process().create_time()
        self.readings: collections.deque[tuple[float, float, float, float]] = collections.deque()
        up = time.time() - self.started
        if up < RECENT_S:  # the counters started at zero then
            self.readings.append((time.monotonic() - up, 0.0, 0.0, 0.0))
        self.cpu: dict[int, tuple[float, float]] = {}
        self.processes: dict[int, psutil.Process] = {}

    def recent(self, now: float, loads: float, evictions: float, failures: float) -> dict[str, Any]:
        readings = self.readings
        if not readings or now - readings[-1][0] >= _READING_GAP_S:
            readings.append((now, loads, evictions, failures))
        while len(readings) > 1 and now - readings[1][0] >= RECENT_S:
            readings.popleft()
        since, loads0, evictions0, failures0 = readings[0]
        return {
            "seconds": round(now - since, 1),
            "loads": int(loads - loads0),
            "evictions": int(evictions - evictions0),
            "load_failures": int(failures - failures0),
        }

    def backend(self, name: str, pid: int) -> dict[str, Any]:
        """One backend process's row: its CPU use since the last call (at the first, since it
        started) and its resident memory."""
        row: dict[str, Any] = {"name": name, "pid": pid, "cpu_percent": None, "rss_bytes": None}
        now = time.time()
        try:
            process = self.processes.get(pid)
            if process is None:
                process = self.processes[pid] = psutil.Process(pid)
                self.cpu[pid] = (process.create_time(), 0.0)
            times = process.cpu_times()
            used = times.user + times.system
            row["rss_bytes"] = process.memory_info().rss
        except psutil.Error:
            self.processes.pop(pid, None)
            return row
        since, before = self.cpu[pid]
        self.cpu[pid] = (now, used)
        if now > since:
            row["cpu_percent"] = round(100.0 * (used - before) / (now - since), 1)
        return row

    def forget_except(self, pids: set[int]) -> None:
        for gone in set(self.cpu) - pids:
            self.cpu.pop(gone, None)
            self.processes.pop(gone, None)


def _board(state: ApiState) -> StatusBoard:
    board = state.status_board
    if not isinstance(board, StatusBoard):
        board = state.status_board = StatusBoard()
    return board


def _total(family: Any) -> float:
    return float(sum(child.value for _, _, child in family.series()))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def status_of(state: ApiState, name_filter: str = "", page: int = 1) -> dict[str, Any]:
    """What the status page shows (see the module docstring)."""
    wlm = state.wlm
    room = wlm.room
    metrics = state.metrics
    board = _board(state)
    now = time.monotonic()
    loaded = room.loaded
    names = [n for n in loaded if name_filter in n] if name_filter else list(loaded)
    names.sort()
    pages = max(1, -(-len(names) // PAGE))
    page = min(max(page, 1), pages)
    rows = []
    for name in names[(page - 1) * PAGE : page * PAGE]:
        pool = loaded[name]
        requests = pool.requests
        count, p50, p99 = requests.recent.summary()
        model, _, version = name.partition("/")
        rows.append(
            {
                "name": model,
                "version": version or None,
                "status": wlm.status(name).value,
                "lane": pool.lane,
                "workers": len(pool.workers),
                "memory_bytes": pool.memory_bytes,
                "queued": len(pool.queue),
                "requests": requests.answered_total,
                "errors": requests.failed_total,
                "last_minute": count,
                "p50_ms": _ms(p50),
                "p99_ms": _ms(p99),
                "pinned": name in room.pinned,
            }
        )
    backends = [board.backend(label, pid) for label, pid in wlm.backend.processes()]
    board.forget_except({row["pid"] for row in backends})
    budget = room.budget
    return {
        "server": {
            "version": __version__,
            "uptime_s": round(time.time() - board.started, 1),
            "accepting": wlm.accepting,
            "models_loaded": len(loaded),
            "max_loaded_models": state.config.max_loaded_models,
            "models_pinned": len(room.pinned),
            "memory_used_bytes": room.used_bytes() + room.unaccounted(),
            "memory_budget_bytes": room.budget_bytes,
            "memory_budget_source": budget.source,
            "queued": room.queued.jobs,
        },
        "recent": board.recent(
            now,
            _total(metrics.model_loads),
            _total(metrics.model_evictions),
            _total(metrics.model_load_failures),
        ),
        "backends": backends,
        "models": rows,
        "filter": name_filter,
        "page": page,
        "pages": pages,
        "matching": len(names),
    }


async def status_data(request: web.Request) -> web.Response:
    """``GET /status.json``: one page of the loaded models (``filter``: a part of their name;
    ``page``), the backends and the budget."""
    authorize(request)
    query = request.query
    try:
        page = int(query.get("page", "1"))
    except ValueError:
        raise InvalidInput(f"page must be a whole number, got {query['page'][:20]!r}") from None
    return web.json_response(status_of(request.app[STATE], query.get("filter", "")[:128], page))


async def status(request: web.Request) -> web.Response:
    """``GET /status``: the page, which polls ``/status.json`` (the page holds no data: it asks
    for the management token when ``/status.json`` wants one)."""
    return web.Response(text=_STATUS_PAGE, content_type=_HTML)


_STATUS_PAGE = (Path(__file__).parent / "status.html").read_text(encoding="utf-8")

#: The handlers of this module's routes, by operation.
HANDLERS: dict[str, Handler] = {
    "openapi": answers_errors(openapi_document),
    "docs": answers_errors(docs),
    "docs_asset": answers_errors(docs_asset),
    "model_docs": answers_errors(model_docs),
    "model_openapi": answers_errors(model_openapi),
    "status": answers_errors(status),
    "status_data": answers_errors(status_data),
}
