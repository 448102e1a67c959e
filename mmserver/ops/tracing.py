"""Traces on or off, from the environment: the one place that imports OpenTelemetry's SDK
(:mod:`mmserver.ops.otel`), and only when the ``OTEL_*`` variables ask for traces
(:func:`mmserver.ops.traces.wanted`). The server and ``mmserver transform`` start theirs here."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from mmserver.errors import ConfigError
from mmserver.ops.traces import SWITCHES, wanted

if TYPE_CHECKING:
    from mmserver.ops.otel import Tracing


def tracing_from(environ: Mapping[str, str] = os.environ) -> Tracing | None:
    """The traces ``environ`` asks for, ``None`` when it asks for none. Raises
    :class:`ConfigError` when it asks for them and the SDK, or an exporter it names, is not
    installed."""
    if not wanted(environ):
        return None
    try:
        from mmserver.ops.otel import Tracing
    except ImportError as exc:
        asked = ", ".join(name for name in SWITCHES if environ.get(name, "").strip())
        raise ConfigError(
            f"the environment asks for traces ({asked}) but OpenTelemetry's SDK cannot be "
            f"imported ({exc}): pip install 'mmserver[otel]', or unset those variables"
        ) from None
    return Tracing.from_environment(environ)
