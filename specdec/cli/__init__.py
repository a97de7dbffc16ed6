"""The ``specdec`` command line: the typer app and its commands (training and transcription included)."""

from .app import app

__all__ = ["app"]
