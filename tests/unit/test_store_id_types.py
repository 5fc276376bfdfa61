"""service.config.store_statements.ids_type and id_type_problem: the type a store target's
statement casts its ids to, read from its text, and the ids that type could never take (refused at
registration and discovery instead of failing a batch)."""

from __future__ import annotations

import pytest

from service.config.store_statements import id_type_problem, ids_type


@pytest.mark.parametrize(("statement", "kind"), [
    ("DELETE FROM carts WHERE id = ANY(CAST(:object_ids AS bigint[])) RETURNING id", "bigint"),
    ("DELETE FROM t WHERE id = ANY(cast( :object_ids as INTEGER [] )) RETURNING id",
     "integer"),
    ("DELETE FROM t WHERE id = ANY(:object_ids::uuid[]) RETURNING id", "uuid"),
    ("DELETE FROM t WHERE id = ANY(:object_ids) RETURNING id", None),
    ("DELETE FROM t WHERE id::text = ANY(:object_ids) RETURNING id -- CAST(:object_ids AS "
     "bigint[])", None),  # a comment casts nothing
])
def test_the_type_is_read_from_the_statement(statement: str, kind: str | None) -> None:
    assert ids_type(statement) == kind


@pytest.mark.parametrize(("kind", "object_id"), [
    ("bigint", "1); DROP TABLE carts;--"), ("bigint", "9223372036854775808"),
    ("bigint", "-9223372036854775809"), ("bigint", "1.5"), ("bigint", ""), ("bigint", "0x1f"),
    ("integer", "2147483648"), ("smallint", "32768"), ("int8", "1e3"),
    ("uuid", "not-a-uuid"), ("uuid", "urn:uuid:12345678-1234-5678-1234-567812345678"),
])
def test_ids_the_type_cannot_take(kind: str, object_id: str) -> None:
    problem = id_type_problem(kind, object_id)
    assert problem is not None and kind in problem
    assert object_id not in problem or not object_id  # never quoted


@pytest.mark.parametrize(("kind", "object_id"), [
    ("bigint", "9223372036854775807"), ("bigint", "-9223372036854775808"), ("bigint", " 42 "),
    ("bigint", "+7"), ("integer", "2147483647"), ("smallint", "-32768"),
    ("uuid", "12345678-1234-5678-1234-567812345678"), ("text", "anything at all"),
    (None, "1); DROP TABLE carts;--"),
])
def test_ids_the_type_takes(kind: str | None, object_id: str) -> None:
    assert id_type_problem(kind, object_id) is None
