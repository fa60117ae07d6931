"""Bug patches (data only; a package so that setuptools ships the .diff files)."""
