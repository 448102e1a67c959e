"""A captured record's JSON line, as SageMaker's data capture writes one: the fields, the
encodings by content type, the event id and time, and a differing shadow answer."""

from __future__ import annotations

import base64
import json
import multiprocessing
import uuid

from mmserver.ops.capture import Record, encode_line

AT = 1_796_117_400.25  # 2026-12-01T09:30:00.250Z


def test_a_line_has_sagemakers_fields() -> None:
    record = Record(
        "m", AT, "r-1", b"[[0.5]]", "application/json", b"1.5\n", "text/csv; charset=utf-8"
    )
    line = encode_line(record)
    assert line.endswith("}\n") and line.count("\n") == 1
    assert json.loads(line) == {
        "captureData": {
            "endpointInput": {
                "observedContentType": "application/json",
                "mode": "INPUT",
                "data": "[[0.5]]",
                "encoding": "JSON",
            },
            "endpointOutput": {
                "observedContentType": "text/csv; charset=utf-8",
                "mode": "OUTPUT",
                "data": "1.5\n",
                "encoding": "CSV",
            },
        },
        "eventMetadata": {
            "eventId": json.loads(line)["eventMetadata"]["eventId"],
            "inferenceId": "r-1",
            "inferenceTime": "2026-12-01T09:30:00.250Z",
        },
        "eventVersion": "0",
    }
    ids = {json.loads(encode_line(record))["eventMetadata"]["eventId"] for _ in range(50)}
    assert len(ids) == 50 and all(uuid.UUID(i).version == 4 for i in ids)


def test_binary_and_non_utf8_bodies_are_base64_and_a_shadow_answer_has_its_version() -> None:
    record = Record(
        "m/2",
        AT,
        'r-"2"',
        b"\xff\x00",
        "application/json",
        b"\x93NUMPY",
        "application/x-npy",
        shadow=b"\x93NUMPY!",
        shadow_key="m/1",
    )
    parsed = json.loads(encode_line(record))
    data = parsed["captureData"]
    assert data["endpointInput"]["encoding"] == "BASE64"  # said JSON, not UTF-8
    assert base64.b64decode(data["endpointInput"]["data"]) == b"\xff\x00"
    assert base64.b64decode(data["endpointOutput"]["data"]) == b"\x93NUMPY"
    assert data["shadowOutput"]["version"] == "1"
    assert base64.b64decode(data["shadowOutput"]["data"]) == b"\x93NUMPY!"
    assert parsed["eventMetadata"]["inferenceId"] == 'r-"2"'


def test_text_bodies_fill_their_types_form_and_fall_back_to_base64_when_not_utf8() -> None:
    """Content types with ``%`` and quotes in them are written as they came; a JSON body that
    is not UTF-8 goes as base64 (the text's form is not used for it)."""
    kind = 'application/json; note="100%s"'
    texts = Record("m", AT, 'r-"%s"', b'{"a": "%d \xc3\xa9"}', kind, b"1,%s\n", "text/csv")
    binary = texts._replace(request=b"\xff%s")
    for _ in range(2):  # the form made, then the form reused
        first, second = json.loads(encode_line(texts)), json.loads(encode_line(binary))
        assert first["captureData"] == {
            "endpointInput": {
                "observedContentType": kind,
                "mode": "INPUT",
                "data": '{"a": "%d \u00e9"}',
                "encoding": "JSON",
            },
            "endpointOutput": {
                "observedContentType": "text/csv",
                "mode": "OUTPUT",
                "data": "1,%s\n",
                "encoding": "CSV",
            },
        }
        assert first["eventMetadata"]["inferenceId"] == 'r-"%s"'
        assert first["eventMetadata"]["inferenceTime"] == "2026-12-01T09:30:00.250Z"
        assert second["captureData"]["endpointInput"] == {
            "observedContentType": kind,
            "mode": "INPUT",
            "data": base64.b64encode(b"\xff%s").decode(),
            "encoding": "BASE64",
        }
        assert second["captureData"]["endpointOutput"] == first["captureData"]["endpointOutput"]


def _event_id() -> str:
    record = Record("m", AT, "r-1", b"[1]", "application/json", b"[2]", "application/json")
    return str(json.loads(encode_line(record))["eventMetadata"]["eventId"])


def test_a_forked_process_draws_event_ids_of_its_own() -> None:
    mine = _event_id()
    with multiprocessing.get_context("fork").Pool(1) as pool:
        theirs = pool.apply(_event_id)
    assert uuid.UUID(theirs).version == 4 and theirs != mine
    assert theirs[:24] != mine[:24]  # not the parent's ids counted on
