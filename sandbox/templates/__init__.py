"""Jinja2 templates (a package only so that setuptools ships the *.j2 files as package data)."""
