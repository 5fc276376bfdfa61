"""Regions as the policies file declares them (service/config/regions.py): names, pins in
every spelling of a tenant, and the region a process may serve."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.config.regions import Regions, region_problem
from service.config.settings import Settings
from service.errors import ConfigError
from tests.conftest import policies_from

UPSTREAMS = {"shop": {"base_url": "https://shop.example"}}


def test_a_pin_covers_every_spelling_of_its_tenant() -> None:
    regions, problems = Regions.of({"eu": ["Acme.", "bücher"], "us": ["globex"]})
    assert problems == [] and regions.names == {"eu", "us"}
    for spelling in ("acme", "ACME", "acme.", "AcMe"):
        assert regions.of_tenant(spelling) == "eu"
    assert regions.of_tenant("xn--bcher-kva") == "eu" == regions.of_tenant("BÜCHER")
    assert regions.of_tenant("globex") == "us"
    assert regions.of_tenant("acme-2") is None and regions.of_tenant("initech") is None
    assert regions.served == (None, "eu", "us") and Regions().served == (None,)


@pytest.mark.parametrize("name", ["EU", "-eu", "eu-", "e u", "1eu", "eu_west", "eu.west",
                                  "eü", "eu\n", "", "a" * 33])
def test_a_region_name_is_a_plain_token(name: str) -> None:
    assert region_problem(name) is not None
    with pytest.raises(ValidationError, match="region's name"):
        Settings(region=name)


@pytest.mark.parametrize("name", ["eu", "e", "eu-west-1", "a" * 32])
def test_plain_region_names_are_taken(name: str) -> None:
    assert region_problem(name) is None
    assert Settings(region=name).region == name


def test_every_problem_of_the_regions_table_is_listed_with_its_key() -> None:
    with pytest.raises(ConfigError) as caught:
        policies_from({"upstreams": UPSTREAMS, "regions": {
            "EU": ["acme"], "eu": ["Globex", "bad\u0007id", "", "initech "],
            "us": ["globex."],
            "ap": ["x" * 513]}})
    problems = "\n".join(caught.value.problems)
    assert "regions.EU: a region's name is" in problems
    assert "regions.eu: a tenant id holds no control character" in problems
    assert "regions.eu: a tenant id is 1-512 characters" in problems
    assert "regions.eu: a tenant id neither starts nor ends with a space" in problems
    assert "regions.ap: a tenant id is 1-512 characters" in problems
    assert ("regions.us: tenant 'globex.' is pinned to region 'eu' too (as 'Globex'); "
            "a tenant has one region") in problems
    with pytest.raises(ConfigError, match=r"regions\.eu.*valid list"):
        policies_from({"upstreams": UPSTREAMS, "regions": {"eu": "acme"}})


def test_a_process_serves_only_a_declared_region() -> None:
    policies = policies_from({"upstreams": UPSTREAMS, "regions": {"eu": ["acme"], "us": []}})
    assert policies.regions.names == {"eu", "us"}
    assert policies.regions.serving_problems("eu") == []
    assert policies.regions.serving_problems(None) == []
    assert policies.regions.serving_problems("ap") == [
        "SWEEPER_REGION=ap names a region the policies file does not declare in [regions] "
        "(declared: eu, us)"]
    assert "(declared: none)" in policies_from({}).regions.serving_problems("eu")[0]


def test_the_digest_names_the_pins_not_how_they_were_written() -> None:
    one, _ = Regions.of({"eu": ["Acme", "globex"], "us": []})
    same, _ = Regions.of({"eu": ["globex", "acme."]})
    moved, _ = Regions.of({"us": ["acme", "globex"]})
    assert one.digest == same.digest != moved.digest != Regions().digest
