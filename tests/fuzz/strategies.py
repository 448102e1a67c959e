"""Shared hypothesis settings and input strategies of the property tests."""

from __future__ import annotations

import io
import json
import math
import os
from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from mmserver.errors import MMServerError

#: Modest example counts, so the whole folder runs in seconds; ``MMSERVER_FUZZ_SCALE=50`` runs
#: fifty times as many. ``database=None``: nothing is written into the repository; a failure
#: prints what reproduces it.
SCALE = max(1, int(os.environ.get("MMSERVER_FUZZ_SCALE", "1")))
FAST = settings(max_examples=300 * SCALE, deadline=None, database=None, print_blob=True)
SLOW = settings(
    max_examples=120 * SCALE,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def assert_client_error(exc: BaseException, *allowed: type[MMServerError]) -> None:
    """``exc`` is one of the documented client errors: an ``allowed`` class with a 4xx status."""
    assert isinstance(exc, allowed), f"undocumented error {type(exc).__name__}: {exc}"
    assert isinstance(exc, MMServerError)
    assert 400 <= exc.status_code < 500, exc
    assert exc.message and isinstance(exc.message, str)


# ------------------------------------------------------------------------------------------------
# Request bodies
# ------------------------------------------------------------------------------------------------

KNOWN_TYPES = (
    "application/json",
    "text/csv",
    "application/x-npy",
    "application/json; charset=utf-8",
    "TEXT/CSV; charset=latin-1",
    " application/x-npy ;q=1",
    "",
)

content_types = st.one_of(
    st.none(),
    st.sampled_from(KNOWN_TYPES),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40),
)

#: JSON numbers, including the ones JSON allows but rows do not (huge, NaN, infinity).
json_numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -0.0, 1e308, -1e-320, 2**63, -(2**63) - 1, 2**64]),
)

json_scalars = st.one_of(st.none(), st.booleans(), json_numbers, st.text(max_size=8))

json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.dictionaries(
            st.sampled_from(["inputs", "instances", "data", "x"]), children, max_size=3
        ),
    ),
    max_leaves=30,
)

#: Row-shaped JSON: lists of lists of numbers, sometimes ragged or holding a stray value.
json_rows = st.lists(
    st.lists(st.one_of(json_numbers, json_scalars), min_size=0, max_size=4), max_size=5
)


def json_body(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def is_finite_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def expected_rows(value: Any) -> list[list[float]] | None:
    """What a well-formed JSON body decodes to, or ``None`` when it must be refused."""
    if isinstance(value, dict):
        for key in ("inputs", "instances"):
            if key in value:
                value = value[key]
                break
        else:
            return None
    if not isinstance(value, list) or not value:
        return None
    if all(is_finite_number(v) for v in value):
        return [[float(v) for v in value]]
    if not all(isinstance(row, list) for row in value):
        return None
    width = len(value[0])
    if width == 0 or any(len(row) != width for row in value):
        return None
    if not all(is_finite_number(v) for row in value for v in row):
        return None
    return [[float(v) for v in row] for row in value]


csv_cells = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.integers(min_value=-(10**6), max_value=10**6).map(str),
    st.sampled_from(["", " ", "nan", "inf", "-Infinity", "1e999", "x", "1_0", '"2"', "0x1"]),
    st.text(max_size=5),
)

csv_bodies = st.lists(st.lists(csv_cells, min_size=1, max_size=4), min_size=0, max_size=5).map(
    lambda rows: "\n".join(",".join(cells) for cells in rows)
)


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def npy_with_header(header: str, data: bytes, version: bytes = b"\x01\x00") -> bytes:
    """A hand-written .npy: any header text, any data."""
    text = header.encode("latin1", "replace")
    text += b" " * ((63 - (10 + len(text)) % 64) % 64) + b"\n"
    return b"\x93NUMPY" + version + len(text).to_bytes(2, "little") + text + data


npy_dims = st.one_of(
    st.integers(min_value=-3, max_value=4), st.sampled_from([2**31, 2**62, 10**12])
)
npy_headers = st.builds(
    lambda descr, fortran, shape: (
        f"{{'descr': {descr!r}, 'fortran_order': {fortran}, 'shape': {tuple(shape)!r}, }}"
    ),
    st.sampled_from(["<f8", ">f4", "<i2", "|u1", "<f2", "|b1", "<c16", "O", "<U3", "|V4", "zz"]),
    st.booleans(),
    st.lists(npy_dims, max_size=3),
)
