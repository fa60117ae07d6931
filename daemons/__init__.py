"""The daemons: a shared main loop (signals, poll, heartbeat, drain) and one class per process."""
