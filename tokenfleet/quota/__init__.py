"""Token quotas: token buckets per user and organisation behind one interface, in Redis (Lua) or in memory."""
