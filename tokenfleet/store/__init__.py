"""The platform's durable records in SQL: organisations, their users and API keys today (usage and conversations
come as further migrations). One schema for SQLite (embedded, aiosqlite) and PostgreSQL (fleet, asyncpg), through
SQLAlchemy's async ORM; Alembic migrations ship in `migrations/` and run with `await migrate(url)`."""
