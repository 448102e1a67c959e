"""Request bodies: any bytes with any content type decode to rows or to a documented 4xx."""

from __future__ import annotations

import csv
import io

import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mmserver.errors import InvalidInput, UnsupportedMediaType
from tests.fuzz.strategies import (
    FAST,
    assert_client_error,
    content_types,
    csv_bodies,
    expected_rows,
    json_body,
    json_rows,
    json_values,
    npy_bytes,
    npy_headers,
    npy_with_header,
)
from tests.models import decode


def decoded_or_refused(body: bytes, content_type: str | None) -> np.ndarray | None:
    """The rows ``decode`` returns, checked; ``None`` when it refused with a documented error."""
    try:
        rows = decode(body, content_type)
    except Exception as exc:
        assert_client_error(exc, InvalidInput, UnsupportedMediaType)
        return None
    assert isinstance(rows, np.ndarray)
    assert rows.dtype == np.float64 and rows.ndim == 2 and rows.flags.c_contiguous
    assert rows.shape[0] >= 1 and rows.shape[1] >= 1
    assert np.isfinite(rows).all()
    return rows


@FAST
@given(st.binary(max_size=300), content_types)
@example(b"\x93NUMPY\x01\x00", "application/x-npy")
@example(b"[" * 5000, None)
@example(b"\xef\xbb\xbf[[1]]", "application/json")
@example(b"\x00,\x00", "text/csv")
def test_any_bytes_with_any_content_type(body: bytes, content_type: str | None) -> None:
    decoded_or_refused(body, content_type)


def assert_decoded_as_expected(value: object, rows: np.ndarray | None) -> None:
    """``rows`` is what a JSON body of ``value`` must decode to, or ``None`` if it must be
    refused."""
    expected = expected_rows(value)
    if expected is None:
        assert rows is None, f"{value!r} was accepted as {rows!r}"
    else:
        assert rows is not None and rows.tolist() == expected


@FAST
@given(json_values)
def test_any_json_value(value: object) -> None:
    rows = decoded_or_refused(json_body(value), "application/json")
    assert_decoded_as_expected(value, rows)


@FAST
@given(json_rows, st.sampled_from(["inputs", "instances", None]))
def test_row_shaped_json(rows_value: list[list[object]], key: str | None) -> None:
    value: object = rows_value if key is None else {key: rows_value}
    rows = decoded_or_refused(json_body(value), "application/json; charset=utf-8")
    assert_decoded_as_expected(value, rows)


@FAST
@given(csv_bodies, st.sampled_from(["\n", "\r\n"]), st.booleans())
def test_csv_bodies(text: str, newline: str, trailing: bool) -> None:
    body = (text.replace("\n", newline) + (newline if trailing else "")).encode()
    rows = decoded_or_refused(body, "text/csv")
    if rows is None:
        return
    # Accepted: the same numbers Python's csv and float() read, line by line.
    lines = [
        r
        for r in csv.reader(io.StringIO(body.decode("utf-8-sig")))
        if len(r) > 1 or (r and r[0].strip())
    ]
    assert rows.tolist() == [[float(c) for c in r] for r in lines]


@FAST
@given(
    hnp.arrays(
        st.one_of(
            hnp.integer_dtypes(),
            hnp.unsigned_integer_dtypes(),
            hnp.floating_dtypes(),
            hnp.boolean_dtypes(),
            hnp.complex_number_dtypes(),
        ),
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
    ),
    st.booleans(),
)
def test_npy_arrays(array: np.ndarray, fortran: bool) -> None:
    if fortran:
        array = np.asfortranarray(array)
    rows = decoded_or_refused(npy_bytes(array), "application/x-npy")
    acceptable = (
        array.dtype.kind in "iuf"
        and array.ndim in (1, 2)
        and array.size > 0
        and bool(np.isfinite(array.astype(np.float64)).all())
    )
    if not acceptable:
        assert rows is None
        return
    assert rows is not None
    assert np.array_equal(rows, np.atleast_2d(array.astype(np.float64)))


@FAST
@given(npy_headers, st.binary(max_size=64), st.sampled_from([b"\x01\x00", b"\x02\x00", b"\x03\0"]))
@example("{'descr': '<f8', 'fortran_order': False, 'shape': (-1, -1), }", b"\0" * 8, b"\x01\x00")
@example("{'descr': '<f8', 'fortran_order': False, 'shape': (-1, -2), }", b"\0" * 16, b"\x01\x00")
@example("{'descr': '<f8', 'fortran_order': True, 'shape': (-2, -1), }", b"\0" * 16, b"\x01\x00")
@example(
    "{'descr': '|u1', 'fortran_order': False, 'shape': (0, 4611686018427387904), }",
    b"",
    b"\x01\x00",
)
def test_npy_headers_that_lie(header: str, data: bytes, version: bytes) -> None:
    body = (
        npy_with_header(header, data)
        if version == b"\x01\x00"
        else (b"\x93NUMPY" + version + npy_with_header(header, data)[8:])
    )
    decoded_or_refused(body, "application/x-npy")
