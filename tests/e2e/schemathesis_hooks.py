"""Schemathesis hooks for tests/e2e/test_core_openapi_fuzz.py (loaded through SCHEMATHESIS_HOOKS).

`contract_server_errors` replaces schemathesis's `not_a_server_error`: a 5xx is accepted only where the
contract itself answers one for a state the run made on purpose (an administrator's random connection
details point at no database: 502 `connection_failed`, or at one that rejects the statement: 500 `query_failed`;
a statement over its limit: 504 `query_timeout`; a bound reached: 503 with Retry-After). Any other 5xx, a 500
`internal_error` (a crash) above all, fails the run, as does a 5xx whose body is not the contract's shape.
"""
from __future__ import annotations

import json

import schemathesis

ALLOWED = {(502, "connection_failed"), (504, "query_timeout"), (503, "too_many_streams"),
           (503, "store_unavailable"),
           # the database itself rejecting a statement (an administrator's random connection details: a MySQL
           # connection saved with no database answers "No database selected"); a crash is internal_error
           (500, "query_failed")}


@schemathesis.check
def contract_server_errors(ctx, response, case):
    if response.status_code < 500:
        return None
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(f"{response.status_code} without a JSON error body") from None
    if not isinstance(body, dict) or not {"error", "code", "request_id"} <= set(body):
        raise AssertionError(f"{response.status_code} without the contract's error shape: {body!r}")
    if (response.status_code, body["code"]) not in ALLOWED:
        raise AssertionError(f"server error {response.status_code} {body['code']}: {body['error']}")
    if response.status_code == 503 and "Retry-After" not in response.headers:
        raise AssertionError("503 without Retry-After")
    return None
