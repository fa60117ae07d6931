"""The trainer-facing side: the gateway daemon, its job table and journal, and the client shim."""
