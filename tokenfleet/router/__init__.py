"""The router: picks a replica for each request (cache-aware, bounded-load), with its prefix index and hash ring."""
