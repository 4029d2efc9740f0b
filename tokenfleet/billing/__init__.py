"""Billing: prices per model, usage and cost by organisation, user, model and day from the warehouse table, and
the cost of a million output tokens from the replica time requests actually used."""
