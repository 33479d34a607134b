"""`kvconnect bench` (KV-shaped pulls against a same-run copy ceiling) and the start-up transport verdict."""
