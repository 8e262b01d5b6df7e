"""RunPod's OpenAPI document (tests/runpod/openapi.json) and how the stub holds both sides to it: a 2020-12
validator per schema (date-time checked as RFC 3339), the operation a path matches, a request's parameters
checked and typed, an answer checked against what its operation declares, and RunPod's problem shape."""

from __future__ import annotations

import datetime as dt
import json
import re
from http import HTTPStatus
from pathlib import Path
from typing import Any

import jsonschema

SPEC_PATH = Path(__file__).parent / "runpod" / "openapi.json"
SPEC: dict = json.loads(SPEC_PATH.read_text())

RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")

FORMATS = jsonschema.FormatChecker(())  # only date-time, checked without optional dependencies


@FORMATS.checks("date-time", raises=ValueError)
def _is_date_time(value: object) -> bool:
    if isinstance(value, str):
        parse_ts(value)
    return True


def parse_ts(value: str) -> dt.datetime:
    if not RFC3339.match(value):
        raise ValueError(f"{value!r} is not an RFC 3339 date-time")
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def format_ts(t: dt.datetime, micro: bool = False) -> str:
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


def now_ts() -> str:
    return format_ts(dt.datetime.now(dt.UTC))


_VALIDATORS: dict[str, jsonschema.Draft202012Validator] = {}


def validator(schema: dict) -> jsonschema.Draft202012Validator:
    """A 2020-12 validator for a schema of the document (its $refs resolve in the document's components)."""
    key = json.dumps(schema, sort_keys=True)
    if key not in _VALIDATORS:
        _VALIDATORS[key] = jsonschema.Draft202012Validator({**schema, "components": SPEC["components"]},
                                                           format_checker=FORMATS)
    return _VALIDATORS[key]


def schema_errors(schema: dict, instance: object) -> list[str]:
    """The validation messages, RunPod's way: `$.path: message`."""
    errors = sorted(validator(schema).iter_errors(instance), key=lambda e: (list(map(str, e.absolute_path)), e.message))
    return [f"{e.json_path}: {e.message}" for e in errors]


def resolve(obj: dict) -> dict:
    while "$ref" in obj:
        node: Any = SPEC
        for part in obj["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        obj = node
    return obj


def problem(status: int, detail: str, errors: list[str] | None = None) -> dict:
    out = {"title": HTTPStatus(status).phrase, "status": status, "detail": detail}
    if errors is not None:
        out["errors"] = errors
    return out


# The document's operations: (compiled path, template, path item), literal paths before templated ones.
OPERATIONS = sorted(
    ((re.compile("^" + re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(p)) + "$"), p, item)
     for p, item in SPEC["paths"].items()), key=lambda o: o[1].count("{"))


def match_operation(method: str, path: str) -> tuple[str, dict, dict | None, dict] | None:
    """The document's operation for a request: (path template, path item, operation or None when the path
    has no such method, path parameters); None when no path matches."""
    for regex, template, item in OPERATIONS:
        m = regex.match(path)
        if m:
            return template, item, item.get(method.lower()), m.groupdict()
    return None


def check_params(item: dict, op: dict, query: dict[str, str], headers: dict[str, str]) -> tuple[list[str], dict]:
    """The query and header parameters against the operation's: errors, and the query as typed values.
    `headers` has lower-case names."""
    declared = [resolve(p) for p in item.get("parameters", []) + op.get("parameters", [])]
    errors: list[str] = []
    typed: dict[str, Any] = {}
    known = {p["name"] for p in declared if p["in"] == "query"}
    errors += [f"$.query.{name}: unknown query parameter" for name in query if name not in known]
    for p in declared:
        if p["in"] not in ("query", "header"):
            continue
        if p["in"] == "query" and p["name"] in query:
            raw = query[p["name"]]
        elif p["in"] == "header" and p["name"].lower() in headers:
            raw = headers[p["name"].lower()]
        else:
            if p.get("required"):
                errors.append(f"$.{p['in']}.{p['name']}: required")
            continue
        kind = resolve(p["schema"]).get("type")
        value: Any = raw
        if kind == "integer" and re.fullmatch(r"-?\d+", raw):
            value = int(raw)
        elif kind == "boolean" and raw in ("true", "false"):
            value = raw == "true"
        elif kind == "array":
            value = raw.split(",") if raw else []
        errors += [e.replace("$", f"$.{p['in']}.{p['name']}", 1) for e in schema_errors(p["schema"], value)]
        if p["in"] == "query":
            typed[p["name"]] = value
    return errors, typed


def response_errors(op: dict | None, status: int, ctype: str | None, body: Any, call: str) -> list[str]:
    """What the document refuses in an answer: its status, its content type, its body (None: not checked)
    against the operation's response for that status (or `default`); no operation: the problem shape."""
    if op is None:  # no operation: the document's problem shape
        content = {"application/problem+json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    else:
        declared = op["responses"].get(str(status)) or op["responses"].get("default")
        if declared is None:
            return [f"{call}: answered {status}, which the document does not declare"]
        content = resolve(declared).get("content", {})
    if ctype is None:
        return [f"{call}: answered {status} with no body; the document says {list(content)}"] if content else []
    if ctype not in content:
        return [f"{call}: answered {status} {ctype}; the document says {list(content) or 'no body'}"]
    if body is not None and "schema" in content[ctype] and ctype != "text/event-stream":
        return [f"{call}: answered {status}: {e}" for e in schema_errors(content[ctype]["schema"], body)]
    return []


def check_object(schema_name: str, obj: dict) -> None:
    """An object the stub made (a test's pod, a volume) holds to the document's schema of that name."""
    errors = schema_errors({"$ref": f"#/components/schemas/{schema_name}"}, obj)
    assert not errors, f"the stub made a {schema_name} the document refuses: {errors}"
