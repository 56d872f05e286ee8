"""One tenancy rule for the router and the engine."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from kvmesh.core.tenancy import TENANT_HEADER, Role, resolve_tenant
from kvmesh.errors import RequestError


def headers(**values: str) -> CIMultiDict[str]:
    return CIMultiDict({k.replace("_", "-"): v for k, v in values.items()})


def test_header_or_salt_names_the_tenant():
    assert resolve_tenant(headers(), None) == ""
    assert resolve_tenant(headers(x_tenant_id="acme"), None) == "acme"
    assert resolve_tenant(headers(X_Tenant_Id="acme"), None) == "acme"
    assert resolve_tenant(headers(), "acme") == "acme"
    assert resolve_tenant(headers(x_tenant_id="acme"), "acme") == "acme"


@pytest.mark.parametrize(
    ("given", "salt", "param", "fragment"),
    [
        ({TENANT_HEADER: "acme"}, "globex", "cache_salt", "name different tenants"),
        ({TENANT_HEADER: ""}, None, None, "must not be empty"),
        ({}, "", "cache_salt", "non-empty string"),
        ({}, 7, "cache_salt", "non-empty string"),
    ],
)
def test_conflicts_and_bad_values_are_client_errors(given, salt, param, fragment):
    with pytest.raises(RequestError) as info:
        resolve_tenant(CIMultiDict(given), salt)
    assert info.value.status == 400
    assert info.value.param == param
    assert fragment in info.value.message


def test_role_values_and_parse():
    assert [r.value for r in Role] == ["both", "prefill", "decode"]
    assert Role.parse(None) is Role.BOTH
    assert Role.parse("") is Role.BOTH
    assert Role.parse("Prefill") is Role.PREFILL
    with pytest.raises(ValueError, match=r"both\|prefill\|decode"):
        Role.parse("mixed")


def test_every_package_uses_the_one_role():
    from kvmesh.engine import core, request
    from kvmesh.router import types

    assert core.Role is Role and request.Role is Role
    assert types.Role is Role
