"""The table of served APIs, the handler modules and ApiVersions' answer agree, so none can drift.

Each ``twophase/broker/apis/<api>.py`` registers its ``handle`` with ``@handles(key, min, max)``;
the package imports every one of them; ApiVersions advertises exactly what was registered.
"""

import ast
import asyncio
import inspect
import pkgutil
import re
from pathlib import Path

import pytest
from kio.index import load_request_schema, load_response_schema
from kio.schema.errors import ErrorCode

from twophase.broker import apis
from twophase.broker.apis import APIS, api_versions
from twophase.broker.protocol import API_BY_KEY, Request
from twophase.wire.api_keys import ApiKey

APIS_DIR = Path(apis.__file__).parent
HANDLER_MODULES = sorted(m.name for m in pkgutil.iter_modules([str(APIS_DIR)]) if not m.name.startswith("_"))
DOC_RANGE = re.compile(r"\(key (\d+)\), v(\d+)(?:-v(\d+))?")


def _imported_by_package() -> set[str]:
    tree = ast.parse((APIS_DIR / "__init__.py").read_text())
    return {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1
            and node.module is None for alias in node.names}


def test_the_package_imports_every_handler_module():
    assert _imported_by_package() == set(HANDLER_MODULES)


def test_every_handler_module_registers_exactly_one_api_and_the_table_holds_nothing_else():
    by_module = {api.handler.__name__.rsplit(".", 1)[1]: api for api in APIS}
    assert sorted(by_module) == HANDLER_MODULES
    assert len(APIS) == len(API_BY_KEY) == len(HANDLER_MODULES)
    assert [a.key for a in APIS] == sorted(API_BY_KEY)
    for name in HANDLER_MODULES:
        source = (APIS_DIR / f"{name}.py").read_text()
        assert source.count("@handles(") == 1, f"{name}.py must register exactly one handler"


@pytest.mark.parametrize("api", APIS, ids=lambda a: a.name)
def test_registration_matches_its_module(api):
    assert isinstance(api.key, ApiKey)
    assert inspect.iscoroutinefunction(api.handler.handle)
    # The module docstring names the key and the versions it serves: "Produce (key 0), v3-v9: ..."
    doc = DOC_RANGE.search(api.handler.__doc__ or "")
    assert doc, f"{api.handler.__name__}: the docstring must name '(key N), vA-vB'"
    key, low, high = int(doc[1]), int(doc[2]), int(doc[3] or doc[2])
    assert (key, low, high) == (api.key, api.min_version, api.max_version), api.handler.__name__
    assert api.handler.__doc__.startswith(f'{api.name} (key {api.key})')


@pytest.mark.parametrize("api", APIS, ids=lambda a: a.name)
def test_kio_knows_every_version_served(api):
    for version in range(api.min_version, api.max_version + 1):
        assert load_request_schema(api.key, version) and load_response_schema(api.key, version)


@pytest.mark.parametrize("version", [0, 1, 2, 3])
def test_api_versions_answers_the_table(version):
    api = API_BY_KEY[ApiKey.API_VERSIONS]
    request = Request(api, version, 1, "test", body=None)
    response = asyncio.run(api_versions.handle(None, request))
    assert response.error_code == ErrorCode.none
    assert [(k.api_key, k.min_version, k.max_version) for k in response.api_keys] == \
        [(a.key, a.min_version, a.max_version) for a in APIS]


def test_unsupported_api_versions_answer_lists_the_table_too():
    response = api_versions.unsupported_version_response()
    assert response.error_code == ErrorCode.unsupported_version
    assert [(k.api_key, k.min_version, k.max_version) for k in response.api_keys] == \
        [(a.key, a.min_version, a.max_version) for a in APIS]
