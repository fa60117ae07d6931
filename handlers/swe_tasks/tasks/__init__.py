"""Task definitions (data only; a package so that setuptools ships the JSON files)."""
