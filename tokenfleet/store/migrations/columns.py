"""What the migrations in versions/ share: the column types our tables use, the columns every owned row has, and the
constraint names (models.NAMING's convention, spelled out so that a migration never depends on the models).

A released migration must keep creating exactly the schema it created: never change what a helper here makes;
add a new one instead."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import sqlalchemy as sa
from alembic import op

UTC_TIME = sa.DateTime(timezone=True)
ROW_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # SQLite autoincrements only a plain INTEGER key
ID = sa.String(64)  # our ids (new_id), the ids they refer to, and short names (tier, pool)
NAME = sa.String(200)
REQUEST_ID = sa.String(128)
STATUS = sa.String(16)
COUNT = sa.BigInteger()
SECONDS = sa.Float()


def required(kind: sa.types.TypeEngine, *names: str) -> list[sa.Column]:
    """NOT NULL columns of one type, in the order given."""
    return [sa.Column(name, kind, nullable=False) for name in names]


def optional(kind: sa.types.TypeEngine, *names: str) -> list[sa.Column]:
    """Nullable columns of one type, in the order given."""
    return [sa.Column(name, kind, nullable=True) for name in names]


def owned() -> list[sa.Column]:
    """A row a user of an organisation owns (a key, a conversation, a stored response): its id, then the owner's."""
    return required(ID, "id", "org_id", "user_id")


def create_table(
    table: str,
    *columns: sa.Column,
    key: str = "id",
    references: Mapping[str, str] | None = None,
    unique: Sequence[tuple[str, ...]] = (),
) -> None:
    """The table with its primary key on `key`, a foreign key to `<table>.id` for each column in `references`
    (column -> table), and a unique constraint for each tuple of columns in `unique`, all named as models.NAMING
    names them."""
    op.create_table(
        table,
        *columns,
        sa.PrimaryKeyConstraint(key, name=f"pk_{table}"),
        *(
            sa.ForeignKeyConstraint([column], [f"{target}.id"], name=f"fk_{table}_{column}_{target}")
            for column, target in (references or {}).items()
        ),
        *(sa.UniqueConstraint(*names, name=f"uq_{table}_{'_'.join(names)}") for names in unique),
    )
