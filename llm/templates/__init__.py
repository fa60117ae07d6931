"""Chat templates shipped with rolloutd (package data: *.j2)."""
