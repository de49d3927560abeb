"""The OpenAPI 3 description of the HTTP API, served at /openapi.json."""

from __future__ import annotations

from typing import Any

HEX64 = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
NAME = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"}
_SEG = "[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
BRANCH = {"type": "string", "pattern": f"^{_SEG}(/{_SEG})*$"}
ERROR = {"$ref": "#/components/schemas/Error"}


def _err(*codes: int) -> dict[str, Any]:
    text = {400: "invalid input", 401: "missing or invalid token", 403: "not allowed",
            404: "not found", 409: "conflict or already exists", 413: "body too large",
            416: "range not satisfiable", 423: "branch leased by another holder: retry later",
            503: "store changing owner or busy: retry",
            408: "request body stalled (nothing for 10 s)",
            415: "request has a Content-Encoding: bodies are taken uncompressed"}
    if 413 in codes:  # every operation that takes a body
        codes = (*codes, 408, 415)
    return {str(c): {"description": text[c], "content": {"application/json": {"schema": ERROR}}}
            for c in codes}


def _json_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _ok(schema: dict[str, Any], code: int = 200) -> dict[str, Any]:
    return {str(code): {"description": "ok",
                        "content": {"application/json": {"schema": schema}}}}


def _obj(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required}


def _with_links(responses: dict[str, Any], links: dict[str, Any]) -> dict[str, Any]:
    (code, resp), = responses.items()
    return {code: {**resp, "links": links}}


# What a client does next with an answer (and what stateful fuzzing follows).
FORK_LINKS = {
    "ListTheNewBranch": {"operationId": "listBranches",
                         "parameters": {"volume": "$request.path.volume"}},
    "ResolveItsHead": {"operationId": "resolveSnapshot",
                       "parameters": {"prefix": "$response.body#/head",
                                      "volume": "$request.path.volume"}},
    "ForkItsHead": {"operationId": "fork", "parameters": {"volume": "$request.path.volume"},
                    "requestBody": {"name": "$response.body#/name",
                                    "at": "$response.body#/head"}},
    "LeaseIt": {"operationId": "lease",
                "parameters": {"volume": "$request.path.volume", "action": "acquire"},
                "requestBody": {"branch": "$response.body#/name", "ttl": 30}},
    "DeleteIt": {"operationId": "deleteBranch",
                 "parameters": {"volume": "$request.path.volume",
                                "branch": "$response.body#/name"}},
}
LEASE_LINKS = {
    "RenewIt": {"operationId": "lease",
                "parameters": {"volume": "$request.path.volume", "action": "renew"},
                "requestBody": {"branch": "$request.body#/branch",
                                "lease": "$response.body#/lease", "ttl": 30}},
    "ReleaseIt": {"operationId": "lease",
                  "parameters": {"volume": "$request.path.volume", "action": "release"},
                  "requestBody": {"branch": "$request.body#/branch",
                                  "lease": "$response.body#/lease"}},
}

VOLUME_PARAM = {"name": "volume", "in": "path", "required": True, "schema": NAME}
COMMON = (400, 401, 403, 404, 503)

