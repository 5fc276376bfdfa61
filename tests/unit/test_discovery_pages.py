"""A source page sorted into registrations and problems: the whole-column checks discovery
runs on a page of thousands say what checking each value alone says."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from service.config.policies import resolve_policies
from service.config.policy_file import MAX_SCOPE_BYTES
from service.ledger import registration
from service.runs.page_sorting import Page, per_tenant, sort_page
from service.sweeps.store_databases import SourceRows
from tests.fakes.store_schema import CARTS_SOURCE, CARTS_TARGET, store_policy

ENV = {"SHOP_DATABASE_URL": "postgresql://shop.invalid/shop"}
POLICY = resolve_policies(
    {"stores": {"shop": {"dsn_env": "SHOP_DATABASE_URL"}},
     "policies": {"carts": store_policy(CARTS_SOURCE, CARTS_TARGET)}},
    ENV, source="p.toml").policies["carts"]
CUTOFF = datetime(2026, 12, 1, tzinfo=UTC)

# ids as a source may return them: mostly plain, sometimes empty, a dot segment, a control
# character, a lone surrogate, far too long, or NULL
_IDS = st.one_of(
    st.text(alphabet="abc-_09", min_size=1, max_size=12),
    st.sampled_from(["", ".", "..", "a\x00b", "x\x1f", "\x7f", "\ud800", "é" * 200,
                     "a" * 513, "a" * 512, "🛒" * 128, "🛒" * 129]),
    st.none(),
    st.text(max_size=20),
)


def one_by_one(values: list[str | None]) -> list[tuple[int, str]]:
    found = []
    for n, value in enumerate(values):
        problem = "is NULL" if value is None else registration.id_problem(value)
        if problem is not None:
            found.append((n, problem))
    return found


@given(st.lists(_IDS, max_size=30))
def test_a_column_has_the_problems_its_values_have(values: list[str | None]) -> None:
    assert list(registration.id_problems(values)) == one_by_one(values)


def test_a_clean_column_is_passed_whole() -> None:
    assert list(registration.id_problems([f"cart-{n}" for n in range(5000)])) == []
    assert list(registration.id_problems([])) == []


def test_each_row_keeps_its_first_problem_in_row_order() -> None:
    age = CUTOFF - timedelta(days=9)
    rows = SourceRows(["shop-1", None, "shop-1", "", "shop-2", "shop-1"],
                      ["1", "2", "..", "4", "5", "6"],
                      [age, age, age, None, None, age + timedelta(seconds=1)])
    page = sort_page(POLICY, rows, CUTOFF, in_age_order=True)
    assert list(page.registrations.object_ids) == ["1", "6"]
    assert [e["problem"] for e in page.errors] == [
        "tenant_id is NULL", "object_id must not be . or ..", "tenant_id must not be empty",
        "age is NULL"]
    assert page.rows == 6 and page.last.object_id == "6"


TENANT_SCOPED = resolve_policies(
    {"stores": {"shop": {"dsn_env": "SHOP_DATABASE_URL"}},
     "policies": {"carts": store_policy(CARTS_SOURCE, CARTS_TARGET,
                                        scope="store:{upstream}:{policy}:{tenant_id}")}},
    ENV, source="p.toml").policies["carts"]


def test_a_tenant_whose_scope_is_too_long_or_unmeasurable_is_a_problem_not_a_crash() -> None:
    """A tenant with a lone surrogate (its scope cannot be measured in UTF-8) has its id
    problem; a valid tenant whose scope would pass 512 bytes has the scope's; the page goes
    on."""
    age = CUTOFF - timedelta(days=9)
    page = sort_page(TENANT_SCOPED, SourceRows(["\ud800" * 300, "a" * 500, "shop-1"],
                                               ["1", "2", "3"], [age, age, age]), CUTOFF)
    assert list(page.registrations.object_ids) == ["3"]
    assert [e["problem"] for e in page.errors] == [
        "tenant_id must not contain control characters or unpaired surrogates",
        f"tenant_id makes a scope over {MAX_SCOPE_BYTES} bytes"]


def test_an_age_past_the_cutoff_is_due_at_the_cutoff() -> None:
    before = CUTOFF - timedelta(days=1)
    page = sort_page(POLICY, SourceRows(["s", "s"], ["1", "2"],
                                        [before, CUTOFF + timedelta(hours=1)]), CUTOFF)
    assert list(page.registrations.due_ats) == [before, CUTOFF]
    assert list(page.ages) == [before, CUTOFF + timedelta(hours=1)]


@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 1000)),
                min_size=1, max_size=40))
def test_per_tenant_figures_of_an_ordered_page_are_the_general_ones(
        rows: list[tuple[str, int]]) -> None:
    rows.sort(key=lambda r: r[1])
    tenants = [t for t, _ in rows]
    ages = [CUTOFF - timedelta(seconds=s) for _, s in reversed(rows)][::-1]
    ages.sort()
    ordered = sort_page(POLICY, SourceRows(tenants, [str(n) for n in range(len(rows))],
                                           ages), CUTOFF, in_age_order=True)
    general = Page(ordered.registrations, ordered.ages, [], ordered.last, ordered.rows)
    assert per_tenant(ordered) == per_tenant(general)
