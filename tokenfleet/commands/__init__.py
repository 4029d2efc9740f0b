"""Entry points: each `tokenfleet` subcommand that composes the components (the top layer)."""