OPENAPI: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {"title": "strata store API", "version": "1",
             "description": "One strata server owns one store. Unix-socket clients are the "
                            "owner; TCP clients present a bearer token scoped to a volume."},
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": {
            "Error": _obj({"error": {"type": "string"}, "message": {"type": "string"},
                           "paths": {"type": "array", "items": {"type": "string"}}},
                          ["error", "message"]),
            "Lease": _obj({"fencing": {"type": "integer"}, "expires_ns": {"type": "integer"},
                           "holder": {"type": "string"}, "lease": {"type": "string"}},
                          ["fencing", "expires_ns", "lease"]),
        },
    },
    "security": [{"bearer": []}],
    "paths": {
        "/v1/info": {"get": {"summary": "store id and block size",
                             "responses": {**_ok(_obj({"store_id": {"type": "string"},
                                                       "block_size": {"type": "integer"},
                                                       "version": {"type": "integer"}},
                                                      ["store_id", "block_size"])),
                                           **_err(401, 503)}}},
        "/v1/whoami": {"get": {"summary": "what the caller's credentials allow",
                               "responses": {**_ok(_obj({"owner": {"type": "boolean"},
                                                         "writable": {"type": "boolean"}},
                                                        ["owner", "writable"])),
                                             **_err(401, 503)}}},
        "/v1/objects/missing": {"post": {
            "summary": "which of these object ids the store lacks",
            "requestBody": {"required": True, "content": {"application/octet-stream": {
                "schema": {"type": "string", "format": "binary"}}},
                "description": "concatenated 32-byte ids"},
            "responses": {"200": {"description": "concatenated 32-byte ids of missing objects",
                                  "content": {"application/octet-stream": {
                                      "schema": {"type": "string", "format": "binary"}}}},
                          **_err(400, 401, 413, 503)}}},
        "/v1/objects": {"post": {
            "summary": "upload objects (only send the missing ones)",
            "requestBody": {"required": True, "content": {"application/octet-stream": {
                "schema": {"type": "string", "format": "binary"}}},
                "description": "records: kind u8, id 32 bytes, length u32 LE, raw bytes; "
                               "the whole batch is refused if any id does not match"},
            "responses": {**_ok(_obj({"stored": {"type": "integer"}}, ["stored"])),
                          **_err(400, 401, 403, 413, 503)}}},
        "/v1/objects/get": {"post": {
            "summary": "read several objects at once (at most 1024)",
            "requestBody": {"required": True, "content": {"application/octet-stream": {
                "schema": {"type": "string", "format": "binary"}}},
                "description": "concatenated 32-byte ids"},
            "responses": {"200": {"description": "for each id in order: length u32 LE, bytes",
                                  "content": {"application/octet-stream": {
                                      "schema": {"type": "string", "format": "binary"}}}},
                          **_err(400, 401, 404, 413, 503)}}},
        "/v1/objects/{oid}": {"get": {
            "summary": "read an object, optionally a byte range (Range: bytes=a-b)",
            "parameters": [{"name": "oid", "in": "path", "required": True, "schema": HEX64},
                           {"name": "Range", "in": "header", "required": False,
                            "schema": {"type": "string"}}],
            "responses": {"200": {"description": "raw object bytes", "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
                "206": {"description": "the requested range", "content": {
                    "application/octet-stream": {
                        "schema": {"type": "string", "format": "binary"}}}},
                **_err(400, 401, 404, 416, 503)}}},
        "/v1/volumes": {
            "get": {"summary": "list volumes",
                    "responses": {**_ok(_obj({"volumes": {"type": "array",
                                                          "items": {"type": "string"}}},
                                             ["volumes"])), **_err(401, 503)}},
            "post": {"summary": "create a volume (owner only)",
                     "requestBody": _json_body(_obj({"name": NAME}, ["name"])),
                     "responses": {**_ok(_obj({"name": {"type": "string"}, "head": HEX64},
                                              ["name", "head"]), 201),
                                   **_err(400, 401, 403, 409, 503)}}},
        "/v1/volumes/{volume}": {"delete": {
            "summary": "delete a volume (owner only)", "parameters": [VOLUME_PARAM],
            "responses": {**_ok(_obj({"deleted": {"type": "string"}}, ["deleted"])),
                          **_err(*COMMON)}}},
        "/v1/volumes/{volume}/branches": {
            "get": {"summary": "branches and their heads", "parameters": [VOLUME_PARAM],
                    "operationId": "listBranches",
                    "responses": {**_ok(_obj({"branches": {"type": "object",
                                                           "additionalProperties": HEX64}},
                                             ["branches"])), **_err(*COMMON)}},
            "post": {"summary": "fork: a new branch at a snapshot (or empty when at is null)",
                     "parameters": [VOLUME_PARAM], "operationId": "fork",
                     "requestBody": _json_body(_obj({"name": BRANCH,
                                                     "at": {**HEX64, "nullable": True}},
                                                    ["name"])),
                     "responses": {**_with_links(_ok(_obj({"name": {"type": "string"},
                                                           "head": HEX64},
                                                          ["name", "head"]), 201), FORK_LINKS),
                                   **_err(400, 401, 403, 404, 409, 503)}}},
        "/v1/heads": {"post": {
            "summary": "the heads of several branches, read at one instant",
            "requestBody": _json_body(_obj({"refs": {
                "type": "array", "minItems": 1, "maxItems": 256,
                "items": {"type": "array", "minItems": 2, "maxItems": 2,
                          "items": {"type": "string"}}}}, ["refs"])),
            "responses": {**_ok(_obj({"heads": {"type": "array", "items": HEX64}},
                                     ["heads"])), **_err(400, 401, 403, 404, 503)}}},
        "/v1/volumes/{volume}/branches/{branch}": {"delete": {
            "summary": "delete a branch", "operationId": "deleteBranch",
            "parameters": [VOLUME_PARAM, {"name": "branch", "in": "path", "required": True,
                                          "schema": BRANCH}],
            "responses": {**_ok(_obj({"deleted": {"type": "string"}}, ["deleted"])),
                          **_err(*COMMON)}}},
        "/v1/volumes/{volume}/lease/{action}": {"post": {
            "summary": "acquire, renew or release a branch lease (secret lease id)",
            "operationId": "lease",
            "parameters": [VOLUME_PARAM, {"name": "action", "in": "path", "required": True,
                                          "schema": {"type": "string",
                                                     "enum": ["acquire", "renew",
                                                              "release"]}}],
            "requestBody": _json_body(_obj({"branch": BRANCH,
                                            "ttl": {"type": "number", "minimum": 0.1,
                                                    "maximum": 86400},
                                            "lease": {"type": "string"},
                                            "holder": {"type": "string"},
                                            "steal": {"type": "boolean"}}, ["branch"])),
            "responses": {**_with_links(_ok({"oneOf": [
                              {"$ref": "#/components/schemas/Lease"},
                              _obj({"released": {"type": "boolean"}}, ["released"])]}),
                                        LEASE_LINKS),
                          **_err(*COMMON, 423)}}},
        "/v1/snapshots/{prefix}": {"get": {
            "summary": "the full id of the one snapshot with this prefix",
            "operationId": "resolveSnapshot",
            "parameters": [{"name": "prefix", "in": "path", "required": True,
                            "schema": {"type": "string", "pattern": "^[0-9a-f]{8,64}$"}},
                           {"name": "volume", "in": "query", "required": False,
                            "schema": NAME}],
            "responses": {**_ok(_obj({"id": HEX64}, ["id"])), **_err(*COMMON)}}},
        "/v1/publish": {"post": {
            "summary": "publish change sets atomically (CAS; replay onto a moved head)",
            "requestBody": {"required": True, "content": {"application/msgpack": {
                "schema": {"type": "string", "format": "binary"}}},
                "description": "msgpack map {changesets: [{volume, branch, base, changes: "
                               "[[path, entry|nil]], message, meta, lease, identical}], "
                               "objects: object batch or nil, txid: 16 bytes or nil}"},
            "responses": {**_ok(_obj({"heads": {"type": "array", "items": HEX64}},
                                     ["heads"])),
                          **_err(400, 401, 403, 404, 409, 413, 423, 503)}}},
        "/v1/admin/tokens": {
            "post": {"summary": "create a token (owner only)",
                     "requestBody": _json_body(_obj({
                         "volume": NAME, "branch": {**BRANCH, "nullable": True},
                         "writable": {"type": "boolean"},
                         "ttl": {"type": "number", "nullable": True}}, ["volume", "writable"])),
                     "responses": {**_ok(_obj({"token": {"type": "string"},
                                               "id": {"type": "string"}}, ["token", "id"]),
                                         201), **_err(400, 401, 403)}},
            "get": {"summary": "list tokens (owner only; secrets are never shown)",
                    "responses": {**_ok(_obj({"tokens": {"type": "array",
                                                         "items": {"type": "object"}}},
                                             ["tokens"])), **_err(401, 403)}}},
        "/v1/admin/tokens/{tid}": {"delete": {
            "summary": "revoke a token (owner only)",
            "parameters": [{"name": "tid", "in": "path", "required": True,
                            "schema": {"type": "string"}}],
            "responses": {**_ok(_obj({"revoked": {"type": "string"}}, ["revoked"])),
                          **_err(401, 403, 404)}}},
        "/v1/admin/stats": {"get": {"summary": "engine counters and objects served "
                                               "(owner only)",
                                    "responses": {**_ok({"type": "object"}),
                                                  **_err(401, 403, 503)}}},
    },
}
